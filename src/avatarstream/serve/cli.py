"""`avatarstream serve`: the live-session server (add_arguments / run)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

from avatarstream.engine.config import SIZE_HELP, parse_size
from avatarstream.errors import ConfigError
from avatarstream.provenance import NO_WATERMARK_HELP
from avatarstream.serve.limits import add_limit_arguments, limits_from_args

log = logging.getLogger(__name__)

KEYS_HELP = ("accept only this bearer key (repeatable; /v1/server needs one too). Default: any "
             "non-empty bearer key is accepted and is its own tenant (its avatars, sessions and "
             "renders are its own)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default=None,
                   help="model name (see `avatarstream models`; default: the registry's default)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the models run (cuda: the first GPU; an error when there is none)")
    p.add_argument("--lora", default=None, metavar="FILE",
                   help="a personality adapter (`avatarstream train personality`) merged into the DiT")
    p.add_argument("--data-dir", default="serve-data",
                   help="folder for avatars (SQLite + tensors), renders and live session files")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY", help=KEYS_HELP)
    p.add_argument("--rtmp-allow", default="*", metavar="HOSTS",
                   help="comma-separated hosts (fnmatch patterns: *.example.com) and IP "
                        "addresses or networks (10.0.0.0/8) a session's rtmp_url may push to; "
                        "anything else is a 400. A pattern admits public addresses only; "
                        "loopback, private and link-local ones only when named exactly (host or "
                        "network). Default: * = any host on a public address; \"\" turns RTMP off "
                        "(docs/security.md)")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="end a session after this many seconds without speech or keep-alive")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="live sessions served at once (default: measured at start-up; the "
                        "sessions beyond it are refused with 503)")
    p.add_argument("--playout-delay", type=float, default=None,
                   help="WebRTC playout delay in seconds (default: from the measured chunk time)")
    p.add_argument("--lead", type=float, default=0.3,
                   help="how far (s) a session's timeline may run ahead of the wall clock")
    p.add_argument("--seconds-per-chunk", type=float, default=None,
                   help="chunk length in seconds of video, prefix overlap included (default: the "
                        "model's own, at most 0.8 s = 5 latent frames; the first speech frame waits "
                        "for one chunk's audio and compute, so shorter chunks start sooner)")
    p.add_argument("--size", default=None, metavar="WxH", help=SIZE_HELP)
    p.add_argument("--no-batching", action="store_true",
                   help="run every session's chunks on their own (for comparison)")
    p.add_argument("--no-watermark", action="store_true",
                   help=NO_WATERMARK_HELP)
    p.add_argument("--piper-voice", default=None, metavar="MODEL.onnx",
                   help="a piper voice model for the 'piper' TTS voice (needs avatarstream[piper])")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--compile", nargs="?", const="default", default=None, metavar="MODE",
                   choices=["default", "reduce-overhead", "max-autotune"],
                   help="torch.compile the DiT's denoising step (paid during the start-up calibration; "
                   "for GPUs, reduce-overhead adds CUDA graphs; on a CPU it rarely pays)")
    p.add_argument("--batch-ray", default=None, metavar="ADDRESS",
                   help="render POST /v1/renders jobs on the Ray cluster at ADDRESS (HEAD:6379, "
                        "or auto) instead of on this server's device, which live sessions keep "
                        "(docs/batch.md); --data-dir must be at the same path on its nodes")
    p.add_argument("--batch-workers", type=int, default=1, metavar="N",
                   help="with --batch-ray: renderers on the cluster, each with the model loaded (default 1)")
    add_limit_arguments(p)


def _rtmp_allow(text: str) -> tuple[str, ...]:
    """--rtmp-allow's entries, each checked now (a ConfigError names one that is not usable)."""
    from avatarstream.serve.rtmp_gate import RTMPPolicy

    entries = tuple(h.strip().lower() for h in text.split(",") if h.strip())
    RTMPPolicy.parse(entries)
    return entries


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Serve until interrupted; returns what was served."""
    import torch
    from avatarstream.hardware import check_device
    from avatarstream.registry import load_model, model_spec_for, resolve_model
    from avatarstream.serve.app import ServerConfig, make_app
    from avatarstream.serve.runner import serve_app
    from avatarstream.live.session import LiveSessionConfig
    from avatarstream.serve.webrtc import is_loopback_host, use_host_addresses

    model = resolve_model(args.model)
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be 1-65535, got {args.port}")
    if args.max_sessions is not None and args.max_sessions < 0:
        raise ConfigError("--max-sessions must be >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    check_device(args.device)
    # WebRTC host candidates: loopback only for a loopback server, else the machine's addresses.
    use_host_addresses(["127.0.0.1"] if is_loopback_host(args.host) else None)
    config = ServerConfig(
        data_dir=Path(args.data_dir),
        api_keys=frozenset(args.api_key) if args.api_key else None,
        limits=limits_from_args(args),
        session=LiveSessionConfig(idle_timeout_s=args.idle_timeout, lead_s=args.lead),
        max_sessions=args.max_sessions, playout_delay_s=args.playout_delay,
        piper_voice=args.piper_voice, batching=not args.no_batching,
        seconds_per_chunk=args.seconds_per_chunk,
        rtmp_allow=_rtmp_allow(args.rtmp_allow),
        batch_ray=args.batch_ray, batch_workers=args.batch_workers,
    )
    size = None if args.size is None else parse_size(args.size)
    if size is not None:  # checked before any weight is read: the multiple the model needs
        model_spec_for(model).pipeline().with_size(*size)
    remote = None
    if args.batch_ray is not None:  # before the local model: an unreachable cluster fails at once
        from avatarstream.batch.remote import RayRenders

        say(f"starting {args.batch_workers} renderer(s) of {model} on the Ray cluster at {args.batch_ray}...")
        pipe = model_spec_for(model).pipeline()
        remote = RayRenders.connect(args.batch_ray, model=model, device=args.device,
                                    workers=args.batch_workers, size=size,
                                    watermark=not args.no_watermark, lora=args.lora,
                                    sample_rate=pipe.sample_rate, fps=pipe.fps,
                                    max_seconds=config.limits.max_render_seconds)
    say(f"loading model {model} on {args.device}...")
    models = load_model(model, device=args.device, lora=args.lora)
    if args.compile:
        from avatarstream.engine.module import COMPILE_MODES, DIT_STEP_METHODS

        models.dit.compile(DIT_STEP_METHODS, COMPILE_MODES[args.compile])
    if size is not None:
        models = dataclasses.replace(models, config=models.config.with_size(*size))
    if args.no_watermark:
        models = dataclasses.replace(models, config=dataclasses.replace(models.config, watermark=False))
    app = make_app(models, config, remote_renders=remote)
    say("measuring how many live sessions this machine keeps in real time (a minute or so; "
        "--max-sessions N skips it)..." if args.max_sessions is None else "warming up the model...")
    serve_app(app, args.host, args.port, on_listening=lambda: announce(app, args.host, args.port, config))
    return {"host": args.host, "port": args.port, "model": model}


def say(line: str) -> None:
    """One progress line on stderr (stdout keeps the summary)."""
    print(f"avatarstream serve: {line}", file=sys.stderr, flush=True)


def urls(host: str, port: int) -> list[str]:
    """The URLs a browser on this machine (or another) reaches the server at."""
    if host in ("0.0.0.0", "::", ""):
        return [f"http://127.0.0.1:{port}/ (and this machine's other addresses: listening on all)"]
    return [f"http://{f'[{host}]' if ':' in host else host}:{port}/"]


def announce(app: Any, host: str, port: int, config: Any) -> None:
    """What the operator needs once the server listens: where, and what it calibrated."""
    from avatarstream.serve.app import MODELS, SCHEDULER, SESSIONS

    cap, models = app[SCHEDULER].capacity, app[MODELS]
    for url in urls(host, port):
        say(f"listening on {url} (web page; API under /v1, schema /openapi.json)")
    if cap is not None:
        say(cap.describe(models.config.fps))
    say(f"WebRTC playout delay {app[SESSIONS].playout_delay_s:.2f} s; data in {config.data_dir}; "
        "Ctrl-C stops")
    log.info("serving %s on %s:%d", models.name, host, port)
