"""`avatarstream generate`: reference + speech -> a video of the person speaking, streamed to the
file (and to HLS / RTMP). The command line of cli.py imports this module only when generate runs."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from avatarstream.engine.config import SIZE_HELP, parse_size
from avatarstream.errors import AvatarStreamError, ConfigError
from avatarstream.provenance import NO_WATERMARK_HELP

if TYPE_CHECKING:
    from avatarstream.provenance.credentials import ContentCredentials

def configure(p: argparse.ArgumentParser, rest: list[str] | None = None) -> None:
    """generate's options; it runs `cmd_generate`."""
    p.add_argument("--reference", required=True, help="video (mp4/mov/webm/mkv) or image (png/jpg/webp)")
    p.add_argument("--max-megapixels", type=float, default=40.0, metavar="MP", help="refuse reference/scene "
                   "pictures and video frames over MP before decoding; a JPEG is read at 1/2-1/8 size (default 40)")
    p.add_argument("--scene", metavar="IMAGE",
                   help="start from this picture instead of the reference's first frame (the person "
                        "of the reference in another scene; prefix/interp)")
    p.add_argument("--audio", required=True, help="speech: wav/mp3/flac/ogg/m4a, any rate, mono or stereo; "
                   "damaged parts are skipped with a warning, refused when over 5%% of the file")
    p.add_argument("--out", required=True, help="output .mp4, written as OUT-STEM.partial-PID.mp4 (playable "
                   "while written) and renamed over --out when complete; a failed run leaves --out as it was")
    p.add_argument("--model", default=None,
                   help="model name (see `avatarstream models`; default: the bundled model, else tiny-random)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the models run (cuda: the first GPU; an error when there is none)")
    p.add_argument("--lora", default=None, metavar="FILE",
                   help="a personality adapter (`avatarstream train personality`) merged into the DiT")
    p.add_argument("--strategy", choices=["prefix", "interp", "causal"], default=None,
                   help="chunk continuity strategy (default: the model's); causal: blocks of 3 latent "
                        "frames with rolling KV caches (Live Avatar)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="causal only: timestep-forcing pipeline parallelism, N denoise worker "
                        "processes (one share of the steps each) + 1 decode process")
    p.add_argument("--split-decode", action="store_true",
                   help="with --workers: SR refiner and VAE decode in two processes (N + 2 in all)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="causal, under torchrun (-m avatarstream.parallel.launch): shard each DiT "
                        "block's tokens over the processes (Ulysses); rank 0 writes the output")
    p.add_argument("--decode-inline", action="store_true",
                   help="VAE decode in the generating thread (default: a thread of its own, same video)")
    p.add_argument("--adaptive-sink", action=argparse.BooleanOptionalAction, default=None,
                   help="causal: Adaptive Attention Sink, the first generated frame replaces the "
                        "reference as attention sink (default: the model's; --no-adaptive-sink keeps "
                        "the reference)")
    p.add_argument("--rolling-rope", action=argparse.BooleanOptionalAction, default=None,
                   help="causal: the sink's RoPE position moves with the window (default: the "
                        "model's; --no-rolling-rope keeps it fixed)")
    p.add_argument("--history-level", choices=["same", "next"], default=None,
                   help="causal: the K/V a block leaves for the next at each step, those of its input "
                        "(same noise level: timestep forcing) or of its output (next level: one more "
                        "forward a step; default: the model's)")
    p.add_argument("--seconds-per-chunk", type=float, default=None,
                   help="prefix/interp: chunk length in seconds of video (rounded to whole latent "
                        "frames); refused with causal, which generates fixed blocks of latent frames")
    p.add_argument("--size", default=None, metavar="WxH", help=SIZE_HELP)
    p.add_argument("--steps", type=int, default=None, help="denoising steps per chunk")
    p.add_argument("--sampler", choices=["euler", "stochastic"], default=None)
    p.add_argument("--audio-scale", type=float, default=None,
                   help="audio guidance scale (default: the model's; a model not CFG-distilled then runs "
                        "classifier-free guidance, twice the DiT work)")
    p.add_argument("--ref-scale", type=float, default=None,
                   help="reference guidance scale (default: the model's, or 1: unguided)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--prompt", default="", help="optional text/scene description")
    p.add_argument("--hls", default=None, metavar="DIR", help="also publish a live HLS stream into DIR "
                   "(index.partial-PID.m3u8 while written, index.m3u8 when complete)")
    p.add_argument("--rtmp", default=None, metavar="URL", help="also publish live to an RTMP server "
                   "(rtmp://host/app/KEY or rtmps://...) at real-time pace; reconnects when the "
                   "server drops, drops frames (counted) when the network falls behind")
    p.add_argument("--max-audio-seconds", type=float, default=3600.0,
                   help="refuse audio longer than this (default 3600)")
    p.add_argument("--sign-cert", metavar="PEM", default=None,
                   help="sign the content credentials (C2PA) with this certificate chain, signer "
                        "first (default: $AVATARSTREAM_SIGN_CERT, else a local self-signed one made "
                        "on first use, reported as untrusted)")
    p.add_argument("--sign-key", metavar="PEM", default=None,
                   help="the unencrypted private key of --sign-cert (default: $AVATARSTREAM_SIGN_KEY)")
    p.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                   choices=["default", "reduce-overhead", "max-autotune"],
                   help="torch.compile the DiT's denoising step (inductor; one graph per chunk shape, "
                   "compiled on first use: tens of seconds). For GPUs: pays on real models there; "
                   "reduce-overhead adds CUDA graphs. On a CPU it rarely pays (docs/real-models.md)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: all cores; causal with the decode on its own "
                        "thread: all but one, see hardware.generation_threads)")
    p.add_argument("--events", action="store_true",
                   help="print one JSON line per chunk on stderr (frames published and durable)")
    p.add_argument("--no-watermark", action="store_true",
                   help=NO_WATERMARK_HELP)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object last")
    p.set_defaults(func=cmd_generate)


def _overrides(c, args) -> dict:  # type: ignore[no-untyped-def]
    """PipelineConfig fields the options change (c: the model's default config)."""
    o: dict = {}
    if args.strategy is not None:
        o["strategy"] = args.strategy
    if args.seconds_per_chunk is not None:
        if o.get("strategy", c.strategy) == "causal":  # its blocks are what the student was trained on
            raise ConfigError(f"--seconds-per-chunk sets the chunk of the prefix and interp strategies; "
                              f"causal generates blocks of {c.block} latent frames ({c.block * 4 / c.fps:.2f} s "
                              f"of video) with rolling KV caches: leave it out")
        o["chunk"] = c.chunk_for_seconds(args.seconds_per_chunk)
    if args.steps is not None:
        if args.steps < 1:
            raise ConfigError("--steps must be at least 1")
        o["steps"] = args.steps
    if args.sampler is not None:
        o["sampler"] = args.sampler
    if args.seed is not None:
        o["seed"] = args.seed
    if getattr(args, "size", None) is not None:
        height, width = parse_size(args.size)
        c.with_size(height, width)  # checked: a ConfigError naming the multiple the model needs
        o.update(height=height, width=width)
    for key in ("audio_scale", "ref_scale"):
        val = getattr(args, key, None)
        if val is not None:
            if not 0.0 <= val <= 20.0:
                raise ConfigError(f"--{key.replace('_', '-')} must be between 0 and 20, got {val}")
            o[key] = val
    if getattr(args, "decode_inline", False):
        o["decode_overlap"] = False
    if getattr(args, "no_watermark", False):
        o["watermark"] = False
    for key in ("adaptive_sink", "rolling_rope", "history_level"):
        if getattr(args, key, None) is not None:
            o[key] = getattr(args, key)
    strategy = o.get("strategy", c.strategy)
    if getattr(args, "split_decode", False) and getattr(args, "workers", None) is None:
        raise ConfigError("--split-decode splits the pipeline of --workers N; add --workers")
    if getattr(args, "workers", None) is not None:
        if strategy != "causal":
            raise ConfigError("--workers runs the causal strategy only; add --strategy causal")
        if not 1 <= args.workers <= o.get("steps", c.steps):
            raise ConfigError(f"--workers must be between 1 and the number of steps "
                              f"({o.get('steps', c.steps)}): one worker owns one or more steps")
    return o


def _configure(models, args) -> None:  # type: ignore[no-untyped-def]
    for k, v in _overrides(models.config, args).items():
        setattr(models.config, k, v)
    if getattr(args, "compile", None):
        from avatarstream.engine.module import COMPILE_MODES, DIT_STEP_METHODS

        models.dit.compile(DIT_STEP_METHODS, COMPILE_MODES[args.compile])


def cmd_generate(args: argparse.Namespace) -> int:
    import torch

    from avatarstream.hardware import check_device
    from avatarstream.media.audio import AudioReader
    from avatarstream.media.reference import load_reference
    from avatarstream.parallel.run import launched_by_torchrun
    from avatarstream.provenance.credentials import credentials_for
    from avatarstream.publish.base import ending, generate_outputs
    from avatarstream.publish.file import check_writable
    from avatarstream.registry import model_spec_for, resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    check_device(args.device)
    if args.compile and (args.workers is not None or launched_by_torchrun()):
        raise ConfigError("--compile runs the model in this one process; drop it with --workers or torchrun")
    # no --model: the bundled model, or its causal student for --strategy causal / --workers
    args.model = resolve_model(args.model, causal=args.strategy == "causal" or args.workers is not None)
    out = Path(args.out)
    check_writable(out)
    # a bad certificate: now. A torchrun rank first checks the world size (every rank must fail
    # alike before the launcher tears the others down); the publishing one signs after the run.
    credentials = None if launched_by_torchrun() else credentials_for(args.model, args.sign_cert, args.sign_key)
    spec_cfg = model_spec_for(args.model).pipeline()
    overrides = _overrides(spec_cfg, args)
    out_hw = (overrides["height"], overrides["width"]) if "height" in overrides else spec_cfg.out_hw
    max_pixels = round(args.max_megapixels * 1e6)
    reference = load_reference(args.reference, size=out_hw, max_frames=spec_cfg.ref_pixel_frames,
                               max_pixels=max_pixels)
    scene = None
    if args.scene is not None:
        if args.workers is not None or (args.strategy or spec_cfg.strategy) == "causal":
            raise ConfigError("--scene is for the prefix and interp strategies (the causal student "
                              "starts from its reference sink)")
        scene = load_reference(args.scene, size=out_hw, max_frames=1, what="scene image",
                               max_pixels=max_pixels).frames[:1]
    reader = AudioReader(args.audio, sample_rate=spec_cfg.sample_rate, max_seconds=args.max_audio_seconds)
    if args.workers is not None or args.sequence_parallel:  # every rank loads the reference at --size
        if args.lora:
            raise ConfigError("--lora runs in one process for now (not with --workers or --sequence-parallel)")
        if args.rtmp:
            raise ConfigError("--rtmp publishes from this process: not with --workers or "
                              "--sequence-parallel")
        return _generate_tpp(args, overrides, out, credentials)
    # locked now: a second writer is refused
    with ending(sinks := generate_outputs(out, args.hls, credentials=credentials, rtmp=args.rtmp)):
        result = _generate_here(args, reference, scene, reader, sinks)
    result["out"] = str(out)  # replaced only now, complete (publish/output.py)
    if args.rtmp:  # the stream's counters, final once its sink closed
        result["rtmp"] = sinks[-1].stats()
    result["content_credentials"] = sinks[0].signed.as_dict()
    _print_summary(result)
    print(f"  {sinks[0].signed.note()}")
    if args.json:
        print(json.dumps(result))
    return 0


def _generate_here(args: argparse.Namespace, reference, scene, reader, sinks) -> dict:  # type: ignore[no-untyped-def]
    """Load the model, open the sinks and run the pipeline in this process; the summary."""
    import torch

    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.registry import load_model

    models = load_model(args.model, device=args.device, lora=args.lora)
    _configure(models, args)
    cfg = models.config
    if not args.threads:
        from avatarstream.hardware import generation_threads

        torch.set_num_threads(generation_threads(cfg.strategy, cfg.decode_overlap))
    pipeline = Pipeline(models)
    for s in sinks:
        s.open(cfg.out_hw[1], cfg.out_hw[0], cfg.fps, cfg.sample_rate)

    total_hint = None
    if reader.duration_s:
        total_hint = pipeline.clock.frames_for_samples(round(reader.duration_s * cfg.sample_rate))
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=total_hint, unit="frame", desc="generating", file=sys.stderr,
                   dynamic_ncols=True, smoothing=0.1)

    def progress(done: int, total: int | None, elapsed: float) -> None:
        if bar is not None:
            if total is not None and bar.total != total:
                bar.total = total
            bar.update(done - bar.n)
            media = done / cfg.fps
            bar.set_postfix(fps=f"{done / elapsed:.1f}", speed=f"{media / elapsed:.2f}x" if elapsed else "-")
        if args.events:
            print(json.dumps({"event": "chunk", "frames_published": done, "file": str(sinks[0].writing),
                              "durable_frames": sinks[0].durable_frames}), file=sys.stderr, flush=True)

    try:
        summary = pipeline.run(reference.frames, iter(reader), sinks, prompt=args.prompt,
                               max_audio_seconds=args.max_audio_seconds, progress=progress, scene=scene)
    finally:
        if bar is not None:
            bar.close()
    result = summary.as_dict()
    result.update(model=args.model, strategy=cfg.strategy, steps=cfg.steps, threads=torch.get_num_threads(),
                  vae_decode=vae_decode_used(models))
    return result


def vae_decode_used(models) -> str:  # type: ignore[no-untyped-def]
    """How the run decoded its steady chunks: the backend's name where one of its graphs ran
    ("aoti": a compiled package from `models compile`), else "eager"."""
    backend = getattr(getattr(models.vae, "model", None), "decode_backend", None)
    if backend is None or not any(r is not None for r in backend.runners.values()):
        return "eager"
    return "aoti" if backend.kind == "auto" else backend.kind


def _generate_tpp(args: argparse.Namespace, overrides: dict, out: Path,
                  credentials: ContentCredentials | None) -> int:
    """`generate --strategy causal --workers N`: timestep-forcing pipeline parallelism over
    N + 1 processes started here (parallel/tpp.py); the decode process writes the file."""
    from avatarstream.parallel.run import launched_by_torchrun, publishes_here
    from avatarstream.parallel.start import run_tpp
    from avatarstream.parallel.tpp import TPPJob
    from avatarstream.provenance.credentials import credentials_for
    from avatarstream.publish.base import ending
    from avatarstream.publish.file import ReservedOutput

    if args.sequence_parallel and args.workers is not None:
        raise ConfigError("--sequence-parallel and --workers are two parallel plans; give one")
    # the publishing process writes the partial file; this one (under torchrun: the publishing
    # rank itself) locks --out, signs the partial and renames it over --out, or keeps it on failure
    torchrun = launched_by_torchrun()
    publishing = not torchrun or publishes_here(args.sequence_parallel)
    outs = [ReservedOutput(out, credentials)] if publishing else []
    job = TPPJob(model=args.model, reference=str(args.reference), audio=str(args.audio),
                 workers=args.workers or 1, split_decode=args.split_decode,
                 out=str(outs[0].writing if outs else out), hls=args.hls, overrides=overrides,
                 prompt=args.prompt, max_audio_seconds=args.max_audio_seconds,
                 threads=args.threads or 1, device=args.device, sequence_parallel=args.sequence_parallel)
    with ending(outs):
        try:
            result = run_tpp(job)  # (sequence parallel: parallel/sp_run.py)
        except BaseException:  # a partial kept is signed too, when the credentials load
            if torchrun and outs:
                with contextlib.suppress(AvatarStreamError):
                    outs[0].credentials = credentials_for(args.model, args.sign_cert, args.sign_key)
            raise
        if torchrun and outs:  # every rank has checked the world size: the credentials now
            outs[0].credentials = credentials_for(args.model, args.sign_cert, args.sign_key)
    if result is None:  # a rank of a torchrun job that does not publish: it prints nothing
        return 0
    result.update(model=args.model, strategy="causal", out=str(out))
    signed = outs[0].signed
    result["content_credentials"] = signed.as_dict()
    _print_summary(result)
    print(f"  {signed.note()}")
    decode = "1 refine + 1 decode worker" if args.split_decode else "1 decode worker"
    print(f"  sequence parallel over {result['processes']} processes" if args.sequence_parallel else
          f"  pipeline: {args.workers} denoise workers (steps {result['step_shares']}) + {decode}")
    if args.json:
        print(json.dumps(result))
    return 0


def _print_summary(r: dict) -> None:
    ttff = "-" if r["ttff_s"] is None else f"{r['ttff_s']:.2f} s"
    print(f"wrote {r['out']}: {r['frames']} frames ({r['duration_s']:.2f} s) in {r['wall_s']:.1f} s")
    # "rtf" in the JSON is wall seconds per media second (< 1: faster than real time), the inverse
    # of `bench realtime`'s rtf; the line says it both ways so neither is misread
    speed = f"{1 / r['rtf']:.2f}× real time ({r['rtf']:.2f} s per media second)" if r["rtf"] else "-"
    print(f"  time to first frame {ttff} | {r['fps']:.1f} fps | {speed} "
          f"| peak memory {r['peak_rss_mb']:.0f} MB")
    stages = " | ".join(f"{k} {v:.0f} ms" for k, v in r["stage_ms"].items())
    print(f"  per chunk: {stages} | reference {r['reference_ms']:.0f} ms once")
