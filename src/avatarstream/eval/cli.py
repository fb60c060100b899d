"""`avatarstream eval`: arguments and run() (the top-level CLI prints the returned summary).

    avatarstream eval VIDEO --reference REF [--audio WAV] [--ground-truth GT] [--chunk-frames N] [--real] [--out DIR] --json
    avatarstream eval benchmark --model NAME --split heldout-identity|heldout-voice [--seconds S] [--clips N] [--seed X]
        [--reference-mode video|frame] [--steps K] [--seconds-per-chunk S] [--strategy S] [--latent-noise A] [--device cpu|cuda] [--out DIR] --json
    avatarstream eval sweep --model NAME --steps 1,2,3,4 [--split S] [--seconds S] [--clips N] [--seed X] [--out DIR] --json
    avatarstream eval card --model NAME [--seconds S] [--clips N] [--seed X] [--steps K] [--sweep-steps 1,2,3] [--out DIR] --json
    avatarstream eval showcase --model NAME --out DIR [--split S] [--seconds S] [--seed X] [--steps K] --json
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from avatarstream.engine.schedule import STRATEGIES
from avatarstream.errors import InputError

USAGE = """avatarstream eval VIDEO --reference REF [--audio WAV] [--ground-truth GT] [--chunk-frames N] [--real] [--out DIR] [--json]
       avatarstream eval benchmark --model NAME --split {heldout-identity,heldout-voice} [--seconds S] [--clips N] [--seed X] [--reference-mode {video,frame}] [--steps K] [--seconds-per-chunk S] [--strategy {prefix,interp,causal}] [--latent-noise A] [--device {cpu,cuda}] [--out DIR] [--json]
       avatarstream eval sweep --model NAME --steps 1,2,3,4 [--split S] [--seconds S] [--clips N] [--seed X] [--out DIR] [--json]
       avatarstream eval card --model NAME [--seconds S] [--clips N] [--seed X] [--steps K] [--sweep-steps 1,2,3] [--out DIR] [--json]
       avatarstream eval showcase --model NAME --out DIR [--split S] [--seconds S] [--seed X] [--steps K] [--json]"""

STABLE_KEYS = ("sync_c", "sync_d", "offset_frames", "face_sim", "style_error", "silence_mouth_closed",
               "boundary_smoothness", "psnr", "fps", "ttff_s", "model", "split", "seed", "clips")
# which options each form takes (argparse dests); anything else given is a one-line error
_COMMON = ("out", "threads")
_OPTIONS = {
    "video": ("reference", "audio", "ground_truth", "chunk_frames", "real", "experts", "no_plots"),
    "benchmark": ("model", "split", "seconds", "clips", "seed", "reference_mode", "steps", "seconds_per_chunk",
                  "strategy", "latent_noise", "experts", "no_plots", "device"),
    "sweep": ("model", "split", "seconds", "clips", "seed", "steps", "experts"),
    "card": ("model", "seconds", "clips", "seed", "steps", "sweep_steps", "experts"),
    "showcase": ("model", "split", "seconds", "seed", "steps"),
}
_ALL = tuple(dict.fromkeys(d for ds in _OPTIONS.values() for d in ds))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of `avatarstream eval` (every form shares one parser; run() checks which apply)."""
    p.usage = USAGE
    p.add_argument("video", metavar="VIDEO|benchmark|sweep|card|showcase",
                   help="video to score, or one of the held-out benchmark commands")
    g = p.add_argument_group("scoring a video")
    g.add_argument("--reference", help="reference image or video of the person (FaceSim, style)")
    g.add_argument("--audio", help="the driving speech (default: the video's own audio track)")
    g.add_argument("--ground-truth", help="ground-truth video for PSNR/SSIM")
    g.add_argument("--chunk-frames", type=int, help="chunk length in frames, for boundary smoothness")
    g.add_argument("--real", action="store_true", default=None,
                   help="also score real faces with dlib (the *_real keys; needs pip install 'avatarstream[real]')")
    b = p.add_argument_group("benchmark, sweep, card, showcase")
    b.add_argument("--model", help="registry model, or the baselines ground-truth / static-frame / wrong-identity")
    b.add_argument("--split", choices=["heldout-identity", "heldout-voice"],
                   help="benchmark: required; sweep, showcase: default heldout-identity; card: both, always")
    b.add_argument("--seconds", type=float, help="seconds per clip (default 10; showcase 6)")
    b.add_argument("--clips", type=int, help="number of cases (default 3)")
    b.add_argument("--seed", type=int, help="draws identities, voices, scenes and sentences (default 0)")
    b.add_argument("--reference-mode", choices=["video", "frame"],
                   help="benchmark: give the model the reference video (default) or only its first frame; "
                        "style error is measured against the video either way")
    b.add_argument("--steps", help="denoising steps (default: the model's); sweep: a list, like 1,2,3,4")
    b.add_argument("--seconds-per-chunk", type=float,
                   help="benchmark: chunk length in seconds of video (default: the model's; `serve` uses 0.8)")
    b.add_argument("--strategy", choices=list(STRATEGIES),
                   help="benchmark: continuity strategy (default: the model's)")
    b.add_argument("--latent-noise", type=float,
                   help="benchmark, vae-roundtrip:NAME only: decode the latents plus this many per-channel "
                        "stds of Gaussian noise (a generator's error size; default 0)")
    b.add_argument("--device", choices=["cpu", "cuda"],
                   help="benchmark: where the model runs (default cpu; cuda: the first GPU, an error when there is none)")
    b.add_argument("--sweep-steps", help="card: also sweep these step counts (like 1,2,3) on the same cases")
    p.add_argument("--out", help="output folder (default VIDEO.eval/, eval-MODEL-SPLIT-sSEED/, eval-sweep-…, "
                                 "eval-card-MODEL-sSEED/; showcase: required)")
    p.add_argument("--experts", help="expert set: bundled (default), independent (evaluation-only sync and "
                   "identity experts no training reward saw) or a folder of expert .safetensors")
    p.add_argument("--no-plots", action="store_true", default=None, help="skip the PNG plots")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if getattr(args, n, None) is not None]


def check_options(args: argparse.Namespace, form: str) -> None:
    """One line naming the options that do not apply to this form of `avatarstream eval`."""
    bad = [n for n in _given(args, _ALL) if n not in _OPTIONS[form]]
    if bad:
        where = "`avatarstream eval VIDEO`" if form == "video" else f"`avatarstream eval {form}`"
        opts = ", ".join("--" + n.replace("_", "-") for n in bad)
        raise InputError(f"{opts} {'does' if len(bad) == 1 else 'do'} not apply to {where}")


def one_step_count(text: str | None, form: str) -> int | None:
    """--steps of benchmark/card/showcase: one step count (a list is for `eval sweep`)."""
    if text is None:
        return None
    from avatarstream.eval.sweep import parse_steps

    steps = parse_steps(text)
    if len(steps) != 1:
        raise InputError(f"--steps takes one step count for `eval {form}`; `eval sweep --steps {text}` runs several")
    return steps[0]


def _read_video(path: str) -> np.ndarray:
    """[F, H, W, 3] uint8 at 25 fps (other rates resampled to the nearest frame)."""
    import av

    p = Path(path)
    if not p.is_file():
        raise InputError(f"video {p} not found")
    try:
        with av.open(str(p)) as c:
            if not c.streams.video:
                raise InputError(f"{p} has no video stream")
            s = c.streams.video[0]
            rate = float(s.average_rate) if s.average_rate else 25.0
            frames = [f.to_ndarray(format="rgb24") for f in c.decode(s)]
    except av.FFmpegError as e:
        raise InputError(f"{p} is not a readable video ({e})") from e
    if not frames:
        raise InputError(f"{p} has no decodable frame")
    x = np.stack(frames)
    if abs(rate - 25.0) > 0.01:
        idx = np.round(np.arange(0, len(x) / rate, 1 / 25.0) * rate).astype(int).clip(0, len(x) - 1)
        x = x[idx]
    return x


def run_video(args: argparse.Namespace) -> dict[str, Any]:
    """Score one video file."""
    from avatarstream.eval.experts import load_experts
    from avatarstream.eval.metrics import evaluate
    from avatarstream.eval.report import frame_strip, plot_case, write_report
    from avatarstream.media.audio import read_all
    from avatarstream.media.reference import load_reference

    check_options(args, "video")
    if not args.reference:
        raise InputError("--reference is required: the image or video of the person the video should show")
    if args.chunk_frames is not None and args.chunk_frames < 1:
        raise InputError("--chunk-frames must be at least 1")
    frames = _read_video(args.video)
    audio = read_all(args.audio or args.video, 16000)
    if audio.size == 0:
        raise InputError(f"no audio: {args.audio or args.video} has no audio track; pass --audio WAV")
    ref = load_reference(args.reference, size=256, max_frames=250).frames.permute(0, 2, 3, 1).numpy()
    real = ref_desc = None
    if args.real:  # before the expert metrics: a missing extra or a faceless reference fails fast
        from avatarstream.eval.real import RealFaceExperts, reference_descriptor

        real = RealFaceExperts().load()
        ref_desc = reference_descriptor(real, ref)
    gt = _read_video(args.ground_truth) if args.ground_truth else None
    ex = load_experts(args.experts)
    starts = list(range(0, len(frames), args.chunk_frames)) if args.chunk_frames else None
    ev = evaluate(frames, audio, ref, ex, ground_truth=gt, chunk_starts=starts)
    m = ev.metrics
    result: dict[str, Any] = {k: m.get(k) for k in STABLE_KEYS}
    result.update(model=None, split=None, seed=None, clips=1, fps=None, ttff_s=None, ssim=m.get("ssim"),
                  frames=m["frames"], seconds=m["seconds"], style=m["style"], reference_style=m.get("reference_style"),
                  silent_frames=m["silent_frames"], drift=ev.drift, video=str(args.video))
    if gt is not None:
        gt_ev = evaluate(gt, audio, ref[:1], ex)
        a, b = ev.tracks["mouth_open"], gt_ev.tracks["mouth_open"]
        k = min(len(a), len(b))
        result["mouth_open_corr_gt"] = float(np.corrcoef(a[:k], b[:k])[0, 1]) if k > 2 and a[:k].std() > 0 and b[:k].std() > 0 else None
    if real is not None:
        from avatarstream.eval.real import evaluate_real

        rv = evaluate_real(frames, audio=audio, ex=real, ref_desc=ref_desc)
        mar = [round(float(v), 4) if np.isfinite(v) else None for v in rv.tracks["mouth_open_real"]]
        result.update(rv.metrics, mouth_open_real={"frame": rv.tracks["mouth_open_real_idx"].tolist(), "mar": mar})
    out = Path(args.out) if args.out else Path(str(args.video) + ".eval")
    cases = [{"name": "video", "metrics": m, "drift": ev.drift}]
    if not args.no_plots:
        out.mkdir(parents=True, exist_ok=True)
        cases[0]["plots"] = plot_case(out, "video", ev.tracks, gt_ev.tracks if gt is not None else None)
        rows = [frames] + ([gt] if gt is not None else []) + [ref]
        cases[0]["plots"].append(frame_strip(out, "video", rows))
    result["report"] = str(write_report(out, result, cases, f"Evaluation of {args.video}"))
    return result


def _need_model(args: argparse.Namespace, form: str) -> str:
    if not args.model:
        raise InputError(f"eval {form} needs --model NAME (see `avatarstream models`)")
    return args.model


def run_benchmark_cmd(args: argparse.Namespace) -> dict[str, Any]:
    from avatarstream.eval.benchmark import run_benchmark
    from avatarstream.eval.experts import load_experts

    check_options(args, "benchmark")
    if not args.model or not args.split:
        raise InputError("eval benchmark needs --model NAME and --split heldout-identity|heldout-voice")
    steps = one_step_count(args.steps, "benchmark")
    seed = 0 if args.seed is None else args.seed
    out = Path(args.out) if args.out else Path(f"eval-{args.model.replace(':', '_')}-{args.split}-s{seed}")
    r = run_benchmark(args.model, args.split, seconds=10.0 if args.seconds is None else args.seconds,
                      clips=3 if args.clips is None else args.clips, seed=seed, out=out,
                      experts=load_experts(args.experts), plots=not args.no_plots,
                      reference_mode=args.reference_mode or "video", steps=steps,
                      seconds_per_chunk=args.seconds_per_chunk, strategy=args.strategy,
                      latent_noise=args.latent_noise, device=args.device or "cpu")
    return {**{k: r.get(k) for k in STABLE_KEYS}, **{k: v for k, v in r.items() if k not in STABLE_KEYS}}


def run_sweep_cmd(args: argparse.Namespace) -> dict[str, Any]:
    from avatarstream.eval.benchmark import check_bench_args
    from avatarstream.eval.experts import load_experts
    from avatarstream.eval.sweep import parse_steps, run_sweep

    check_options(args, "sweep")
    model = _need_model(args, "sweep")
    if args.steps is None:
        raise InputError("eval sweep needs --steps, the step counts to compare, like 1,2,3,4")
    steps = parse_steps(args.steps)
    split = args.split or "heldout-identity"
    seed = 0 if args.seed is None else args.seed
    seconds, clips = 10.0 if args.seconds is None else args.seconds, 3 if args.clips is None else args.clips
    check_bench_args(split, seconds, clips)
    out = Path(args.out) if args.out else Path(f"eval-sweep-{model}-{split}-s{seed}")
    return run_sweep(model, split, steps, seconds=seconds, clips=clips, seed=seed, out=out,
                     experts=load_experts(args.experts))


def run_card_cmd(args: argparse.Namespace) -> dict[str, Any]:
    from avatarstream.eval.card import run_card
    from avatarstream.eval.experts import load_experts
    from avatarstream.eval.sweep import parse_steps

    check_options(args, "card")
    model = _need_model(args, "card")
    steps = one_step_count(args.steps, "card")
    sweep = parse_steps(args.sweep_steps) if args.sweep_steps is not None else None
    seed = 0 if args.seed is None else args.seed
    out = Path(args.out) if args.out else Path(f"eval-card-{model}-s{seed}")
    card = run_card(model, out, seconds=10.0 if args.seconds is None else args.seconds,
                    clips=3 if args.clips is None else args.clips, seed=seed, steps=steps, sweep=sweep,
                    experts=load_experts(args.experts))
    keep = ("model", "seed", "clips", "seconds", "steps", "default_steps", "passed", "n_pass", "n_fail",
            "n_unmeasured", "wall_s", "card_json", "card_md")
    return {**{k: card[k] for k in keep}, "targets": card["targets"],
            "runs": {sp: s["runs"] for sp, s in card["splits"].items()}}


def run_showcase_cmd(args: argparse.Namespace) -> dict[str, Any]:
    from avatarstream.eval.showcase import run_showcase

    check_options(args, "showcase")
    model = _need_model(args, "showcase")
    if not args.out:
        raise InputError("eval showcase needs --out DIR, the folder for the PNG and GIF (e.g. docs/)")
    return run_showcase(model, Path(args.out), split=args.split or "heldout-identity",
                        seed=0 if args.seed is None else args.seed,
                        seconds=6.0 if args.seconds is None else args.seconds,
                        steps=one_step_count(args.steps, "showcase"))


COMMANDS = {"benchmark": run_benchmark_cmd, "sweep": run_sweep_cmd, "card": run_card_cmd, "showcase": run_showcase_cmd}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Dispatch on VIDEO|benchmark|sweep|card|showcase; returns the JSON-serialisable summary."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.video in COMMANDS and not Path(args.video).is_file():
        return COMMANDS[args.video](args)
    return run_video(args)
