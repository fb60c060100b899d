"""Helpers of the training tests: recipes resolved against the session's tiny datasets, runs,
their logs, and the fixed batches losses are measured on."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from avatarstream.train.recipe import load_recipe
from avatarstream.train.trainer import Trainer, step_generator

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def recipe(name: str, dataset: dict, **over: object) -> dict:
    """Recipe `name` on a test dataset, `section__key=value` overrides applied. A `from_scratch`
    dataset's runs (the causal tests') start every network from its init: no `[init]` weights,
    no DMD teacher."""
    sets = [f'data.{k}="{dataset[k]}"' for k in ("shards", "prepared") if k in dataset]
    if dataset.get("from_scratch"):
        sets += ['init.dit=""', 'init.audio=""', 'init.text=""'] + (['dmd.teacher=""'] if name.startswith("dmd") else [])
    sets += [f"{k.replace('__', '.')}={json.dumps(v) if isinstance(v, (str, bool)) else v}" for k, v in over.items()]
    return load_recipe(RECIPES / f"{name}.toml", sets)


def run(name: str, dataset: dict, run_dir: Path, *, max_steps: int | None = None, resume: bool = False,
        **over: object) -> Trainer:
    t = Trainer(recipe(name, dataset, **over), run_dir, max_steps=max_steps, progress=False)
    t.run(resume=resume)
    return t


def losses(run_dir: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run_dir / "log.jsonl").read_text().splitlines()]


FAST = {"vae-tiny": {"vae__crop": 32, "train__batch": 2},
        "a2v-tiny": {"train__batch": 2},
        "sr-tiny": {"train__batch": 2},
        "cfg-distill-tiny": {"train__batch": 2}}
STEPS = {"vae-tiny": 30, "a2v-tiny": 60, "sr-tiny": 60, "cfg-distill-tiny": 30}  # seconds each on one core
ALL = list(STEPS)


def needs(name: str, runs: dict[str, Path]) -> dict[str, str]:
    """[init] overrides: sr and cfg-distill start from the a2v run (audio/text; cfg: the DiT too)."""
    if name == "sr-tiny":
        return {"init__audio": str(runs["a2v-tiny"]), "init__text": str(runs["a2v-tiny"])}
    if name == "cfg-distill-tiny":
        return {f"init__{n}": str(runs["a2v-tiny"]) for n in ("dit", "audio", "text")}
    return {}


def held_out_loss(t: Trainer) -> float:
    """Mean loss over 6 fixed batches (generators of steps the run never draws), no grad."""
    with torch.no_grad(), t._autocast():
        return sum(float(t.task.loss(step_generator(99, 10_000 + i))[0]) for i in range(6)) / 6


def state_of(t: Trainer) -> dict[str, torch.Tensor]:
    return t.state_tensors()
