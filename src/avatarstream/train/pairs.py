"""`avatarstream train pairs`: render preference pairs for `avatarstream annotate` and `train dpo`.

    avatarstream train pairs --out PAIRS [--model NAME] [--conditions N] [--seconds S] [--seed K]
                             [--stochastic OVERSHOOT] [--device cpu|cuda]

Per condition (synthetic train-split cases, train/conditions.py), two renders of the same speech
through the engine's own chunk loop with different noise seeds (train/rollout.py): each written
as an H.264 + AAC video (what the annotator watches, watermarked like every render) and as its
rollout record (what DPO trains on), scored by the reward terms (train/rewards.py) so that
`annotate auto` can rank them without people. The folder:

    PAIRS/pairs.jsonl   {"pair", "condition", "left", "right", "left_record", "right_record",
                         "text", "auto": {"left": total, "right": total}, "terms": {...}}
    PAIRS/renders/      rNNNN.mp4 + rNNNN.safetensors

Resumable: a pair whose two records and videos exist is kept, so a killed run continues.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from avatarstream.errors import ConfigError, InputError


def parser(make: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    p = make(prog="avatarstream train pairs", add_help=False)
    p.add_argument("--out", required=True, help="the pairs folder to write (or continue)")
    p.add_argument("--model", default="avatarstream-small", help="registry model or weights folder")
    p.add_argument("--conditions", type=int, default=8)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=11, help="draws the train-split conditions")
    p.add_argument("--stochastic", type=float, default=0.0, metavar="OVERSHOOT",
                   help="render with the stochastic sampler at this overshoot (0: the model's sampler)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-progress", action="store_true")
    return p


def _text(cond: Any) -> str:
    return getattr(cond, "text", "") or ""


def run(ns: argparse.Namespace) -> dict[str, Any]:
    from avatarstream.publish.file import FragmentedMP4Sink
    from avatarstream.registry import load_model
    from avatarstream.train.conditions import synthetic_conditions
    from avatarstream.train.rewards import RewardModel
    from avatarstream.train.rollout import rollout, save_rollout

    if ns.conditions < 1 or not 0.5 <= ns.seconds <= 30 or ns.stochastic < 0:
        raise ConfigError("train pairs: --conditions >= 1, --seconds in [0.5, 30] and --stochastic >= 0")
    out = Path(ns.out)
    try:
        (out / "renders").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--out {out}: cannot create it ({e.strerror})") from None
    models = load_model(ns.model, device=ns.device)
    conds = synthetic_conditions(ns.conditions, seconds=ns.seconds, seed=ns.seed, size=models.config.hr_size)
    reward = RewardModel()
    lines, made = [], 0
    show = not ns.no_progress
    for i, cond in enumerate(conds):
        names = [f"r{2 * i:04d}", f"r{2 * i + 1:04d}"]
        rows = []
        for j, name in enumerate(names):
            video, rec = out / "renders" / f"{name}.mp4", out / "renders" / f"{name}.safetensors"
            if not (video.is_file() and rec.is_file()):
                tmp = video.with_suffix(".part.mp4")
                r = rollout(models, cond, seed=1000 * ns.seed + 2 * i + j,
                            sampler="stochastic" if ns.stochastic else None,
                            overshoot=ns.stochastic or None, sinks=[FragmentedMP4Sink(tmp)])
                save_rollout(rec, r, {"condition": cond.name, "model": ns.model})
                os.replace(tmp, video)
                made += 1
                scores = reward(r.frames, cond)
                (out / "renders" / f"{name}.json").write_text(json.dumps(scores))
            rows.append(json.loads((out / "renders" / f"{name}.json").read_text()))
        lines.append({"pair": f"p{i:04d}", "condition": cond.name,
                      "left": f"renders/{names[0]}.mp4", "right": f"renders/{names[1]}.mp4",
                      "left_record": f"renders/{names[0]}.safetensors",
                      "right_record": f"renders/{names[1]}.safetensors", "text": _text(cond),
                      "auto": {"left": rows[0]["total"], "right": rows[1]["total"]},
                      "terms": {"left": rows[0], "right": rows[1]}})
        if show:
            import sys

            print(f"pairs: {i + 1}/{len(conds)} conditions ({made} renders made)", file=sys.stderr, flush=True)
    tmp = out / "pairs.jsonl.tmp"
    tmp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    os.replace(tmp, out / "pairs.jsonl")
    return {"out": str(out), "pairs": len(lines), "renders_made": made, "model": ns.model}
