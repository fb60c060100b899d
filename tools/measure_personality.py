"""Personality fine-tuning of the bundled model on a held-out synthetic person: FaceSim and style
error before and after (docs/personality-small.md has the numbers and the command).

    python tools/measure_personality.py --work DIR [--steps N] [--seed 7] [--threads 2]

One held-out identity (split heldout-identity, `--seed`) is rendered in 8 scenes of 10 s
(`avatarstream synth --identities 1 --clips-per-identity 8 --seconds 10`). Clips 0 and 1 are the
two clips of `eval benchmark`'s case for that seed (the target's audio and render, and the
reference video in another scene); clips 2-7 (60 s, six other scenes) are the footage. Evaluated:
both directions (target 0 / reference 1, and target 1 / reference 0), scenes the fine-tuning never
saw. Every phase writes its result into DIR and is skipped when it is there; training
checkpoints and resumes, so the command can be re-run after an interruption.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

MODEL = "avatarstream-small"


def footage(work: Path, seed: int) -> Path:
    """All 8 clips in work/all, the 6 training ones indexed in work/footage (same shard files)."""
    all_dir, foot = work / "all", work / "footage"
    if not (all_dir / "index.json").is_file():
        subprocess.run([sys.executable, "-m", "avatarstream.cli", "synth", "--out", str(all_dir), "--identities", "1",
                        "--clips-per-identity", "8", "--seconds", "10", "--split", "heldout-identity",
                        "--size", "256", "--seed", str(seed)], check=True)
    if not (foot / "index.json").is_file():
        idx = json.loads((all_dir / "index.json").read_text())
        foot.mkdir(parents=True, exist_ok=True)
        for e in idx["clips"]:
            link = foot / e["shard"]
            if not link.exists():
                link.symlink_to((all_dir / e["shard"]).resolve())
        idx["clips"] = idx["clips"][2:]
        (foot / "index.json").write_text(json.dumps(idx, indent=1))
    return foot


def evaluate(work: Path, seed: int, lora: str | None, tag: str) -> dict:
    out = work / f"{tag}.json"
    if out.is_file():
        return json.loads(out.read_text())
    from avatarstream.data import Clip, DatasetConfig, clip_specs
    from avatarstream.eval.benchmark import generate
    from avatarstream.eval.experts import load_experts
    from avatarstream.eval.metrics import evaluate as score
    from avatarstream.eval.metrics import style_error
    from avatarstream.registry import load_model

    ex = load_experts()
    specs = clip_specs(DatasetConfig(identities=1, clips_per_identity=8, seconds=10.0, seed=seed,
                                     split="heldout-identity"))[:2]
    clips = [Clip(s) for s in specs]
    frames = [c.frames() for c in clips]
    models = load_model(MODEL, lora=lora)
    rows = []
    for t, r in ((0, 1), (1, 0)):
        t0 = time.perf_counter()
        gen = generate(models, frames[r], clips[t].audio, len(frames[t]))
        ev = score(gen.frames, clips[t].audio, frames[r], ex, ground_truth=frames[t], chunk_starts=gen.chunk_starts)
        gt = score(frames[t], clips[t].audio, frames[r], ex)
        m = ev.metrics
        rows.append({"target": specs[t].key, "reference": specs[r].key, "face_sim": m["face_sim"],
                     "style_error": m["style_error"],
                     "style_error_vs_target": style_error(m["style"], gt.metrics["style"]),
                     "sync_c": m["sync_c"], "psnr": m.get("psnr"), "generate_s": round(time.perf_counter() - t0, 1)})
    keys = ("face_sim", "style_error", "style_error_vs_target", "sync_c", "psnr")
    res = {"model": MODEL, "lora": lora, "cases": rows,
           "mean": {k: float(np.mean([r[k] for r in rows if r[k] is not None])) for k in keys}}
    out.write_text(json.dumps(res, indent=1))
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    foot = footage(work, a.seed)
    before = evaluate(work, a.seed, None, "before")
    print(json.dumps({"before": before["mean"]}), flush=True)
    run = work / "run"
    lora = run / "personality.safetensors"
    if not lora.is_file():
        cmd = [sys.executable, "-m", "avatarstream.cli", "train", "personality", "--base", MODEL, "--footage",
               str(foot), "--run-dir", str(run), "--steps", str(a.steps), "--rank", str(a.rank), "--lr", str(a.lr),
               "--threads", str(a.threads), "--checkpoint-every", "25", "--json"]
        if any(run.glob("ckpt-*.json")):
            cmd.append("--resume")
        subprocess.run(cmd, check=True)
    after = evaluate(work, a.seed, str(lora), "after")
    summary = json.loads((run / "summary.json").read_text())
    print(json.dumps({"before": before["mean"], "after": after["mean"],
                      "train": {k: summary.get(k) for k in ("steps", "rank", "alpha", "time_s", "eval_loss_before",
                                                            "eval_loss_after", "pairs")}}))


if __name__ == "__main__":
    main()
