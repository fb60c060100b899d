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
import logging
import math
from pathlib import Path
from typing import Any

import torch

from avatarstream.errors import InputError
from avatarstream.weights.lora import LoRASettings

META_KEY = "avatarstream_lora"
log = logging.getLogger(__name__)


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
    InputError naming the file when it is missing, unreadable, its header is not a safetensors
    one of floating-point tensors (weights/headers.py, as every weights file), its settings are
    not a rank, a finite alpha and a list of module names (`settings_of`), or a tensor holds a
    NaN or Inf (it would turn the model's output into black frames)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from avatarstream.weights.headers import safetensors_header

    p = Path(path)
    if not p.is_file():
        raise InputError(f"--lora {p}: no such file")
    try:
        safetensors_header(p, str(p))  # sizes, dtypes (floats only), byte ranges: before reading it
        tensors = load_file(str(p))
        with safe_open(str(p), "pt") as f:
            raw = (f.metadata() or {}).get(META_KEY)
    except InputError as e:
        raise InputError(f"--lora {e}") from None
    except Exception as e:  # noqa: BLE001 - any unreadable file is the user's, named
        raise InputError(f"--lora {p}: not a safetensors file ({str(e).splitlines()[0][:200]})") from None
    if raw is None:
        raise InputError(f"--lora {p}: no LoRA settings in its header (`{META_KEY}`: rank, alpha, "
                         "targets); write it with `avatarstream train personality`")
    try:
        meta = json.loads(raw)
        settings = settings_of(meta)
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"--lora {p}: damaged LoRA settings in its header ({e})") from None
    for k, t in tensors.items():
        if not bool(torch.isfinite(t).all()):
            raise InputError(f"--lora {p}: {k!r} holds NaN or infinite values: a broken adapter (did its "
                             "training diverge?); retrain it")
    return tensors, settings, meta


MAX_RANK, MAX_SCALE = 4096, 1024.0


def settings_of(meta: Any) -> LoRASettings:
    """rank (an integer in 1..MAX_RANK), alpha (a finite number, 0 < alpha / rank <= MAX_SCALE)
    and targets (a non-empty list of module names) of a header entry; ValueError naming the one
    that is not."""
    if not isinstance(meta, dict):
        raise ValueError("not an object")
    rank, alpha, targets = meta["rank"], meta["alpha"], meta["targets"]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise ValueError(f"rank {rank!r} is not an integer in 1..{MAX_RANK}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) \
            or not 0 < alpha / rank <= MAX_SCALE:
        raise ValueError(f"alpha {alpha!r} is not a finite number with 0 < alpha / rank <= {MAX_SCALE:g}")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"targets {json.dumps(targets)[:60]} is not a list of module names")
    return LoRASettings(rank=rank, alpha=float(alpha), targets=tuple(targets))


def _canonical(name: str) -> str:
    """A model name as it can be compared: `family:DIR[,...]` and weights folders by their resolved path."""
    head, sep, rest = name.partition(":")
    if sep and head and "/" not in head and rest:
        return f"{head}:{Path(rest.split(',')[0]).expanduser().resolve()}"
    p = Path(name).expanduser()
    return str(p.resolve()) if p.exists() else name


def merge_adapter(net: torch.nn.Module, tensors: dict[str, torch.Tensor], settings: LoRASettings,
                  meta: dict[str, Any], running: str, what: str) -> int:
    """`merge_lora` of a `read_lora_file` adapter into the DiT of the model named `running`,
    checked against the base its header names first: when the tensors do not fit and that base is
    another model, the one line says so ("this adapter was trained for X, you are running Y")
    before a summary of the mismatches; when they fit under another name (a folder moved), it is
    merged with a warning."""
    from avatarstream.weights.lora import merge_lora

    base = meta.get("base")
    other = isinstance(base, str) and _canonical(base) != _canonical(running)
    try:
        merged = merge_lora(net, tensors, settings, what=what)
    except InputError as e:
        if not other:
            raise
        raise InputError(f"{what}: this adapter was trained for {base}, you are running {running} "
                         f"(give --model {base}, or train one for this model): "
                         f"{str(e).removeprefix(f'{what}: ')}") from None
    if other:
        log.warning("%s: trained for %s, merged into %s (its tensors fit)", what, base, running)
    return merged
