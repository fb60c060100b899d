"""A LoRA file that carries its own settings: how `train personality` writes an adapter and how
`--lora FILE` (generate, serve) reads one back.

The tensors are PEFT's (`base_model.model.<module>.lora_A.weight` `[rank, in]`, `lora_B`
`[out, rank]`: what weights/lora.py checks and merges). PEFT keeps rank, alpha and the target
modules in a separate adapter_config.json; here they travel in the safetensors header instead
(`__metadata__["avatarstream_lora"]`, JSON: rank, alpha, targets, plus what the trainer records:
the base model, the family, steps, ...), so one file is the whole adapter. A file without that
entry (an adapter from elsewhere) is refused with a message saying what is missing: merged with
guessed settings it would silently scale the update wrongly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from avatarstream.errors import InputError
from avatarstream.weights.lora import LoRASettings

META_KEY = "avatarstream_lora"


def lora_key(module: str, half: str) -> str:
    """PEFT's `save_pretrained` key of one half ("A" or "B") of a module's adapter."""
    return f"base_model.model.{module}.lora_{half}.weight"


def save_lora_file(path: str | Path, tensors: dict[str, torch.Tensor], settings: LoRASettings,
                   info: dict[str, Any] | None = None) -> Path:
    """Write an adapter (fp32, contiguous) with its settings and `info` in the header, through a
    temporary file and a rename (never half a file)."""
    from safetensors.torch import save_file

    path = Path(path)
    meta = {"rank": settings.rank, "alpha": settings.alpha, "targets": list(settings.targets), **(info or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.detach().float().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
              metadata={META_KEY: json.dumps(meta), "format": "pt"})
    tmp.replace(path)
    return path


def read_lora_file(path: str | Path) -> tuple[dict[str, torch.Tensor], LoRASettings, dict[str, Any]]:
    """(tensors, settings, the whole header entry) of an adapter `save_lora_file` wrote; an
    InputError naming the file when it is missing, unreadable or carries no settings."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    p = Path(path)
    if not p.is_file():
        raise InputError(f"--lora {p}: no such file")
    try:
        with safe_open(str(p), "pt") as f:
            raw = (f.metadata() or {}).get(META_KEY)
        tensors = load_file(str(p))
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's, named
        raise InputError(f"--lora {p}: not a safetensors file ({str(e).splitlines()[0]})") from None
    if raw is None:
        raise InputError(f"--lora {p}: no LoRA settings in its header (`{META_KEY}`: rank, alpha, "
                         "targets); write it with `avatarstream train personality`")
    try:
        meta = json.loads(raw)
        settings = LoRASettings(rank=int(meta["rank"]), alpha=float(meta["alpha"]),
                                targets=tuple(str(t) for t in meta["targets"]))
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"--lora {p}: damaged LoRA settings in its header ({e})") from None
    return tensors, settings, meta
