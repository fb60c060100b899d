"""Graphs compiled ahead of time (AOTInductor packages), kept on disk between processes.

`torch.compile` pays its compilation in every process (≈ 30 s of one core for the bundled
model's decode step; ≈ 13 s with inductor's own warm caches), more than a short `generate`
saves. An AOTInductor package (`torch.export` + `torch._inductor.aoti_compile_and_package`) is
the same kind of compiled graph as a shared library with its weights folded in: built once
(≈ 40 s), then loaded in milliseconds by any later process.

A package is valid for exactly what it was built from, so its file name is a digest of all of
it: the torch version, the CPU's vector extension (an AVX512 build would crash on an AVX2
machine), the module's parameters and buffers (names, shapes, dtypes, values), the source files
of the computation, and the caller's own key (input shapes, dtype). Anything else changed gives
another name, never a stale graph. Packages are written to a temporary name and renamed into
place, so a killed build leaves no half file under the final name; a file that does not load
(damaged, or from another build of torch) is removed and reported as missing.

Where: `AVATARSTREAM_CACHE_DIR`, else `$XDG_CACHE_HOME/avatarstream`, else
`~/.cache/avatarstream`; packages live in its `aoti/` folder.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from avatarstream.errors import ConfigError

log = logging.getLogger(__name__)

Runner = Callable[..., list[torch.Tensor]]


def cache_root() -> Path:
    """The folder of compiled packages (see the module docstring)."""
    base = os.environ.get("AVATARSTREAM_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = str(Path(xdg) / "avatarstream") if xdg else str(Path.home() / ".cache" / "avatarstream")
    return Path(base) / "aoti"


def module_digest(module: nn.Module) -> str:
    """sha256 of a module's parameters and buffers: names, shapes, dtypes and values."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def machine_kind() -> str:
    """What a compiled package's code may assume of the CPU: the vector ISA inductor compiles for
    (its pick, with its own flags: AVX512 with VNNI, bf16, AMX...) and the CPU's feature flags
    (a package from a machine with AMX or AVX512-bf16 would die of an illegal instruction on one
    without, which no `try` can catch)."""
    from torch._inductor import cpu_vec_isa

    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    except OSError:
        pass
    return (f"torch {torch.__version__}; {platform.machine()}; {cpu_vec_isa.pick_vec_isa()}; "
            f"{hashlib.sha256(flags.encode()).hexdigest()[:16]}")


def package_key(module: nn.Module, sources: Iterable[str | Path], extra: str,
                digest: str | None = None) -> str:
    """The file name stem of the package of `module` (`digest`: its `module_digest`, when the
    caller keeps it) computed by `sources` for inputs `extra`, on this machine."""
    h = hashlib.sha256()
    h.update(f"{machine_kind()}; {extra};".encode())
    for src in sources:
        h.update(Path(src).read_bytes())
    h.update((digest or module_digest(module)).encode())
    return h.hexdigest()[:32]


def load(key: str) -> Runner | None:
    """The package `key` loaded from the cache, or None (never built, or removed as unusable)."""
    path = cache_root() / f"{key}.pt2"
    if not path.is_file():
        return None
    try:
        compiled = torch._inductor.aoti_load_package(str(path))
    except (OSError, MemoryError) as e:  # this machine now (no room to unpack, no file handles)
        log.warning("compiled package %s not loaded (%s: %s): decoding eagerly this time", path,
                    type(e).__name__, e)
        return None
    except Exception as e:  # the file itself: damaged, or not a package this torch reads
        log.warning("compiled package %s does not load (%s: %s): removed; `avatarstream models "
                    "compile` builds it again", path, type(e).__name__, e)
        path.unlink(missing_ok=True)
        return None
    return lambda *a: list(compiled(*a))


def build(key: str, module: nn.Module, args: tuple[torch.Tensor, ...]) -> Runner:
    """Export `module(*args)` (fixed shapes), compile it to the package `key` and load it."""
    root = cache_root()
    t0 = time.perf_counter()
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{key}-", suffix=".pt2")
        os.close(fd)
    except OSError as e:
        raise ConfigError(f"compiled packages are kept in {root}, which cannot be written ({e}); "
                          "set AVATARSTREAM_CACHE_DIR to a writable folder") from e
    try:
        with torch.inference_mode(False), torch.no_grad(), torch.autocast("cpu", enabled=False):
            args = tuple(a.clone() for a in args)  # export refuses inference tensors
            program = torch.export.export(module, args)
            torch._inductor.aoti_compile_and_package(program, package_path=tmp,
                                                     inductor_configs={"freezing": True})
        os.replace(tmp, root / f"{key}.pt2")
    except (subprocess.CalledProcessError, OSError) as e:  # no C++ compiler, no room, ...
        raise ConfigError(f"compiling the package failed ({type(e).__name__}: {e}); it needs a C++ "
                          "compiler (g++) and room in " + str(root)) from e
    finally:
        Path(tmp).unlink(missing_ok=True)
    log.info("compiled package %s built in %.1f s", key, time.perf_counter() - t0)
    runner = load(key)
    if runner is None:
        raise RuntimeError(f"the package {key} just built does not load")
    return runner
