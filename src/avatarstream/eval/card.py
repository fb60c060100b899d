"""`avatarstream eval card`: the numbers of a model card, against every target of issue 5.

For both held-out splits, on the same cases: ground truth, the `static-frame` and `wrong-identity`
baselines, the model with the reference video and with only its first frame (and, with
`--sweep-steps`, the model at other step counts). Renders, the reference's reads and the ground
truth's evaluation are made once per case and shared by every run; one split is held in memory at
a time. Writes DIR/card.json (every number, every target row) and DIR/card.md (tables ready to
paste into a model card, with the commands that reproduce them).

    avatarstream eval card --model NAME [--seed X] [--clips N] [--seconds S] [--steps K] [--sweep-steps 1,2,3] --out DIR --json
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from avatarstream.errors import ConfigError
from avatarstream.eval.benchmark import SUMMARY_KEYS, Bench, check_bench_args, check_run_options, load_subject, summarize
from avatarstream.eval.experts import Experts
from avatarstream.eval.sweep import plot_sweep, sweep_rows, sweep_table
from avatarstream.eval.targets import (BASELINE_BARS, NAMES, lowest_steps_target, video_beats_frame, vs_baselines,
                                       vs_ground_truth)

SPLITS = ("heldout-identity", "heldout-voice")
# run key -> (model name or None for the model under test, reference mode)
RUNS = {"ground-truth": ("ground-truth", "video"), "static-frame": ("static-frame", "video"),
        "wrong-identity": ("wrong-identity", "video"), "model_video": (None, "video"), "model_frame": (None, "frame")}
TABLE_KEYS = ("sync_c", "sync_d", "offset_frames", "face_sim", "style_error", "silence_mouth_closed", "psnr", "fps",
              "ttff_s")


def _case_row(m: dict[str, Any]) -> dict[str, Any]:
    return {k: m.get(k) for k in SUMMARY_KEYS + ("offset_frames",)}


def card_split(bench: Bench, model: str, models: Any, steps: int | None,
               sweep: list[int]) -> dict[str, Any]:
    """Every run of one split, its summaries, its target rows and its sweep rows."""
    per_run: dict[str, list[dict[str, Any]]] = {k: [] for k in RUNS}
    for case in bench.cases:
        for key, (name, mode) in RUNS.items():
            _, m, _ = bench.run(case, name or model, models, reference_mode=mode,
                                steps=steps if name is None else None)
            per_run[key].append(m)
        case.wrong_frames = None  # the only render no later run needs
    runs = {k: summarize(v) for k, v in per_run.items()}
    gt, mv = runs["ground-truth"], runs["model_video"]
    rows = vs_ground_truth(mv, gt) + vs_baselines(mv, runs, gt) + [video_beats_frame(mv, runs["model_frame"])]
    used = steps if steps is not None else models.config.steps
    sweep_out = sweep_rows(bench, model, models, sorted(set(sweep) | {used}), known={used: per_run["model_video"]}) \
        if sweep else []
    return {"runs": runs, "cases": [{**c.info(), **{k: _case_row(per_run[k][i]) for k in RUNS}}
                                    for i, c in enumerate(bench.cases)],
            "targets": rows, "sweep": sweep_out}


def _f(v: Any) -> str:
    if v is None:
        return "–"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _mark(p: bool | None) -> str:
    return "**pass**" if p is True else "**FAIL**" if p is False else "not measured"


def commands(model: str, seed: int, clips: int, seconds: float, steps: int | None, sweep: list[int], out: Path) -> dict[str, Any]:
    common = f"--seed {seed} --clips {clips} --seconds {seconds:g}"
    st = f" --steps {steps}" if steps is not None else ""
    card = f"avatarstream eval card --model {model} {common}{st}"
    if sweep:
        card += f" --sweep-steps {','.join(map(str, sweep))}"
    per = {}
    for split in SPLITS:
        for key, (name, mode) in RUNS.items():
            extra = (st + (" --reference-mode frame" if mode == "frame" else "")) if name is None else ""
            per[f"{split}/{key}"] = (f"avatarstream eval benchmark --model {name or model} --split {split} {common}"
                                     f"{extra} --json")
    return {"card": card + f" --out {out} --json", "runs": per}


def card_markdown(card: dict[str, Any]) -> str:
    m = card["model"]
    md = [f"## Evaluation: {m}", "",
          f"Held-out synthetic cases (cross-scene: the reference is another clip of the same person in another scene), "
          f"{card['clips']} case(s) × {card['seconds']:g} s per split, seed {card['seed']}, {card['steps']} denoising "
          f"steps (model default {card['default_steps']}), scored by the bundled expert networks (pixels and audio "
          f"only). Overall: **{'all targets met' if card['passed'] else 'targets not all met'}** "
          f"({card['n_pass']} pass, {card['n_fail']} fail, {card['n_unmeasured']} not measured).", "",
          "Reproduce (the card, then any single run on its own):", "", "```", card["commands"]["card"]]
    md += [card["commands"]["runs"][k] for k in card["commands"]["runs"]] + ["```", "", "### Targets", "",
                                                                             "| target | split | metric | value | threshold | result |",
                                                                             "|" + " --- |" * 6]
    for r in card["targets"]:
        md.append(f"| {r['target']} | {r.get('split', 'all')} | {NAMES.get(r['metric'], r['metric'])} | {_f(r['value'])} | "
                  f"{r['threshold']} | {_mark(r['pass'])} |")
    hdr = ("| run | Sync-C ↑ | Sync-D ↓ | offset | FaceSim ↑ | style err ↓ | silence closed | PSNR | fps | TTFF s |",
           "|" + " --- |" * 10)
    label = {"ground-truth": "ground truth", "static-frame": "static-frame (baseline)",
             "wrong-identity": "wrong-identity (baseline)", "model_video": f"{m}, video reference",
             "model_frame": f"{m}, first-frame reference"}
    for split, s in card["splits"].items():
        md += ["", f"### {split}", "", *hdr]
        for k, r in s["runs"].items():
            md.append(f"| {label[k]} | " + " | ".join(_f(r.get(x)) for x in TABLE_KEYS) + " |")
    if any(s["sweep"] for s in card["splits"].values()):
        md += ["", "### Steps trade-off (video reference)", ""]
        md += sweep_table({split: s["sweep"] for split, s in card["splits"].items()})
        if card.get("sweep_plot"):
            md += ["", f"![steps sweep]({Path(card['sweep_plot']).name})", "", card["sweep_caption"]]
    bars = "; ".join(f"{b} on {', '.join(NAMES[x] for x in ms)}" for b, ms in BASELINE_BARS.items())
    md += ["", "Notes: Sync-C/Sync-D (syncnet_python's reduction; distances on the unit sphere), offset in frames, "
           "FaceSim = cosine of identity embeddings to the reference video, style error = mean relative error of "
           "mouth amplitude, head sway and blink rate against the reference video (also for the first-frame "
           "reference, so both modes are comparable), silence closed = share of silent frames with a closed mouth. "
           "Means over cases; FPS and TTFF of the whole pipeline on the machine that ran it. Baselines are held on "
           f"the metrics they are built to fail ({bars}): the still frame's FaceSim and closed mouth are the "
           "reference's own, and the wrong identity's sync and style are ground truth's. \"Clearly better\" means "
           "past the midpoint between the baseline and ground truth.", ""]
    return "\n".join(md) + "\n"


def run_card(model: str, out: Path, *, seconds: float = 10.0, clips: int = 3, seed: int = 0,
             steps: int | None = None, sweep: list[int] | None = None,
             experts: Experts | None = None) -> dict[str, Any]:
    """Run every target's comparison on both held-out splits; writes OUT/card.{json,md}."""
    for split in SPLITS:
        check_bench_args(split, seconds, clips)
    check_run_options(model, "video", steps)
    models = load_subject(model)
    if models is None:
        raise ConfigError(f"eval card describes a registry model; {model} is a baseline (it is in the card already)")
    sweep = sorted(set(sweep or []))
    used = steps if steps is not None else models.config.steps
    t0 = time.perf_counter()
    splits: dict[str, Any] = {}
    targets: list[dict[str, Any]] = []
    for split in SPLITS:
        bench = Bench(split, seconds=seconds, clips=clips, seed=seed, experts=experts)
        splits[split] = card_split(bench, model, models, steps, sweep)
        targets += [{**r, "split": split} for r in splits[split]["targets"]]
        del bench  # renders of this split freed before the next is made
    if sweep:
        holding = {s: all(next(r for r in splits[sp]["sweep"] if r["steps"] == s)["holds_targets"] for sp in SPLITS)
                   for s in sorted(set(sweep) | {used})}
    else:
        holding = {}
    targets.append({**lowest_steps_target(used, holding), "split": "all"})
    passes = [r["pass"] for r in targets]
    card: dict[str, Any] = {
        "model": model, "seed": seed, "clips": clips, "seconds": seconds, "steps": used,
        "default_steps": models.config.steps, "passed": all(p is True for p in passes),
        "n_pass": passes.count(True), "n_fail": passes.count(False), "n_unmeasured": passes.count(None),
        "targets": targets, "splits": splits, "commands": commands(model, seed, clips, seconds, steps, sweep, out)}
    out.mkdir(parents=True, exist_ok=True)
    if sweep:
        card["sweep_caption"] = plot_sweep(out / "sweep.png", {sp: splits[sp]["sweep"] for sp in SPLITS},
                                           {sp: splits[sp]["runs"]["ground-truth"] for sp in SPLITS})
        card["sweep_plot"] = str(out / "sweep.png")
    card["wall_s"] = round(time.perf_counter() - t0, 2)
    (out / "card.json").write_text(json.dumps(card, indent=1, default=float))
    (out / "card.md").write_text(card_markdown(card))
    card["card_json"], card["card_md"] = str(out / "card.json"), str(out / "card.md")
    return card
