"""Checkpoint I/O of training runs, and where a network's starting weights come from.

A run folder holds `ckpt-<step>.safetensors` (every tensor of the run: `model.<net>.<param>`,
`ema.<net>.<param>`, `optim.<state>`) and its sidecar `ckpt-<step>.json` (step, optimiser step
count, recipe fingerprint, ...). Both are written to a temporary name, synced and renamed, the
sidecar after the weights, so a checkpoint exists once its sidecar does and a run killed
mid-write resumes from the one before.

Starting weights (`[init]`, `dmd.teacher`, `dmd.fake_init`) are read by `net_weights` from a run
folder, an exported weights folder, a prepared file or a bare .safetensors, and loaded by
`load_init`, which also takes weights older than the network (new inputs start at zero, an LR
DiT is lifted to a larger patch).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from avatarstream.errors import InputError

# 2: the optimizer state is torch's Muon / AdamW (momentum averages, per-parameter AdamW step
# counts); 1: our own Muon's (momentum sums, one step count: `MuonAdamW.load_state_tensors` converts)
CKPT_VERSION = 2
# inputs added to a network after weights were trained without them; they start at zero, so the
# network computes what it computed before until training moves them
NEW_INPUTS = ("anchor_embedding.",)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path, Path]]:
    """Complete checkpoints (sidecar + weights), newest first: (step, sidecar, weights)."""
    out = []
    for js in run_dir.glob("ckpt-*.json"):
        st = js.with_suffix(".safetensors")
        try:
            step = int(js.stem.split("-")[1])
        except (IndexError, ValueError):
            continue
        if st.is_file():
            out.append((step, js, st))
    return sorted(out, reverse=True)


def load_checkpoint(run_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """(sidecar, tensors) of the newest readable checkpoint, or None."""
    from safetensors.torch import load_file

    for _, js, st in list_checkpoints(run_dir):
        try:
            return json.loads(js.read_text()), load_file(str(st))
        except Exception:  # noqa: BLE001 - a damaged file (torn write, bad header): use the one before
            continue
    return None


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a synced temporary file and a rename (never half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: Path, step: int, tensors: dict[str, torch.Tensor], sidecar: dict[str, Any],
                    keep: int) -> Path:
    """Write checkpoint `step` (weights, then its sidecar with `version` added) and delete all but
    the newest `keep`; returns the weights file."""
    from safetensors.torch import save

    run_dir.mkdir(parents=True, exist_ok=True)
    stem = f"ckpt-{step:08d}"
    weights = run_dir / f"{stem}.safetensors"
    atomic_write_bytes(weights, save(tensors))
    atomic_write_bytes(run_dir / f"{stem}.json",
                       json.dumps({"version": CKPT_VERSION, **sidecar}, indent=1).encode())
    for _, js, st in list_checkpoints(run_dir)[keep:]:
        js.unlink(missing_ok=True)
        st.unlink(missing_ok=True)
    return weights


def net_weights(source: str | Path, net: str) -> dict[str, torch.Tensor]:
    """Weights of `net` from a run folder (EMA if that run trained it, else its model copy), an
    exported weights folder (`<net>.safetensors`), a prepared file (its `vae.*`: the VAE with the
    latent statistics folded in, which a decoder fine-tune for that file's DiT starts from) or a
    .safetensors file of the net alone."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from avatarstream.weights.folder import weights_file

    p = Path(source)
    exported = weights_file(p, net) if p.is_dir() else None
    if exported is not None:
        return load_file(str(exported))
    if p.is_file() and p.suffix == ".safetensors":
        with safe_open(str(p), "pt") as f:
            keys = [k for k in f.keys() if k.startswith(f"{net}.")]
            if keys:
                return {k[len(net) + 1:]: f.get_tensor(k) for k in keys}
        return load_file(str(p))
    if p.is_dir():
        ck = load_checkpoint(p)
        if ck is None:
            raise InputError(f"{p}: no checkpoint in this run folder")
        _, t = ck
        for prefix in (f"ema.{net}.", f"model.{net}."):
            sd = {k[len(prefix):]: v for k, v in t.items() if k.startswith(prefix)}
            if sd:
                return sd
        raise InputError(f"{p}: its checkpoints hold no {net} weights")
    raise InputError(f"cannot read {net} weights from {p} (a run folder, weights folder or .safetensors)")


def load_init(net: torch.nn.Module, sd: dict[str, torch.Tensor], what: str) -> None:
    """Load starting weights; parameters under `NEW_INPUTS` that `sd` lacks are zeroed; a DiT's
    weights with a smaller spatial patch are lifted to this one's (`lift_patch_state`: an LR DiT
    starting an output-resolution one)."""
    from avatarstream.train.surgery import HEAD_KEYS, lift_patch_state

    shapes = {k: v.shape for k, v in net.state_dict().items()}
    missing_ok: tuple[str, ...] = ()
    if getattr(getattr(net, "config", None), "x0_skip", False) and any(
            k in sd and sd[k].shape != shapes[k] for k in HEAD_KEYS):
        # an LR velocity head says nothing about x̂0 − anchor: the head starts at zero (x̂0 = the
        # anchor: the still scene frame), the rest of the network carries over
        sd = {k: v for k, v in sd.items() if k not in HEAD_KEYS}
        missing_ok = HEAD_KEYS
    sd = lift_patch_state(sd, shapes)
    wrong = [k for k, v in sd.items() if k in shapes and v.shape != shapes[k]]
    if wrong:
        raise InputError(f"{what}: weights do not fit the network ({wrong[0]}: "
                         f"{tuple(sd[wrong[0]].shape)} vs {tuple(shapes[wrong[0]])})")
    missing, unexpected = net.load_state_dict(sd, strict=False)
    bad = [k for k in missing if not k.startswith(NEW_INPUTS) and k not in missing_ok]
    if bad or unexpected:
        raise InputError(f"{what}: weights do not fit the network (missing {bad[:4]}, "
                         f"unexpected {list(unexpected)[:4]})")
    with torch.no_grad():
        params = dict(net.named_parameters())
        for k in missing:
            params[k].zero_()
