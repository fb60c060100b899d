"""Parity of LiveAvatar's streaming DiT and its block loop (`liveavatar-dit` fixtures).

The fixture ran the official `CausalWanModel_S2V` as `causal_s2v_pipeline.py` streams: one sink
prefill per step cache, then every block × Euler step against that step's KV ring, the sink
distance pinned. This module replays it on `LiveAvatarDiT`, every size and count from the
fixture's `config` and `settings`:

- one `KVRing` of `kv_ring_frames` latent frames and one sink prefill per step (each prefill is
  the same t = 0 pass; the official pipeline repeats it per cache, and so do we);
- block b starts from `inputs.noise[b]` at latent frame b·`frames_per_block` and takes its
  4·`frames_per_block` video frames of `inputs.audio`;
- step i: v = model(x, `timesteps[i]`), then x ← x + (σ[i+1] − σ[i])·v in float32 (diffusers'
  `FlowMatchEulerDiscreteScheduler.step`).

The weights go through `build_liveavatar_dit` (the same key mapping, meta build, filled in place) as
a real checkpoint's do.
"""

from __future__ import annotations

import dataclasses

import torch

from avatarstream.errors import InputError
from avatarstream.models.liveavatar import KVRing, LiveAvatarConfig, LiveAvatarDiT
from avatarstream.parity.fixture import Fixture
from avatarstream.weights.liveavatar_folder import build_liveavatar_dit


def config_of(fx: Fixture, *, rope_fp16: bool = True) -> LiveAvatarConfig:
    """The fixture's model config: its official kwargs plus the pipeline's `motion_frames`."""
    try:
        frames, latents = (int(v) for v in fx.settings["motion_frames"])
        config = LiveAvatarConfig.from_official(fx.config)
        config = dataclasses.replace(config, motion_frames=frames, rope_fp16=rope_fp16)
    except (KeyError, ValueError, TypeError) as e:
        raise InputError(f"{fx.path}: not a LiveAvatar DiT config ({e})") from None
    if config.motion_latents != latents:
        raise InputError(f"{fx.path}: motion_frames {frames} make {config.motion_latents} latents, "
                         f"the fixture says {latents}")
    return config


def load(fx: Fixture, *, dtype: torch.dtype | None = None, rope_fp16: bool = True) -> LiveAvatarDiT:
    """The fixture's DiT, built on the meta device and filled with its weights (official keys)."""
    config = config_of(fx, rope_fp16=rope_fp16)
    net = build_liveavatar_dit(fx.weights, config, what=f"{fx.path.name} weights", dtype=dtype)
    return net.eval()  # type: ignore[return-value]


def stream(net: LiveAvatarDiT, fx: Fixture, *, sink_distance: int | None = None
           ) -> dict[str, torch.Tensor]:
    """The fixture's block loop: {"latents" `[blocks, C, F, H, W]`, "velocity_block0_step0"
    `[C, F, H, W]`}. `sink_distance` overrides the fixture's (mutation tests)."""
    s = fx.settings
    try:
        ref, motion = fx.inputs["ref_latents"], fx.inputs["motion_latents"]
        context, audio, noise = fx.inputs["context"], fx.inputs["audio"], fx.inputs["noise"]
        sigmas = torch.tensor(s["sigmas"], dtype=torch.float32)  # [steps + 1]
        timesteps = torch.tensor(s["timesteps"], dtype=torch.float32)  # [steps]
        fpb, ring_frames = int(s["frames_per_block"]), int(s["kv_ring_frames"])
        blocks = int(s["num_blocks"])
        d = int(s["sink_distance"]) if sink_distance is None else sink_distance
    except (KeyError, ValueError, TypeError) as e:
        raise InputError(f"{fx.path}: fixture settings lack {e}") from None
    steps = timesteps.numel()
    if sigmas.numel() != steps + 1 or noise.shape[0] != blocks or noise.shape[2] != fpb:
        raise InputError(f"{fx.path}: {sigmas.numel()} sigmas for {steps} steps, noise "
                         f"{tuple(noise.shape)} for {blocks} blocks of {fpb} frames")
    per_latent, rem = divmod(audio.shape[-1], blocks * fpb)
    if rem:
        raise InputError(f"{fx.path}: {audio.shape[-1]} audio frames for {blocks * fpb} latent frames")
    text = net.text_cache(context)  # the session's prompt: embedded once, K/V cached per layer
    sinks = [net.prefill_sink(ref, motion, text) for _ in range(steps)]
    rings = [KVRing(len(net.blocks), ring_frames) for _ in range(steps)]
    finals, first = [], None
    for b in range(blocks):
        x = noise[b][None]  # [1, C, F, H, W]
        a = audio[..., per_latent * fpb * b: per_latent * fpb * (b + 1)]
        for i in range(steps):
            v = net.forward_block(x, timesteps[i], a, text, sinks[i], rings[i], b * fpb, d)
            first = v[0] if first is None else first
            x = x.float() + (sigmas[i + 1] - sigmas[i]) * v.float()
        finals.append(x[0])
    assert first is not None
    return {"latents": torch.stack(finals), "velocity_block0_step0": first}


def run(fx: Fixture) -> dict[str, torch.Tensor]:
    """The fixture's expected tensors, computed by our port in fp32 (fp16 RoPE tables emulated)."""
    return stream(load(fx), fx)
