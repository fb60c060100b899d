"""`avatarstream train export RUN --out DIR` for a `grpo` or `dpo` run: the aligned model.

The model is the one the run aligned (`grpo.model` / `dpo.model`) with its DiT replaced by the
run's EMA weights: the other networks, the pipeline settings (steps, guidance scales, strategy)
and the storage dtype are the base model's, so the aligned model runs at the same steps and cost.
config.json records the base and the run under "aligned". A base without a weights folder (the
random test models) gets one written from its networks.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from avatarstream.errors import InputError
from avatarstream.train.checkpoints import load_checkpoint

NETS = ("dit", "refiner", "vae", "audio", "text")


def export_aligned(run_dir: str | Path, out: str | Path, *, dtype: str | None = None) -> dict[str, Any]:
    from safetensors.torch import save_file

    from avatarstream.registry import load_model, model_spec_for

    rd = Path(run_dir)
    ck = load_checkpoint(rd)
    if ck is None:
        raise InputError(f"{rd}: no checkpoint (is it a training run folder?)")
    side, t = ck
    recipe = json.loads((rd / "recipe.json").read_text())
    stage = recipe["stage"]
    base = recipe[stage]["model"]
    spec = model_spec_for(base)
    models = load_model(base, bf16=False)
    folder = Path(spec.weights) if spec.weights is not None else None
    cfg: dict[str, Any]
    if folder is not None:
        cfg = json.loads((folder / "config.json").read_text())
        cfg.pop("shared", None)  # every file is written here
    else:
        nets = {n: getattr(models, n) for n in NETS if getattr(models, n) is not None}
        cfg = {"model": recipe["model"], "dtype": "fp32", "trained": {}, "untrained": [], "frozen_copies": {},
               "configs": {n: dataclasses.asdict(getattr(m.model, "config", None) or m.model.cfg)
                           for n, m in nets.items()},
               "pipeline": dataclasses.asdict(models.config)}
    store = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype or cfg.get("dtype", "bf16")]
    out = Path(out)
    if folder is not None and out.resolve() == folder.resolve():
        staging = out.with_name(out.name + ".aligned-tmp")
    else:
        staging = out
    staging.mkdir(parents=True, exist_ok=True)
    for name in NETS:
        mod = getattr(models, name)
        if mod is None:
            continue
        sd = mod.model.state_dict()
        if name == "dit":
            missing = [k for k in sd if f"ema.dit.{k}" not in t and f"model.dit.{k}" not in t]
            if missing:
                raise InputError(f"{rd}: its DiT does not match {base}'s ({len(missing)} tensors missing)")
            sd = {k: t.get(f"ema.dit.{k}", t.get(f"model.dit.{k}")) for k in sd}
        save_file({k: (v.to(store) if v.is_floating_point() else v).detach().contiguous() for k, v in sd.items()},
                  str(staging / f"{name}.safetensors"))
    cfg["dtype"] = "bf16" if store == torch.bfloat16 else "fp32"
    cfg["aligned"] = {"base": base, "stage": stage, "run": str(rd), "step": int(side["step"]),
                      "method": recipe[stage].get("method", "diffusion-dpo")}
    (staging / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))
    if staging != out:  # replacing the base folder in place: swap the files in only once all are written
        for p in staging.iterdir():
            shutil.move(str(p), str(out / p.name))
        staging.rmdir()
    return {"out": str(out), "base": base, "stage": stage, "step": int(side["step"]), "dtype": cfg["dtype"]}
