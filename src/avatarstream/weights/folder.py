"""Reading a weights folder: `{dit,refiner,vae,audio,text}.safetensors` + `config.json`.

config.json = {"model": size preset, "configs": network configs, "pipeline": the inference
defaults the export chose, "trained": net -> run, "untrained", "shared"} (written by `train
export`; its write side stays in `train/export.py`). A direct model has no refiner file.

`"shared"` maps a network whose file lives in another folder to {"file": path relative to this
folder, "sha256"} (a causal student keeps its teacher's VAE, audio and text encoders). Every
reader goes through `weights_file`, which checks the hash: a shared file that changed or went
missing is a clear error, never another model's weights loaded silently.

Reading needs nothing of the trainer: the configs come from config.json (through the folder's
`StateDictAdapter`), the network classes from `models/`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from avatarstream.engine.config import PipelineConfig
from avatarstream.errors import ConfigError, InputError
from avatarstream.weights.adapters import NATIVE, NETWORK_CONFIGS, StateDictAdapter
from avatarstream.weights.spec import ModelSpec, pipeline_preset

# the inference defaults an export chooses; every other pipeline field is today's preset's
EXPORTED_PIPELINE_KEYS = ("audio_scale", "ref_scale", "guidance_input", "lr_size", "steps", "strategy",
                          "block", "kv_blocks", "adaptive_sink", "history_level")


def read_config(folder: str | Path, adapter: StateDictAdapter = NATIVE) -> dict[str, Any]:
    """A folder's config.json in today's schema (see `adapters._native_config`)."""
    return adapter.config(json.loads((Path(folder) / "config.json").read_text()))


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, computed once per (path, size, mtime)."""
    st = path.stat()
    return _sha256(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def weights_file(folder: str | Path, net: str) -> Path | None:
    """The .safetensors file of `net` in an exported folder: its own, or the one config.json's
    `shared` points to (hash checked); None if the folder has no such network."""
    folder = Path(folder)
    own = folder / f"{net}.safetensors"
    if own.is_file():
        return own
    cfg_path = folder / "config.json"
    ref = json.loads(cfg_path.read_text()).get("shared", {}).get(net) if cfg_path.is_file() else None
    if ref is None:
        return None
    other = (folder / ref["file"]).resolve()
    if not other.is_file():
        raise InputError(f"{folder}: its {net} weights are shared with {ref['file']}, which is missing "
                         "(copy that folder beside it, or re-export without --share-with)")
    if file_sha256(other) != ref["sha256"]:
        raise InputError(f"{folder}: its {net} weights are shared with {ref['file']}, which has changed "
                         "since the export (re-export this folder, or restore that file)")
    return other


def model_spec(folder: str | Path, name: str | None = None, adapter: StateDictAdapter = NATIVE) -> ModelSpec:
    """The `ModelSpec` of a weights folder: the network sizes the weights were exported with
    (config.json, not today's preset) and today's pipeline preset under the inference defaults
    the export chose (CFG scales, steps, a direct model's lr_size, the causal strategy's block,
    window, sink rule and history level)."""
    folder = Path(folder)
    cfg = read_config(folder, adapter)
    model = cfg["model"]
    configs = {net: functools.partial(cls, **cfg["configs"][net]) for net, cls in NETWORK_CONFIGS.items()}
    keep = {k: cfg["pipeline"][k] for k in EXPORTED_PIPELINE_KEYS if cfg["pipeline"].get(k) is not None}
    preset = pipeline_preset(model)

    def pipeline() -> PipelineConfig:
        return dataclasses.replace(preset(), **keep)

    refiner = configs["refiner"] if weights_file(folder, "refiner") is not None else None
    return ModelSpec(name or folder.name, configs["dit"], refiner, configs["vae"], configs["audio"],
                     configs["text"], pipeline, weights=folder, description=f"trained ({model}) from {folder}",
                     adapter=adapter)


def load_weights(spec: ModelSpec, nets: Mapping[str, nn.Module | None]) -> None:
    """Load the spec's weights folder into `nets` (strictly, through its adapter); a None entry
    (a direct model's refiner) is skipped."""
    from safetensors.torch import load_file

    assert spec.weights is not None
    for name, net in nets.items():
        if net is None:
            continue
        path = weights_file(spec.weights, name)
        if path is None:
            raise ConfigError(f"{spec.weights}: no {name}.safetensors (a weights folder made by "
                              "`avatarstream train export` has one per network)")
        net.load_state_dict(spec.adapter.state_dict(name, load_file(str(path), device="cpu")), strict=True)


def load_exported(folder: str | Path) -> dict[str, nn.Module]:
    """The networks of an exported folder (four for a direct model), loaded strictly."""
    spec = model_spec(folder)
    nets = {k: v for k, v in spec.networks().items() if v is not None}
    load_weights(spec, nets)
    return nets
