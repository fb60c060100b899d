"""What the machine can do fast, decided once per process.

bf16 is 2-3x faster than fp32 on CPUs with AVX512-bf16 or AMX and on recent GPUs, and 50-100x
*slower* on CPUs without them (measured on an AVX2-only AMD EPYC with torch 2.13: fp32 matmul
62 GFLOP/s, bf16 0.9; a bf16 conv3d 100x an fp32 one), where PyTorch falls back to scalar
emulation. So every "use bf16" default in the project asks `bf16_is_fast` first.

`AVATARSTREAM_BF16=1` / `=0` forces the answer (benchmarks, or a CPU whose flags we misread).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

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


def resolve_bf16(setting: bool | str | None, device: str | torch.device = "cpu") -> bool:
    """A bf16 setting of a recipe or CLI: True/False as given, "auto"/None -> `bf16_is_fast`."""
    if setting is None or setting == "auto":
        return bf16_is_fast(device)
    if isinstance(setting, str):
        return setting.lower() in ("1", "true", "yes", "on")
    return bool(setting)
