"""`bench switch`: the time to hand the device from one model to the next (DiT -> VAE decoder)
when both live in host memory and are onloaded block by block (`engine/offload.py`).

One round: the DiT runs a forward (its blocks streamed through two device slots); during its last
block the VAE decoder's first block is already being copied (`hand_over`: just in time); then
`switch` releases the DiT's slots (asynchronously: the caller is not held) and makes the VAE's
first block resident; then the VAE decodes (its blocks streamed) and hands the device back.

Reported (milliseconds, median and p90 over `--repeats` rounds after one warm-up):
- `switch_ms`: from the DiT's forward done (device synchronised) to the VAE's first block
  resident (synchronised): what the handover costs the stream;
- `cold_switch_ms`: the same without the just-in-time prefetch (the first block copied then);
- `release_ms`: how long releasing the DiT holds the caller;
- `bytes_moved`: bytes copied to the device for the switch (the VAE's first block);
- `dit_forward_ms`: one DiT forward (back to back) with every block resident, offloaded through
  the block store, and (`--fsdp2`, default on) offloaded by FSDP2 (`fully_shard` +
  `CPUOffloadPolicy` on a world of 1): the measurement that chose the store; and the store's
  forward right after the VAE had the device (`block_store_after_switch`: slots allocated again).
On a CPU the "device" is host memory, so these are the mechanism's overheads, not PCIe transfer
times: `gpu_timing` says "pending" until the bench runs on a GPU.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from avatarstream.errors import ConfigError

HELP = "time to hand the device from the DiT to the VAE (offloaded blocks, just-in-time onload)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny",
                        help="our DiT and VAE presets (tiny: seconds on a CPU)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: steady timings on a shared machine)")
    parser.add_argument("--fsdp2", action=argparse.BooleanOptionalAction, default=True,
                        help="also time a DiT forward offloaded by FSDP2 (a world-1 process group)")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {"median": round(statistics.median(xs), 4), "p90": round(xs[min(len(xs) - 1, int(0.9 * len(xs)))], 4)}


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> list[float]:
    out = []
    for r in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if r:  # the first is the warm-up
            out.append(1000 * (time.perf_counter() - t0))
    return out


def _models(size: str, device: torch.device) -> tuple[Any, Any, Callable[[Any], Any], torch.Tensor]:
    """A fresh DiT and VAE of the preset (random weights), the DiT's forward on one causal block
    of inputs, and the latents the VAE decodes."""
    from avatarstream.models.dit import DiTConfig, VideoRefDiT
    from avatarstream.models.transformer import DiTCondition
    from avatarstream.models.vae import CausalVAE, VAEConfig

    dc = DiTConfig.tiny() if size == "tiny" else DiTConfig.small()
    dit = VideoRefDiT(dc)
    dit.init_random_(0)
    vae = CausalVAE(VAEConfig.tiny() if size == "tiny" else VAEConfig.small()).init_random_(0)
    hw = 4 if size == "tiny" else 16
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, dc.in_channels, 3, hw, hw, generator=g).to(device)
    cond = DiTCondition(motion=torch.randn(1, 3, dc.motion_dim, generator=g).to(device),
                        audio=torch.randn(1, 3, dc.audio_tokens, dc.audio_dim, generator=g).to(device),
                        text=torch.randn(1, 8, dc.text_dim, generator=g).to(device))
    sigma = torch.full((1, 3), 0.5, device=device)
    return dit.eval(), vae.eval(), lambda net: net.forward_sparse(x, sigma, cond, None), x


def _fsdp2_forward_ms(size: str, device: torch.device, repeats: int) -> list[float]:
    """A DiT forward with FSDP2 offloading its blocks (under no_grad: FSDP2's unshard cannot run
    under inference_mode, which our model calls use)."""
    import torch.distributed as dist

    from avatarstream.engine.offload import fsdp2_blocks

    own = not dist.is_initialized()
    if own:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        dit, _, forward, _ = _models(size, device)
        dit.to(device)
        fsdp2_blocks(dit, device)
        with torch.no_grad():
            return _timed(lambda: forward(dit), device, repeats)
    finally:
        if own:
            dist.destroy_process_group()


def run(args: argparse.Namespace) -> dict:
    from avatarstream.engine.offload import hand_over, offload_blocks, switch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here")
    if args.repeats < 1:
        raise ConfigError("--repeats must be at least 1")
    torch.set_num_threads(max(1, args.threads))
    resident, _, forward, _ = _models(args.size, device)
    resident.to(device)
    with torch.inference_mode():
        t_resident = _timed(lambda: forward(resident), device, args.repeats)
    resident = None  # free it before the offloaded copies are built
    dit, vae, forward, x = _models(args.size, device)
    dit_store = offload_blocks(dit.to(device), device)
    vae_store = offload_blocks(vae.decoder.to(device), device, attr="up_blocks")
    vae.to(device)
    z = x[:, : vae.cfg.z_channels]  # [1, z, 3, h, w] latents of the block
    switch_ms, cold_ms, release_ms, offloaded_ms = [], [], [], []
    with torch.inference_mode():
        t_store = _timed(lambda: forward(dit), device, args.repeats)  # back to back, no switch
        for r in range(2 * args.repeats + 2):
            jit = r % 2 == 0  # alternate: just in time, cold
            hand_over(dit.blocks, vae_store if jit else None)
            _sync(device)
            t0 = time.perf_counter()
            forward(dit)
            _sync(device)
            t1 = time.perf_counter()
            dit_store.drop_slots()
            t2 = time.perf_counter()
            vae_store.ensure(0) if jit else switch(dit_store, vae_store)
            _sync(device)
            t3 = time.perf_counter()
            vae.decode(z)
            vae_store.drop_slots()  # the device back to the DiT
            if r >= 2:  # one warm-up round of each kind
                (switch_ms if jit else cold_ms).append(1000 * (t3 - t1))
                if jit:
                    release_ms.append(1000 * (t2 - t1))
                    offloaded_ms.append(1000 * (t1 - t0))
    first = vae_store.store[0].numel()
    out = {
        "device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
        "size": args.size,
        "switch_ms": _stats(switch_ms),
        "cold_switch_ms": _stats(cold_ms),
        "release_ms": _stats(release_ms),
        "bytes_moved": first,
        "incoming_offloaded_bytes": vae_store.nbytes,
        "outgoing_offloaded_bytes": dit_store.nbytes,
        "dit_forward_ms": {"resident": _stats(t_resident), "block_store": _stats(t_store),
                           "block_store_after_switch": _stats(offloaded_ms)},
        "dit_blocks": len(dit.blocks),
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "gpu_timing": "measured" if device.type == "cuda" else "pending (no GPU here: CPU overheads only)",
    }
    if args.fsdp2:
        out["dit_forward_ms"]["fsdp2"] = _stats(_fsdp2_forward_ms(args.size, device, args.repeats))
    return out
