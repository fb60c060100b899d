"""`bench strategies`: prefix, interp and causal side by side, one unbroken rollout each (the
`bench drift` rollout: held-out case, looped speech, windows scored as they complete, each
strategy in its own process).

Per strategy: chunk-boundary smoothness (`eval.metrics.boundary_smoothness`: mean frame change at
chunk seams over the median change inside chunks, 1 = seamless; mean over the scoring windows),
the same seams against the VAE's other latent starts (`seam_vs_cadence`) and that 4-frame cadence
itself (`latent_cadence`),
drift (FaceSim and Sync-C of the last 10 s window against the first, relative change; face colour
ΔE*76 of the last window against the first), fps and time to first frame of the run, peak memory
(VmHWM) and resident memory at the first and last window (growth = last - first, less the
window frames the benchmark holds).
`--write PATH` also writes the Markdown table (docs/strategies.md).
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path
from typing import Any

from avatarstream.bench.drift import COLOR_MEASURE, _change, drift_windows, rollout_in_process
from avatarstream.engine.schedule import STRATEGIES

HELP = "prefix vs interp vs causal: seam smoothness, drift over a long rollout, fps, TTFF, memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=1000.0, help="length of each rollout")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None,
                        help="model name (default: the registry's default, the bundled model once it ships)")
    parser.add_argument("--causal-model", default=None, metavar="NAME",
                        help="the model the causal strategy runs (default: the bundled causal student, "
                             "avatarstream-small-causal, where it ships, else --model's default)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--write", default=None, metavar="PATH", help="also write the Markdown table here")


def _mean(vals: list[Any]) -> float | None:
    v = [float(x) for x in vals if x is not None]
    return round(sum(v) / len(v), 4) if v else None


def summarise(r: dict[str, Any]) -> dict[str, Any]:
    w = r["windows"]
    return {
        "boundary_smoothness": _mean([x["boundary_smoothness"] for x in w]),
        "seam_vs_cadence": _mean([x.get("seam_vs_cadence") for x in w]),
        "latent_cadence": _mean([x.get("latent_cadence") for x in w]),
        "face_sim_first": w[0]["face_sim"], "face_sim_last": w[-1]["face_sim"],
        "face_sim_change": _change(w, "face_sim"),
        "sync_c_first": w[0]["sync_c"], "sync_c_last": w[-1]["sync_c"],
        "sync_c_change": _change(w, "sync_c"),
        "color_shift_last": round(w[-1]["color_shift"], 3),
        "fps": r["fps"], "ttff_s": r["ttff_s"], "peak_rss_mb": r["peak_rss_mb"],
        "rss_mb_first_window": w[0]["rss_mb"], "rss_mb_last_window": w[-1]["rss_mb"],
        # growth of resident memory less the window frames the benchmark itself holds
        "rss_growth_mb": round((w[-1]["rss_mb"] - w[-1]["held_frames_mb"])
                               - (w[0]["rss_mb"] - w[0]["held_frames_mb"]), 1),
        "rolling_state_bytes": r["rolling_state_bytes"],
        "last_window": [w[-1]["start_s"], w[-1]["end_s"]],
    }


def _fmt(v: Any, nd: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def markdown(result: dict[str, Any]) -> str:
    rows = result["strategies"]
    lw = rows["causal"]["last_window"]
    keys = [("boundary_smoothness", "chunk-boundary smoothness (1 = seamless)", 3),
            ("seam_vs_cadence", "chunk seams / the VAE's other latent starts (1 = seams no jumpier)", 3),
            ("latent_cadence", "latent cadence: change at latent starts / median (1 = no 4-frame stutter)", 3),
            ("face_sim_first", "FaceSim, 0–10 s", 3),
            ("face_sim_last", f"FaceSim, {lw[0]:g}–{lw[1]:g} s", 3),
            ("face_sim_change", "FaceSim change, last vs first window", 3),
            ("sync_c_first", "Sync-C, 0–10 s", 3),
            ("sync_c_last", f"Sync-C, {lw[0]:g}–{lw[1]:g} s", 3),
            ("sync_c_change", "Sync-C change, last vs first window", 3),
            ("color_shift_last", "face colour shift ΔE*76, last vs first window", 2),
            ("fps", "fps (whole pipeline)", 1), ("ttff_s", "time to first frame (s)", 3),
            ("peak_rss_mb", "peak memory (MB)", 0),
            ("rss_growth_mb", "resident memory growth, first to last window, less held frames (MB)", 1),
            ("rolling_state_bytes", "rolling state (bytes)", 0)]
    models = result.get("models", {})
    names = [s if models.get(s, result["model"]) == result["model"] else f"{s} ({models[s]})" for s in STRATEGIES]
    threads = f"{result['threads']} thread" + ("s" if result["threads"] != 1 else "")
    lines = [f"| measure ({result['model']}, {result['seconds']:g} s, {threads}) | "
             + " | ".join(names) + " |", "|---|" + "---|" * len(STRATEGIES)]
    for k, label, nd in keys:
        lines.append(f"| {label} | " + " | ".join(_fmt(rows[s][k], nd) for s in STRATEGIES) + " |")
    return "\n".join(lines)


def write_doc(path: Path, result: dict[str, Any]) -> None:
    causal = result.get("models", {}).get("causal", result["model"])
    also = f" --causal-model {causal}" if causal != result["model"] else ""
    head = ["# Continuity strategies compared", "",
            f"Measured by `avatarstream bench strategies --model {result['model']}{also} --seconds "
            f"{result['seconds']:g} --seed {result['seed']} --write {path}` on "
            f"{result['date']} (each strategy one unbroken rollout in its own process, "
            f"{result['threads']} torch thread{'s' if result['threads'] != 1 else ''}).", "",
            "Colour shift: " + COLOR_MEASURE + ".", ""]
    text = "\n".join(head) + "\n" + markdown(result) + "\n"
    if path.exists():  # keep the hand-written notes below the generated table
        old = path.read_text()
        marker = "\n## Notes"
        if marker in old:
            text += old[old.index(marker):]
    path.write_text(text)


def run(args: argparse.Namespace) -> dict:
    from avatarstream.registry import resolve_model

    args.model = resolve_model(getattr(args, "model", None))
    causal = resolve_model(getattr(args, "causal_model", None), causal=True)
    models = {s: causal if s == "causal" else args.model for s in STRATEGIES}
    drift_windows(args.seconds)
    rows = {}
    for s in STRATEGIES:
        rows[s] = summarise(rollout_in_process(models[s], s, args.seconds, args.seed, {}, threads=args.threads))
    result = {"strategies": rows, "model": args.model, "models": models, "seconds": args.seconds, "seed": args.seed,
              "threads": args.threads, "date": datetime.date.today().isoformat()}
    if args.write:
        write_doc(Path(args.write), result)
        result["written"] = args.write
    return result
