"""What the machine can do fast, decided once per process.

bf16 is 2-3x faster than fp32 on CPUs with AVX512-bf16 or AMX and on recent GPUs, and 50-100x
*slower* on CPUs without them (measured on an AVX2-only AMD EPYC with torch 2.13: fp32 matmul
62 GFLOP/s, bf16 0.9; a bf16 conv3d 100x an fp32 one), where PyTorch falls back to scalar
emulation. So every "use bf16" default in the project asks `bf16_is_fast` first.

`AVATARSTREAM_BF16=1` / `=0` forces the answer (benchmarks, or a CPU whose flags we misread).

`AVATARSTREAM_VAE_BACKEND` picks how the causal VAE decodes a stream's steady chunks
(`models/vae_backend.py`): eager (default), auto (a compiled package when one is on disk), aoti,
compile, openvino or onnx.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from avatarstream.errors import ConfigError

_CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags") or line.startswith("Features"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def bf16_is_fast(device: str | torch.device = "cpu") -> bool:
    """True where bf16 compute beats fp32 on `device` (see the module docstring)."""
    forced = os.environ.get("AVATARSTREAM_BF16", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if dev.type != "cpu":
        return False
    return any(f in _cpu_flags() for f in _CPU_BF16_FLAGS)


def vae_backend() -> str:
    """The causal VAE's streaming-decode backend: `AVATARSTREAM_VAE_BACKEND`, else "eager".

    "auto" decodes a stream's steady chunks with the ahead-of-time compiled package of this model
    and chunk shape when one is on disk (`avatarstream models compile` builds them: ≈ 20-35 s a
    shape, once per machine; loading takes milliseconds), eagerly otherwise. It is not the
    default: alone, or beside a busy thread, a package decodes a chunk in 0.81x / 0.44x eager's
    time, but inside `generate` (decode overlapped with the DiT on 2 cores) a whole run was
    slower (`bench realtime` rtf 1.74 against 2.88, one run). `models/vae_backend.py` lists
    every backend."""
    from avatarstream.models.vae_backend import BACKENDS

    kind = os.environ.get("AVATARSTREAM_VAE_BACKEND", "").strip().lower() or "eager"
    if kind not in BACKENDS:
        raise ConfigError(f"AVATARSTREAM_VAE_BACKEND={kind!r}: use one of {', '.join(BACKENDS)}")
    return kind


def check_device(device: str) -> None:
    """The `--device` of generate, serve, bench realtime and eval benchmark: "cuda" where torch
    sees no CUDA GPU is a ConfigError up front (one line), not a failure deep in the first
    tensor moved there. "cpu" is always fine."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {device}: no CUDA GPU is available to torch here; use --device cpu")


def resolve_bf16(setting: bool | str | None, device: str | torch.device = "cpu") -> bool:
    """A bf16 setting of a recipe or CLI: True/False as given, "auto"/None -> `bf16_is_fast`."""
    if setting is None or setting == "auto":
        return bf16_is_fast(device)
    if isinstance(setting, str):
        return setting.lower() in ("1", "true", "yes", "on")
    return bool(setting)


def split_decode(strategy: str, decode_overlap: bool, *, live: bool = False) -> bool:
    """Whether `generate` decodes each chunk in two parts on two threads (`SplitWorker`: the
    VAE's low-resolution part of chunk k+1 beside the rest of chunk k, both beside the DiT), for
    the prefix and interp strategies with the overlapped decode. Measured on 2 AVX512-bf16 cores
    (bundled model, 256 px, `generate` rtf, runs alternated): split with one thread per part
    3.33-3.69, one decode thread with 2 intra-op threads (the previous default) 3.14-3.60, split
    with 2 threads 2.99-3.14. A causal block's decode is small beside its eight DiT passes, so
    causal keeps one decode thread. Live sessions (`live`: the server's scheduler, whose chunks
    are shorter and batched) keep one decode thread too: `bench sessions` on the same machine
    kept 3 sessions in real time with it (2 intra-op threads) and 2 with the split (1 thread).
    `AVATARSTREAM_SPLIT_DECODE=1` / `=0` forces it either way."""
    if not decode_overlap:
        return False
    forced = os.environ.get("AVATARSTREAM_SPLIT_DECODE", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    return not live and strategy in ("prefix", "interp")


def parallel_history_pass(threads: int | None = None, cores: int | None = None) -> bool:
    """Whether the causal strategy runs a step's extra history forward (`history_level` "next")
    on a second thread beside the next step (`CausalDenoiser`): where a second team of the
    generating thread's size fits in the cores (1 thread on 2 cores, the causal default there).
    `AVATARSTREAM_PARALLEL_HISTORY=1` / `=0` forces it."""
    forced = os.environ.get("AVATARSTREAM_PARALLEL_HISTORY", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    n = threads if threads is not None else torch.get_num_threads()
    c = cores if cores is not None else (os.cpu_count() or 1)
    return 2 * n <= c


def generation_threads(strategy: str, decode_overlap: bool, cores: int | None = None) -> int:
    """Torch threads of the generating thread when the user sets none.

    The causal strategy runs many small DiT passes (a block is 3 latent frames, ~200 tokens; 8
    passes a block with the "next" history level). With the VAE decode on a thread of its own
    (`decode_overlap`), two intra-op threads for those passes plus the decode oversubscribe the
    cores and the passes slow down more than the extra thread speeds them up. Measured on 2 cores
    (`bench realtime --model avatarstream-small-causal`): 1 thread rtf 2.20, causal denoise 200 ms
    a block; 2 threads rtf 1.24, 365 ms; 2 threads with the decode inline rtf 1.84. So causal
    leaves one core to the decode. `prefix`/`interp` chunks are 8 latent frames; with the split
    decode (`split_decode`: three threads of model work, the decode threads inherit this number)
    each gets half the cores, one thread on 2 cores (the measurements are in `split_decode`),
    else every core."""
    n = cores if cores is not None else torch.get_num_threads()
    if strategy == "causal" and decode_overlap:
        return max(1, n - 1)
    if split_decode(strategy, decode_overlap):
        return max(1, n // 2)
    return max(1, n)
