"""Checkpoint I/O of training runs, and where a network's starting weights come from.

A run folder holds `ckpt-<step>.safetensors` (every tensor of the run: `model.<net>.<param>`,
`ema.<net>.<param>`, `optim.<state>`) and its sidecar `ckpt-<step>.json` (step, optimiser step
count, recipe fingerprint, ...). Both are written to a temporary name, synced and renamed, the
sidecar after the weights, so a checkpoint exists once its sidecar does and a run killed
mid-write resumes from the one before.

A run under torchrun (train/distributed.py) writes its checkpoints in torch's distributed
checkpoint format instead: a folder `ckpt-<step>/` (DCP: `.metadata` and one `.distcp` file per
rank, each rank writing its own shards; the same keys as the safetensors file, plus each rank's
RNG state as `rng.rank<r>`) and the same sidecar, written by rank 0 after every rank finished.
`load_checkpoint` reads either form as full tensors in one process (no process group), so export,
`[init]` and a one-process `--resume` take a torchrun run's checkpoints as they are.

Starting weights (`[init]`, `dmd.teacher`, `dmd.fake_init`) are read by `net_weights` from a run
folder, an exported weights folder, a prepared file or a bare .safetensors, and loaded by
`load_init`, which also takes weights older than the network (new inputs start at zero, an LR
DiT is lifted to a larger patch).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
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
    """Complete checkpoints (sidecar + weights file or DCP folder), newest first: (step, sidecar,
    weights)."""
    out = []
    for js in run_dir.glob("ckpt-*.json"):
        try:
            step = int(js.stem.split("-")[1])
        except (IndexError, ValueError):
            continue
        st, folder = js.with_suffix(".safetensors"), js.with_suffix("")
        if st.is_file():
            out.append((step, js, st))
        elif (folder / ".metadata").is_file():
            out.append((step, js, folder))
    return sorted(out, reverse=True)


def read_dcp(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint folder, whole (resharded by DCP), in this one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    meta = reader.read_metadata().state_dict_metadata
    out = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.items()
           if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(out, storage_reader=reader, no_dist=True)
    return out


def load_checkpoint(run_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """(sidecar, tensors) of the newest readable checkpoint (either form), or None."""
    from safetensors.torch import load_file

    for _, js, st in list_checkpoints(run_dir):
        try:
            tensors = read_dcp(st) if st.is_dir() else load_file(str(st))
            return json.loads(js.read_text()), {k: v for k, v in tensors.items() if not k.startswith("rng.")}
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
    write_sidecar(run_dir, step, sidecar)
    prune(run_dir, keep)
    return weights


def prune(run_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints (sidecar first: never a sidecar without data),
    and DCP folders older than the newest checkpoint that never got their sidecar (a save killed
    half way)."""
    found = list_checkpoints(run_dir)
    for _, js, st in found[keep:]:
        js.unlink(missing_ok=True)
        if st.is_dir():
            shutil.rmtree(st, ignore_errors=True)
        else:
            st.unlink(missing_ok=True)
    for folder in run_dir.glob("ckpt-*"):
        torn = folder.is_dir() and not folder.with_suffix(".json").exists()
        if torn and found and folder.name.split("-")[-1].isdigit() and int(folder.name.split("-")[-1]) < found[0][0]:
            shutil.rmtree(folder, ignore_errors=True)


def write_sidecar(run_dir: Path, step: int, sidecar: dict[str, Any]) -> Path:
    """The sidecar of checkpoint `step` (`version` added), written atomically: it makes the
    checkpoint exist, so it is written after the data."""
    js = run_dir / f"ckpt-{step:08d}.json"
    atomic_write_bytes(js, json.dumps({"version": CKPT_VERSION, **sidecar}, indent=1).encode())
    return js


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
