"""LiveAvatarDenoiser: one stream's rolling state of LiveAvatar's block-causal DiT (docs/real-models.md, "Streaming state").

What LiveAvatar keeps per stream, constant in its length:
- the prompt's text K/V (`LiveAvatarDiT.text_cache`, made once);
- the sink: one t = 0 prefill over [reference ; FramePack], its K kept before RoPE and placed
  per block by the rolling rule (`models/liveavatar/sink.py`). The official pipeline prefills it
  once per step cache; the passes are identical, so it is made once and shared by every step;
- one `KVRing` per denoising step it runs (timestep forcing: block b at step i reads the K/V the
  previous blocks wrote at step i);
- the block count.

Step i of block b is `x ← x + (σ[i+1] − σ[i])·v(x, t = 1000·σ[i])` in float32 (diffusers' Euler
step over LiveAvatar's σ table, `SIGMAS`).

Two choices differ from the official code, knowingly (docs/real-models.md, LiveAvatar's "Generate"):
- the sink distance d is `sink_distance(seed, block)`: drawn per block from the session seed, in
  the official range [4, 30]. The official code draws it from Python's unseeded `random` on every
  forward (and every TPP rank draws its own), so no run can be reproduced;
- Adaptive Attention Sink (`adaptive_attention_sink`) re-prefills the sink with the stream's first
  generated latent after `aas_block` blocks (LiveAvatar: after clip 0, 4 blocks), keeping the
  FramePack motion latents, as the TPP pipeline does.

A TPP worker (`parallel/tpp.py`) runs the same object with `steps` = its share, so its output is
the single-process output by construction.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from avatarstream.engine.module import Module
from avatarstream.models.liveavatar import KVRing

# diffusers FlowMatchEulerDiscreteScheduler(1000, shift=3).set_timesteps(4), as LiveAvatar samples
# (σ_min shifted twice: not flow_sigmas(4, 3)); t = 1000·σ (docs/real-models.md, LiveAvatar's "Generate")
SIGMAS = (1.0, 0.857692, 0.602151, 0.008929, 0.0)
SINK_DISTANCE_RANGE = (4, 30)  # the official random.randint(4, 30)


def sink_distance(seed: int, block: int) -> int:
    """The sink distance of `block` in a stream of session seed `seed`: every process that runs a
    step of that block draws the same d."""
    return random.Random(seed * 1_000_003 + block).randint(*SINK_DISTANCE_RANGE)


class LiveAvatarDenoiser:
    def __init__(self, dit: Module, *, block: int, ring_blocks: int, seed: int,
                 steps: Sequence[int] | None = None, sigmas: Sequence[float] = SIGMAS,
                 aas_block: int | None = 4, distance: Callable[[int], int] | None = None) -> None:
        """block: latent frames per block; ring_blocks: blocks each step's ring holds (the current
        one included); steps: the steps this process runs (default all); aas_block: the block
        before which the sink becomes the first generated latent (None: never); distance: block ->
        sink distance (default `sink_distance(seed, block)`; a parity run pins the fixture's)."""
        self.dit, self.block, self.seed, self.aas_block = dit, block, seed, aas_block
        self.distance = distance or (lambda b: sink_distance(seed, b))
        self.sigmas = torch.tensor(sigmas, dtype=torch.float32)
        n = self.sigmas.numel() - 1
        self.steps = list(range(n)) if steps is None else list(steps)
        if any(not 0 <= j < n for j in self.steps):
            raise ValueError(f"steps {self.steps} outside 0..{n - 1}")
        layers = len(dit.model.blocks)
        self.rings = {j: KVRing(layers, block * ring_blocks) for j in self.steps}
        self.text = None
        self.sink = None
        self.motion: torch.Tensor | None = None
        self.first: torch.Tensor | None = None  # [1, C, 1, h, w] the stream's first generated latent
        self.blocks_done = 0

    def start(self, ref_latent: torch.Tensor, motion: torch.Tensor, context: torch.Tensor) -> None:
        """ref_latent `[1, C, 1, h, w]`, motion `[1, C, T_m, h, w]` (FramePack reads the newest),
        context `[L, text_dim]` (the precomputed umT5 output): text cache and sink."""
        self.motion = motion
        self.text = self.dit.call("text_cache", context)
        self.sink = self.dit.call("prefill_sink", ref_latent, motion, self.text)

    def adaptive_attention_sink(self, first: torch.Tensor) -> None:
        """AAS: the sink re-prefilled with `first` `[1, C, 1, h, w]`, the stream's first generated
        latent, as the reference (the motion latents stay)."""
        assert self.motion is not None
        self.sink = self.dit.call("prefill_sink", first, self.motion, self.text)

    def wants_sink_swap(self) -> bool:
        """True right before the block at which AAS replaces the sink."""
        return self.aas_block is not None and self.blocks_done == self.aas_block

    def denoise(self, x: torch.Tensor, audio: torch.Tensor, block: int) -> torch.Tensor:
        """This process's steps of block `block`: x `[1, C, F, h, w]` at σ[steps[0]] -> at
        σ[steps[-1] + 1]; audio: the block's wav2vec2 states `[1, L, C_a, 4F]`."""
        if self.sink is None:
            raise RuntimeError("LiveAvatarDenoiser.start(...) must come first")
        d = self.distance(block)
        start = block * self.block
        for j in self.steps:
            t = 1000.0 * float(self.sigmas[j])
            v = self.dit.call("forward_block", x, t, audio, self.text, self.sink, self.rings[j], start, d)
            x = x.float() + (self.sigmas[j + 1] - self.sigmas[j]) * v.float()
        if block == 0 and self.steps[-1] == self.sigmas.numel() - 2:
            self.first = x[:, :, :1].clone()  # finished here: AAS's sink (a TPP worker's: the last's)
        self.blocks_done += 1
        return x

    def nbytes(self) -> int:
        n = sum(r.nbytes() for r in self.rings.values())
        for part in (self.sink, self.text):
            n += part.nbytes() if part is not None else 0
        return n
