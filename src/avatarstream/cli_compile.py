"""`avatarstream models compile`: build the compiled decode graphs a model's runs will load.

The causal VAE decodes a stream's steady chunks through an ahead-of-time compiled package when
one is on disk and `AVATARSTREAM_VAE_BACKEND=auto` (`models/aot.py`, `models/vae_backend.py`). A
package belongs to one model, chunk shape, dtype, torch build and CPU kind, and costs ≈ 40 s of
one core to build, so no run builds one on its own: this command does, once per machine, for
the shapes `generate` and `serve` use with this model and size:

- `generate`: the model's own chunk and strategy (a few seconds of a real run, no output);
- `serve`: live chunks (the model's own, at most 0.8 s), batches of 1 to `--sessions` (the
  scheduler decodes the chunks of sessions that speak at once as one batch).

It prints what it built (or found) with the seconds each took, and a JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

import numpy as np
import torch

from avatarstream.engine.config import SIZE_HELP, parse_size
from avatarstream.errors import ConfigError

HELP = ("compile the VAE decode graphs generate and serve load for a model with "
        "AVATARSTREAM_VAE_BACKEND=auto (once per machine, ≈ 20-35 s a shape)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name (default: the registry's default)")
    p.add_argument("--size", default=None, metavar="WxH", help=SIZE_HELP)
    p.add_argument("--sessions", type=int, default=2,
                   help="live batch sizes compiled: 1 to this many sessions speaking at once (default 2; 0: none)")
    p.add_argument("--no-generate", action="store_true", help="skip generate's shape")
    p.add_argument("--json", action="store_true", help="print only the JSON line")
    p.set_defaults(func=cmd_compile)


def cmd_compile(args: argparse.Namespace) -> int:
    if args.sessions < 0:
        raise ConfigError(f"--sessions must be 0 or more, got {args.sessions}")
    os.environ["AVATARSTREAM_VAE_BACKEND"] = "aoti"  # this process builds what is missing
    from avatarstream.models.aot import cache_root
    from avatarstream.registry import load_model, resolve_model
    from avatarstream.serve.app import live_chunk

    name = resolve_model(args.model)
    models = load_model(name)
    vae = models.vae.model if models.vae is not None else None
    if not hasattr(vae, "set_decode_backend"):
        raise ConfigError(f"{name}: its VAE has no compiled decode (only the causal VAE of our own models)")
    config = models.config
    if args.size is not None:
        h, w = parse_size(args.size)
        config = config.with_size(h, w)
    runs = [] if args.no_generate else [("generate", config, 1)]
    live = replace(config, chunk=live_chunk(config, None))
    runs += [("serve", live, b) for b in range(1, args.sessions + 1)]
    built = []
    for what, cfg, batch in runs:
        vae.set_decode_backend("aoti")  # a fresh backend: one chunk length each
        t0 = time.perf_counter()
        _steady_chunks(models, cfg, batch)
        shapes = [list(sig[0]) for sig, run in vae.decode_backend.runners.items() if run is not None]
        built.append({"for": what, "batch": batch, "chunk": cfg.chunk, "latents": shapes,
                      "seconds": round(time.perf_counter() - t0, 1)})
        if not args.json:
            print(f"{what} (batch {batch}, chunk {cfg.chunk}): decode step {shapes} ready in "
                  f"{built[-1]['seconds']} s")
    print(json.dumps({"model": name, "cache": str(cache_root()), "compiled": built}))
    return 0


def _steady_chunks(models, config, batch: int) -> None:  # type: ignore[no-untyped-def]
    """Run the decode of `batch` streams far enough that a steady chunk of `config` is decoded.

    The latent chunk shape is found by a short real run of the engine (batch 1: whatever the
    strategy decodes per chunk), then `batch` streams of zero latents of that shape are decoded
    (the package depends on shapes only)."""
    from avatarstream.engine.pipeline import Pipeline

    vae = models.vae.model
    if batch == 1:
        h, w = config.out_hw
        reference = torch.randint(0, 256, (1, 3, h, w), dtype=torch.uint8,
                                  generator=torch.Generator().manual_seed(0))  # shapes matter, not content
        seconds = 3 * config.chunk * 4 / config.fps + 1.0  # three chunks and some
        t = np.arange(int(seconds * config.sample_rate)) / config.sample_rate
        speech = (0.2 * np.sin(2 * np.pi * 200 * t) * (1 + np.sin(2 * np.pi * 3 * t))).astype(np.float32)
        Pipeline(models, replace(config, watermark=False)).run(reference, iter([torch.from_numpy(speech)]), [])
        return
    one = [sig for sig in _sigs_of_batch_one(models, config)]
    for shape in one:
        b, zc, t_, hh, ww = shape
        cache = vae.new_cache("decode")
        models.vae.call("decode_step", torch.zeros(batch, zc, 1, hh, ww), cache)
        for _ in range(2):  # the backend takes over from a stream's third call
            models.vae.call("decode_step", torch.zeros(batch, zc, t_, hh, ww), cache)


def _sigs_of_batch_one(models, config) -> list[tuple]:  # type: ignore[no-untyped-def]
    """The steady latent shapes a batch-1 run of `config` decodes (compiling them as it goes)."""
    vae = models.vae.model
    backend = vae.decode_backend
    vae.set_decode_backend("aoti")
    _steady_chunks(models, config, 1)
    shapes = [sig[0] for sig, run in vae.decode_backend.runners.items() if run is not None]
    vae.decode_backend = backend
    return shapes
