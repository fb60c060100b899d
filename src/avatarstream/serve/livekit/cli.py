"""`avatarstream livekit`: the avatar worker for LiveKit rooms (add_arguments / run).

Imports without LiveKit's packages (the command is always listed); running it without them is
one ConfigError saying what to install, before any model is loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import sys
from typing import Any

from avatarstream.errors import ConfigError
from avatarstream.provenance import NO_WATERMARK_HELP


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("LIVEKIT_URL"),
                   help="the LiveKit server, e.g. wss://PROJECT.livekit.cloud or ws://127.0.0.1:7880 "
                        "(default: $LIVEKIT_URL)")
    p.add_argument("--api-key", default=os.environ.get("LIVEKIT_API_KEY"),
                   help="default: $LIVEKIT_API_KEY")
    p.add_argument("--api-secret", default=os.environ.get("LIVEKIT_API_SECRET"),
                   help="default: $LIVEKIT_API_SECRET")
    p.add_argument("--agent-name", default="avatarstream",
                   help="the name agents dispatch this worker by (explicit dispatch)")
    p.add_argument("--avatar", default=None, metavar="FILE",
                   help="the face: an image or video of the person (default: a drawn test face)")
    p.add_argument("--model", default=None,
                   help="model name (see `avatarstream models`; default: the registry's default)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="rooms served at once (default: measured at start-up, as `serve` does)")
    p.add_argument("--seconds-per-chunk", type=float, default=None,
                   help="chunk length in seconds of video (default: as `serve`)")
    p.add_argument("--lead", type=float, default=0.3,
                   help="how far (s) a room's timeline may run ahead of the wall clock")
    p.add_argument("--http-port", type=int, default=8081,
                   help="LiveKit's worker health check port (0: any free port)")
    p.add_argument("--no-batching", action="store_true",
                   help="run every room's chunks on their own (for comparison)")
    p.add_argument("--no-watermark", action="store_true", help=NO_WATERMARK_HELP)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Serve rooms until interrupted; returns what was served."""
    from avatarstream.serve.livekit import require

    require()
    missing = [f"--{n.replace('_', '-')}" for n in ("url", "api_key", "api_secret")
               if not getattr(args, n)]
    if missing:
        raise ConfigError(f"give {', '.join(missing)} (or set $LIVEKIT_URL, $LIVEKIT_API_KEY, "
                          "$LIVEKIT_API_SECRET): the LiveKit server this worker registers with")
    if args.max_sessions is not None and args.max_sessions < 0:
        raise ConfigError("--max-sessions must be >= 0")
    if not 0 <= args.http_port < 65536:
        raise ConfigError(f"--http-port must be 0-65535, got {args.http_port}")

    import torch
    from avatarstream.hardware import check_device
    from avatarstream.live.session import LiveSessionConfig
    from avatarstream.registry import load_model, model_spec_for, resolve_model
    from avatarstream.serve.livekit.host import AvatarHost
    from avatarstream.serve.livekit.worker import WorkerSettings, make_server

    model = resolve_model(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    check_device(args.device)
    reference = _reference(args.avatar, model_spec_for(model).pipeline())  # before the weights
    _say(f"loading model {model} on {args.device}...")
    models = load_model(model, device=args.device)
    if args.no_watermark:
        models = dataclasses.replace(models, config=dataclasses.replace(models.config, watermark=False))
    host = AvatarHost(models, reference, max_sessions=args.max_sessions,
                      batching=not args.no_batching, seconds_per_chunk=args.seconds_per_chunk,
                      session=LiveSessionConfig(lead_s=args.lead))
    _say("measuring how many rooms this machine keeps in real time (a minute or so; --max-sessions N "
         "skips it)..." if args.max_sessions is None else "preparing the face and warming up...")
    host.start()
    if host.capacity is not None:
        _say(host.capacity.describe(models.config.fps))
    _say(f"registering with {args.url} as agent {args.agent_name!r}; Ctrl-C stops")
    settings = WorkerSettings(args.url, args.api_key, args.api_secret, args.agent_name,
                              args.http_port)
    server = make_server(host, settings)
    try:
        asyncio.run(_serve(server))
    except RuntimeError as e:
        if not getattr(server, "_connection_failed", False):  # not LiveKit's "cannot connect"
            raise
        raise ConfigError(f"cannot register with the LiveKit server at {args.url} ({e}); check "
                          "--url, --api-key and --api-secret") from None
    finally:
        host.stop()
    cap = host.capacity
    return {"url": args.url, "agent_name": args.agent_name, "model": model,
            "max_sessions": None if cap is None else cap.max_sessions, "refused": host.refused}


def _say(line: str) -> None:
    """One progress line on stderr (stdout keeps the summary)."""
    print(f"avatarstream livekit: {line}", file=sys.stderr, flush=True)


def _reference(path: str | None, config: Any) -> Any:
    """[F, 3, H, W] uint8 at the model's output size: the --avatar file, or a drawn face."""
    from avatarstream.media.reference import fit_resize, load_reference
    from avatarstream.media.synthetic import face_image

    if path is None:
        return fit_resize(face_image(max(config.out_hw)), *config.out_hw).unsqueeze(0)
    return load_reference(path, size=config.out_hw, max_frames=config.ref_pixel_frames,
                          what="avatar").frames


async def _serve(server: Any) -> None:
    """Run the agent server until SIGINT/SIGTERM, then drain (rooms finish) and close it."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    task = asyncio.create_task(server.run())
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not task.done():
        await server.drain(timeout=30)
        await server.aclose()
    await task
