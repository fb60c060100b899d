"""Parity of the FlashHead DiT and its chunk loop (`flashhead-dit` fixtures, variants pro / lite).

The fixture ran `FlashHeadPipeline.generate` for a few chunks with an identity VAE, so what it
checks is the DiT, the re-noising sampler with the official σ table, the motion overwrite and the
hand-off between chunks:

- chunk c starts from draw 0 of `inputs.noise[c]` and takes draw i + 1 after step i
  (`sample_renoise`, the last draw multiplied by σ = 0 is never read);
- before every step and after the last one, the first m latent frames are the motion latents
  (`given`): chunk 0 has the reference's first latent `y[:, :1]`, every later chunk the previous
  chunk's last `motion_latents` latents (with the real VAEs: decode, colour-correct, re-encode the
  last frames; with the identity VAE that is the latents themselves);
- every forward gets the chunk's one σ, its audio windows and the reference latents `y`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from avatarstream.errors import InputError
from avatarstream.models.flashhead import FlashHeadConfig, FlashHeadDiT
from avatarstream.parity.fixture import Fixture
from avatarstream.samplers.renoise import sample_renoise
from avatarstream.weights.flashhead import load_flashhead_dit


def _given(motion: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x `[B, C, F, H, W]` with its first m latent frames replaced by motion `[B, C, m, H, W]`."""
    m = motion.shape[2]

    def write(x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        x[:, :, :m] = motion
        return x

    return write


def load(fx: Fixture, *, dtype: torch.dtype | None = None) -> FlashHeadDiT:
    """The fixture's DiT through the loader a real checkpoint takes (`load_flashhead_dit`)."""
    try:
        config = FlashHeadConfig.from_official(fx.config, fx.settings.get("audio_tiny_overrides"))
    except (ValueError, TypeError) as e:
        raise InputError(f"{fx.path}: not a FlashHead DiT config ({e})") from None
    return load_flashhead_dit(fx.weights, config, dtype=dtype, what=f"{fx.path.name} weights")


def chunk_loop(net: FlashHeadDiT, fx: Fixture) -> dict[str, torch.Tensor]:
    """`generate` over the fixture's chunks with its stored draws: {"latents" `[chunks, C, F, H, W]`,
    "velocity_chunk0_step0" `[C, F, H, W]`}."""
    s = fx.settings
    try:
        y = fx.inputs["y"][None]  # [1, C, F, H, W]
        audio = fx.inputs["audio"]  # [chunks, frames, window, layers, channels]
        noise = fx.inputs["noise"]  # [chunks, S + 1, C, F, H, W]
        sigmas = torch.tensor(s["sigmas"], dtype=torch.float32)  # [S + 1]
        handoff = int(s["motion_latents"])
    except KeyError as e:
        raise InputError(f"{fx.path}: fixture lacks {e.args[0]!r}") from None
    steps = sigmas.numel() - 1
    if noise.shape[1] != steps + 1 or audio.shape[0] != noise.shape[0]:
        raise InputError(f"{fx.path}: {noise.shape[1]} noise draws for {steps} steps, "
                         f"audio for {audio.shape[0]} chunks and noise for {noise.shape[0]}")
    velocities: list[torch.Tensor] = []
    motion = y[:, :, :1]  # chunk 0: the reference's first latent
    finals = []
    for c in range(noise.shape[0]):
        def denoise(x: torch.Tensor, sigma: torch.Tensor, c: int = c) -> torch.Tensor:
            velocities.append(net(x, sigma, audio[c][None], y))
            return velocities[-1]

        x = sample_renoise(denoise, noise[c, 0][None], sigmas, noise=noise[c, 1:, None],
                           given=_given(motion))  # [1, C, F, H, W]
        finals.append(x[0])
        motion = x[:, :, -handoff:]  # the identity VAE's hand-off
    return {"latents": torch.stack(finals), "velocity_chunk0_step0": velocities[0][0]}


def run(fx: Fixture) -> dict[str, torch.Tensor]:
    """The fixture's expected tensors, computed by our port in fp32."""
    return chunk_loop(load(fx), fx)
