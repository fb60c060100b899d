"""`avatarstream serve`: the HTTP + WebSocket live-session server (add_arguments / run)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from avatarstream.errors import ConfigError

log = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="tiny-random", help="model name (see `avatarstream models`)")
    p.add_argument("--data-dir", default="serve-data",
                   help="folder for avatars (SQLite + tensors) and live session files")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="accept only this bearer key (repeatable; default: any non-empty key)")
    p.add_argument("--idle-timeout", type=float, default=30.0,
                   help="end a session after this many seconds without speech or keep-alive")
    p.add_argument("--max-upload-mb", type=float, default=50.0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Serve until interrupted; returns what was served."""
    import torch
    from aiohttp import web

    from avatarstream.registry import MODELS, available_models, load_model
    from avatarstream.serve.app import ServerConfig, make_app
    from avatarstream.serve.avatars import UploadLimits
    from avatarstream.serve.session import LiveSessionConfig

    if args.model not in MODELS:
        raise ConfigError(f"unknown model {args.model!r}; available: {', '.join(available_models())}")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be 1-65535, got {args.port}")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = ServerConfig(
        data_dir=Path(args.data_dir),
        api_keys=frozenset(args.api_key) if args.api_key else None,
        limits=UploadLimits(max_bytes=int(args.max_upload_mb * 1024 * 1024)),
        session=LiveSessionConfig(idle_timeout_s=args.idle_timeout),
    )
    app = make_app(load_model(args.model), config)
    log.info("serving %s on http://%s:%d (data in %s)", args.model, args.host, args.port,
             config.data_dir)
    web.run_app(app, host=args.host, port=args.port, print=None)
    return {"host": args.host, "port": args.port, "model": args.model}
