"""`avatarstream train export RUN_DIR [RUN_DIR ...] --out weights/NAME/`: one weights folder the
registry can load.

For each of the five networks the weights come from the first run (in the order given) that
*trained* it (its EMA weights); a network no run trained is taken from a run that held it frozen
(e.g. the audio encoder copied into an `sr` run), else it keeps its deterministic initial weights
and is listed under `untrained` in config.json. All runs must share one model size preset.

Folder: `{dit,refiner,vae,audio,text}.safetensors` + `config.json` = {"model": preset, network
configs, "pipeline": the preset's PipelineConfig fields, "trained": net -> run, "untrained"}.
`model_spec(folder)` turns it into a registry `ModelSpec` (weights=folder).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from avatarstream.errors import InputError
from avatarstream.train.tasks import NETS, build_nets, init_net
from avatarstream.train.trainer import load_checkpoint


def export(run_dirs: list[str | Path], out: str | Path, *, seed: int = 0) -> dict[str, Any]:
    from safetensors.torch import save_file

    runs = []
    for rd in run_dirs:
        rd = Path(rd)
        ck = load_checkpoint(rd)
        if ck is None:
            raise InputError(f"{rd}: no checkpoint (is it a training run folder?)")
        runs.append((rd, *ck))
    models = {side["model"] for _, side, _ in runs}
    if len(models) != 1:
        raise InputError(f"runs mix model sizes {sorted(models)}; export runs of one size")
    model = models.pop()
    nets = build_nets(model)
    trained: dict[str, str] = {}
    frozen: dict[str, str] = {}
    untrained: list[str] = []
    for i, name in enumerate(sorted(nets)):
        net = nets[name]
        src = next(((rd, t) for rd, side, t in runs if name in side["trainable"]), None)
        prefix = f"ema.{name}."
        if src is None:
            src = next(((rd, t) for rd, side, t in runs if any(k.startswith(f"model.{name}.") for k in t)), None)
            prefix = f"model.{name}."
        if src is None:
            init_net(name, net, seed * 101 + i)
            untrained.append(name)
            continue
        rd, t = src
        sd = net.state_dict()
        for k in sd:  # EMA holds parameters; buffers come from the model copy
            key = prefix + k if prefix + k in t else f"model.{name}.{k}"
            sd[k] = t[key].to(sd[k].dtype)
        net.load_state_dict(sd)
        (trained if prefix.startswith("ema") else frozen)[name] = str(rd)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    total = 0
    for name in NETS:
        p = out / f"{name}.safetensors"
        save_file({k: v.detach().contiguous() for k, v in nets[name].state_dict().items()}, str(p))
        total += p.stat().st_size
    from avatarstream.registry import _small_pipeline, _tiny_pipeline

    pipe = (_tiny_pipeline if model == "tiny" else _small_pipeline)()
    cfg = {"model": model,
           "configs": {n: dataclasses.asdict(nets[n].cfg if n == "vae" else nets[n].config) for n in NETS},
           "pipeline": dataclasses.asdict(pipe), "trained": trained, "frozen_copies": frozen,
           "untrained": untrained}
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    return {"out": str(out), "model": model, "bytes": total, "trained": trained,
            "frozen_copies": frozen, "untrained": untrained}


def model_spec(folder: str | Path, name: str | None = None):  # type: ignore[no-untyped-def]
    """A registry `ModelSpec` for an exported folder (sizes from its config.json preset)."""
    from avatarstream.models.audio import AudioConfig
    from avatarstream.models.dit import DiTConfig
    from avatarstream.models.refiner import RefinerConfig
    from avatarstream.models.text import TextConfig
    from avatarstream.models.vae import VAEConfig
    from avatarstream.registry import ModelSpec, _small_pipeline, _tiny_pipeline

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    m = cfg["model"]
    pick = lambda c: getattr(c, m)  # noqa: E731
    return ModelSpec(name or folder.name, pick(DiTConfig), pick(RefinerConfig), pick(VAEConfig),
                     pick(AudioConfig), pick(TextConfig), _tiny_pipeline if m == "tiny" else _small_pipeline,
                     weights=folder, description=f"trained ({m}) from {folder}")


def load_exported(folder: str | Path) -> dict[str, torch.nn.Module]:
    """The five networks of an exported folder, loaded strictly into the model classes."""
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    nets = build_nets(cfg["model"])
    for name, net in nets.items():
        net.load_state_dict(load_file(str(folder / f"{name}.safetensors")), strict=True)
    return nets
