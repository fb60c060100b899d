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
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

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


def package_key(module: nn.Module, sources: Iterable[str | Path], extra: str) -> str:
    """The file name stem of the package of `module` computed by `sources` for inputs `extra`."""
    h = hashlib.sha256()
    h.update(f"torch {torch.__version__}; {platform.machine()} "
             f"{torch.backends.cpu.get_cpu_capability()}; {extra};".encode())
    for src in sources:
        h.update(Path(src).read_bytes())
    h.update(module_digest(module).encode())
    return h.hexdigest()[:32]


def load(key: str) -> Runner | None:
    """The package `key` loaded from the cache, or None (never built, or removed as unusable)."""
    path = cache_root() / f"{key}.pt2"
    if not path.is_file():
        return None
    try:
        compiled = torch._inductor.aoti_load_package(str(path))
    except Exception as e:  # a damaged file, or a package from another torch build
        log.warning("compiled package %s does not load (%s: %s): removed; it is rebuilt when asked",
                    path, type(e).__name__, e)
        path.unlink(missing_ok=True)
        return None
    return lambda *a: list(compiled(*a))


def build(key: str, module: nn.Module, args: tuple[torch.Tensor, ...]) -> Runner:
    """Export `module(*args)` (fixed shapes), compile it to the package `key` and load it."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with torch.inference_mode(False), torch.no_grad(), torch.autocast("cpu", enabled=False):
        args = tuple(a.clone() for a in args)  # export refuses inference tensors
        program = torch.export.export(module, args)
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{key}-", suffix=".pt2")
        os.close(fd)
        try:
            torch._inductor.aoti_compile_and_package(program, package_path=tmp,
                                                     inductor_configs={"freezing": True})
            os.replace(tmp, root / f"{key}.pt2")
        finally:
            Path(tmp).unlink(missing_ok=True)
    log.info("compiled package %s built in %.1f s", key, time.perf_counter() - t0)
    runner = load(key)
    if runner is None:
        raise RuntimeError(f"the package {key} just built does not load")
    return runner
