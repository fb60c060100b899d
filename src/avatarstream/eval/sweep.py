"""`avatarstream eval sweep`: the steps trade-off curve of a model — Sync-C, Sync-D, FaceSim,
mouth closed in silence, FPS and time to first frame per denoising step count, on the same
held-out cases (ground truth evaluated once), with each count checked against the ground-truth
ratio targets (`targets.py`) so the lowest count that holds them can be read off.

    avatarstream eval sweep --model NAME --steps 1,2,3,4 [--split S] [--seed X] [--clips N] [--seconds S] --json
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from avatarstream.errors import ConfigError, InputError
from avatarstream.eval.benchmark import MAX_STEPS, Bench, load_subject, summarize
from avatarstream.eval.experts import Experts
from avatarstream.eval.report import COLORS, Plot
from avatarstream.eval.targets import FACE_SIM_MIN, SYNC_C_MIN, SYNC_D_MAX, holds_gt_ratios, ratio
from avatarstream.media.image import write_png

ROW_KEYS = ("steps", "sync_c", "sync_d", "face_sim", "fps", "ttff_s", "silence_mouth_closed", "style_error")


def parse_steps(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (sorted, distinct, each 1..MAX_STEPS); anything else is an InputError."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        steps = [int(p) for p in parts]
    except ValueError:
        raise InputError(f"--steps takes step counts separated by commas, like 1,2,4; got {text!r}") from None
    if any(not 1 <= s <= MAX_STEPS for s in steps):
        raise InputError(f"--steps: each step count must be between 1 and {MAX_STEPS}; got {text!r}")
    if len(set(steps)) != len(steps):
        raise InputError(f"--steps lists a step count twice: {text!r}")
    return sorted(steps)


def sweep_rows(bench: Bench, model: str, models: Any, steps: list[int],
               known: dict[int, list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """One row per step count: means over the bench's cases (model runs with the video reference),
    ratios to ground truth and whether the count holds the ratio targets. `known`: per-case metrics
    already measured at a step count (not run again)."""
    gt = summarize([bench.ground_truth(c).metrics for c in bench.cases])
    rows = []
    for s in steps:
        per_case = (known or {}).get(s)
        if per_case is None:
            per_case = [bench.run(c, model, models, steps=s)[1] for c in bench.cases]
        m = summarize(per_case)
        r: dict[str, Any] = {k: m.get(k) for k in ROW_KEYS if k != "steps"}
        r = {"steps": s, **r}
        for k in ("sync_c", "sync_d", "face_sim"):
            r[f"{k}_ratio"] = ratio(m.get(k), gt.get(k))
        r["holds_targets"] = holds_gt_ratios(m, gt)
        rows.append(r)
    return rows


def plot_sweep(path: Path, curves: dict[str, list[dict[str, Any]]], gts: dict[str, dict[str, Any]]) -> str:
    """Three stacked panels against steps (x): Sync-C, FaceSim, FPS; one colour per split, with
    the target line (0.8 x / 0.9 x ground truth) in the split's colour, thin. Returns the caption."""
    steps = sorted({r["steps"] for rows in curves.values() for r in rows})
    xr = (steps[0] - 0.5, steps[-1] + 0.5)
    panels, ranges = [], []
    for metric, k in (("sync_c", SYNC_C_MIN), ("face_sim", FACE_SIM_MIN), ("fps", None)):
        vals = [r[metric] for rows in curves.values() for r in rows if r[metric] is not None]
        vals += [k * g[metric] for g in gts.values() if k is not None and g.get(metric) is not None]
        hi = max(vals + [1e-3]) * 1.15
        lo = min(0.0, min(vals, default=0.0))
        p = Plot(xr, (lo, hi), h=180)
        for ci, (split, rows) in enumerate(curves.items()):
            col = COLORS[ci % len(COLORS)]
            if k is not None and gts[split].get(metric) is not None:
                p.line(np.array(xr), np.full(2, k * gts[split][metric]), col, 1)
            xs = np.array([r["steps"] for r in rows], float)
            ys = np.array([np.nan if r[metric] is None else r[metric] for r in rows], float)
            p.line(xs, ys, col, 2)
            p.points(xs, ys, col, 4)
        panels.append(p.img)
        ranges.append(f"{lo:.2f}..{hi:.2f}")
    sep = np.full((6, panels[0].shape[1], 3), 255, np.uint8)
    write_png(path, np.concatenate([panels[0], sep, panels[1], sep, panels[2]], 0))
    colours = ", ".join(f"{name} ({c})" for name, c in zip(curves, ("blue", "orange", "green")))
    return (f"Steps trade-off (x: denoising steps {steps[0]}..{steps[-1]}). Panels top to bottom: Sync-C "
            f"(y {ranges[0]}), FaceSim (y {ranges[1]}), FPS (y {ranges[2]}). Thick lines with dots: the model "
            f"per split — {colours}; thin horizontal lines: the targets {SYNC_C_MIN:g} × and {FACE_SIM_MIN:g} × "
            "ground truth on that split.")


def sweep_table(rows_by_split: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Markdown table of sweep rows."""
    def f(v: Any) -> str:
        return "–" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)

    md = ["| split | steps | Sync-C ↑ (× GT) | Sync-D ↓ (× GT) | FaceSim ↑ (× GT) | silence closed | style err | "
          "fps | TTFF s | holds targets |", "|" + " --- |" * 10]
    for split, rows in rows_by_split.items():
        for r in rows:
            md.append(f"| {split} | {r['steps']} | {f(r['sync_c'])} ({f(r['sync_c_ratio'])}) | {f(r['sync_d'])} "
                      f"({f(r['sync_d_ratio'])}) | {f(r['face_sim'])} ({f(r['face_sim_ratio'])}) | "
                      f"{f(r['silence_mouth_closed'])} | {f(r['style_error'])} | {f(r['fps'])} | {f(r['ttff_s'])} | "
                      f"{'yes' if r['holds_targets'] else 'no'} |")
    md += ["", f"Targets: Sync-C ≥ {SYNC_C_MIN:g} × ground truth, Sync-D ≤ {SYNC_D_MAX:g} ×, FaceSim ≥ "
           f"{FACE_SIM_MIN:g} × (ground truth scored on the same cases). FPS and TTFF of the whole pipeline on "
           "this machine."]
    return md


def run_sweep(model: str, split: str, steps: list[int], *, seconds: float = 10.0, clips: int = 3, seed: int = 0,
              out: Path | None = None, experts: Experts | None = None) -> dict[str, Any]:
    """Sweep `steps` for `model` on `split`; writes OUT/sweep.{json,md,png} when `out` is given."""
    if not steps:
        raise InputError("--steps needs at least one step count, like 1,2,4")
    models = load_subject(model)
    if models is None:
        raise ConfigError(f"eval sweep runs a registry model; {model} is a baseline without denoising steps")
    t0 = time.perf_counter()
    bench = Bench(split, seconds=seconds, clips=clips, seed=seed, experts=experts)
    rows = sweep_rows(bench, model, models, steps)
    gt = summarize([bench.ground_truth(c).metrics for c in bench.cases])
    holding = [r["steps"] for r in rows if r["holds_targets"]]
    result: dict[str, Any] = {
        "model": model, "split": split, "seed": seed, "clips": clips, "seconds": seconds,
        "default_steps": models.config.steps, "lowest_steps_holding_targets": min(holding) if holding else None,
        "ground_truth": {k: gt.get(k) for k in ("sync_c", "sync_d", "face_sim", "silence_mouth_closed", "style_error")},
        "rows": rows, "wall_s": round(time.perf_counter() - t0, 2)}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        caption = plot_sweep(out / "sweep.png", {split: rows}, {split: gt})
        result["plot"] = str(out / "sweep.png")
        cmd = (f"avatarstream eval sweep --model {model} --steps {','.join(map(str, steps))} --split {split} "
               f"--seed {seed} --clips {clips} --seconds {seconds:g} --out {out} --json")
        md = [f"# Steps sweep: {model} on {split} (seed {seed}, {clips} × {seconds:g} s)", "", "```", cmd, "```", ""]
        md += sweep_table({split: rows})
        md += ["", f"Default steps: {models.config.steps}; lowest swept count holding the targets: "
               f"{result['lowest_steps_holding_targets']}.", "", "![sweep.png](sweep.png)", "", caption]
        (out / "sweep.md").write_text("\n".join(md) + "\n")
        (out / "sweep.json").write_text(json.dumps(result, indent=1, default=float))
    return result
