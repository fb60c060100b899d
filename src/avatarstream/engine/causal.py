"""Causal streaming with timestep forcing (Live Avatar Algorithm 3; one worker's share of Alg. 4).

`CausalDenoiser` owns the rolling state of the block-causal DiT for one stream:
- one `RollingKVCache` per denoising step it runs (timestep forcing: block i at step j attends to
  the K/V the previous blocks produced at step j, i.e. at the same noise level). With
  `history_level = "next"` the K/V a block leaves in step j's cache are those of its state after
  that step (at the next, lower σ; clean after the last step), computed by one more forward of the
  same worker: block i at step j then reads its predecessors one notch less noisy than itself.
  Still local to the worker that owns step j, so timestep-forcing pipeline parallelism keeps
  working; it costs a second forward a step (see `CausalSettings.history_level`);
- the `SinkCache` (reference K/V, cached once per sink);
- the number of blocks done.

Its two named mechanisms of the Rolling Sink Frame Mechanism (sec. 4.4):
- `rolling_rope_position`: where the sink sits in time for the current block. With Rolling RoPE
  the sink keeps the offset it has in training from the first frame of the attention window
  (`ref_t_position` before the oldest block attended to), so the sink-to-block distances stay
  the ones the model was trained on however long the stream runs. Without it the sink stays at
  `ref_t_position` and drifts ever further away.
- `adaptive_attention_sink`: after the first block, the sink becomes the model's own first
  generated latent frame (timeline latent 0: a VAE latent of one video frame, the same kind of
  latent as a reference image) encoded once as a reference.

Running all steps in one process is Algorithm 3; a TPP worker (`parallel/tpp.py`) runs the same
object with `steps` = its share, so its output is the single-process output by construction.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from avatarstream.cache.kv import BlockKV, RollingKVCache
from avatarstream.cache.reference import ReferenceCache
from avatarstream.engine.denoiser import guidance_tensor, pack, unpack
from avatarstream.engine.module import Module
from avatarstream.models.sink import SinkCache
from avatarstream.models.transformer import DiTCondition
from avatarstream.samplers import sample_euler, sample_stochastic_euler


HISTORY_LEVELS = ("same", "next")


@dataclass(frozen=True)
class CausalSettings:
    """The causal strategy's knobs (defaults: Live Avatar's)."""

    block: int = 3  # latent frames per block
    kv_blocks: int = 4  # blocks of history in each rolling KV cache
    adaptive_sink: bool = True  # AAS: the first generated frame replaces the reference as sink
    rolling_rope: bool = True  # the sink's temporal position moves with the attention window
    ref_t_position: float = -8.0  # sink offset from the window's first frame (training geometry)
    # (audio, reference) scales, the inputs of a CFG-distilled DiT (one pass a step); None: the
    # DiT's plain conditional prediction (a DiT that is not CFG-distilled runs unguided here)
    guidance: tuple[float, float] | None = None
    # what a block leaves in step j's cache: "same" (Live Avatar: its K/V at step j's input, the
    # noise level of the blocks that read it) or "next" (its K/V at step j's output, σ_{j+1}: one
    # extra forward a step; the last step's cache holds the finished, clean block). At step 0
    # (σ = 1) "same" history is pure noise: a block's coarse layout is chosen without seeing its
    # predecessor, which is where the block seams come from (model card of the causal student)
    history_level: str = "same"

    def __post_init__(self) -> None:
        if self.history_level not in HISTORY_LEVELS:
            raise ValueError(f"history_level must be one of {HISTORY_LEVELS}, got {self.history_level!r}")


class _Pass:
    """One call on a thread of its own, started at once; `join` waits and re-raises its error."""

    def __init__(self, fn, *args) -> None:  # type: ignore[no-untyped-def]
        self._error: BaseException | None = None

        def run() -> None:
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - handed to the caller by join
                self._error = e

        self._thread = threading.Thread(target=run, name="avatarstream-history", daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def step_generator(seed: int, block: int, step: int) -> torch.Generator:
    """Fresh-noise generator of (block, step) for the stochastic sampler: any process that runs
    that step of that block draws the same noise."""
    return torch.Generator().manual_seed((seed * 1_000_003 + block) * 1009 + step)


class CausalDenoiser:
    """Rolling state + the per-block loop of Algorithm 3 over `steps` (default: all)."""

    def __init__(self, dit: Module, sigmas: torch.Tensor, settings: CausalSettings, *,
                 steps: Sequence[int] | None = None, sampler: str = "euler",
                 overshoot: float = 0.2, seed: int = 0, parallel_history: bool | None = None) -> None:
        """parallel_history (`history_level` "next"): run each step's extra forward (the K/V of
        its output) on a thread of its own while the next step denoises. Both read the state
        the step left and nothing the other writes (the extra pass reads step j's cache, the
        next step step j+1's; a block's K/V is appended to step j's cache once the block is
        done, before any later block reads it), so the result is the sequential one, bit for
        bit. Default: `hardware.parallel_history_pass()`."""
        if sampler not in ("euler", "stochastic"):
            raise ValueError(f"unknown sampler {sampler!r}")
        self.dit, self.sigmas, self.settings = dit, sigmas, settings
        n = sigmas.numel() - 1
        self.steps = list(range(n)) if steps is None else list(steps)
        if any(not 0 <= j < n for j in self.steps):
            raise ValueError(f"steps {self.steps} outside 0..{n - 1}")
        self.sampler, self.overshoot, self.seed = sampler, overshoot, seed
        cfg = dit.model.config
        self.caches = {j: RollingKVCache(cfg.depth, settings.kv_blocks) for j in self.steps}
        if parallel_history is None:
            from avatarstream.hardware import parallel_history_pass

            parallel_history = parallel_history_pass()
        self.parallel_history = parallel_history and settings.history_level == "next"
        self.sink: SinkCache | None = None
        self.anchor: torch.Tensor | None = None
        self.blocks_done = 0

    # -- the sink ----------------------------------------------------------------------------------
    def start(self, reference: ReferenceCache, anchor: torch.Tensor | None = None) -> None:
        """The reference (encoded at `ref_t_position`) is the first sink; anchor `[B, C, h, w]`:
        the scene frame's latent, the DiT's anchor input for every block (or None)."""
        self.anchor = anchor
        cfg = self.dit.model.config
        self.sink = SinkCache(reference, self.settings.ref_t_position,
                              head_dim=cfg.dim // cfg.heads, theta=cfg.rope_theta)

    def rolling_rope_position(self, block_start: int) -> float:
        """Φ: the sink's temporal position while the block starting at `block_start` is denoised."""
        s = self.settings
        if not s.rolling_rope:
            return s.ref_t_position
        held = [c.window_start() for c in self.caches.values()]
        first = held[0] if held and held[0] is not None else block_start
        return first + s.ref_t_position

    def adaptive_attention_sink(self, first_frame: torch.Tensor) -> None:
        """AAS: `first_frame` `[B, C, 1, h, w]` (the clean first generated latent) becomes the sink."""
        assert self.sink is not None
        pos = torch.full((1,), self.settings.ref_t_position)
        ref = self.dit.call("encode_reference", first_frame, None, pos)
        self.sink.replace(ref, self.settings.ref_t_position)

    # -- one block ---------------------------------------------------------------------------------
    def denoise(self, x: torch.Tensor, m: torch.Tensor, *, audio: torch.Tensor,
                text: torch.Tensor | None, text_mask: torch.Tensor | None,
                positions: Sequence[int], block: int,
                record: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run this denoiser's steps on block `block` (timeline `positions`, `len = block size`).

        x `[B, C, Tb, h, w]` at sigma = sigmas[steps[0]], m `[B, Tb, Dm]`; returns both at
        sigmas[steps[-1] + 1]. Each step's K/V goes into that step's cache afterwards (its input's,
        or with `history_level` "next" its output's, from one more forward).
        `record` (tests): gets (step, x_in, m_in, velocity, motion_velocity) per step.
        """
        if self.sink is None:
            raise RuntimeError("CausalDenoiser.start(reference) must come first")
        t_pos = torch.tensor([float(p) for p in positions])
        sink = self.sink.at(self.rolling_rope_position(int(positions[0])))
        b, tb = x.shape[0], x.shape[2]
        guidance = guidance_tensor(self.settings.guidance, b)
        shape_x, shape_m = x.shape, m.shape

        def forward(flat: torch.Tensor, sigma: torch.Tensor, cache: RollingKVCache,
                    kv_out: list[BlockKV]):  # type: ignore[no-untyped-def]
            xs, ms = unpack(flat, shape_x, shape_m)
            cond = DiTCondition(motion=ms, audio=audio, text=text, text_mask=text_mask, t_pos=t_pos,
                                anchor=self.anchor, guidance=guidance)
            sig = torch.full((b, tb), float(sigma))
            out, kv = self.dit.call("forward_causal_block", xs, sig, cond, sink, cache)
            kv_out.append(kv)
            return xs, ms, out

        pending: list[tuple[RollingKVCache, list[BlockKV], _Pass | None]] = []
        for j in self.steps:
            cache = self.caches[j]
            kv_out: list[BlockKV] = []

            def denoise(flat: torch.Tensor, sigma: torch.Tensor, cache=cache, kv_out=kv_out) -> torch.Tensor:  # type: ignore[no-untyped-def]
                xs, ms, out = forward(flat, sigma, cache, kv_out)
                v, mv = out.velocity.float(), out.motion_velocity.float()
                if record is not None:
                    record.append((j, xs.clone(), ms.clone(), v.clone(), mv.clone()))
                return pack(v, mv)

            sig = self.sigmas[j : j + 2]
            state = pack(x.float(), m.float())
            if self.sampler == "euler":
                state = sample_euler(denoise, state, sig)
            else:
                state = sample_stochastic_euler(denoise, state, sig, overshoot=self.overshoot,
                                                generator=step_generator(self.seed, block, j))
            x, m = unpack(state, x.shape, m.shape)
            if self.settings.history_level == "same":
                cache.append(kv_out[0], int(positions[0]))
            elif self.parallel_history and j != self.steps[-1]:  # beside the next step
                pending.append((cache, kv_out, _Pass(forward, state, sig[1], cache, kv_out)))
            else:  # the K/V of the step's output, at σ_{j+1}
                forward(state, sig[1], cache, kv_out)
                pending.append((cache, kv_out, None))
        for cache, kv_out, run in pending:
            if run is not None:
                run.join()
            cache.append(kv_out[-1], int(positions[0]))
        self.blocks_done += 1
        return x, m

    def nbytes(self) -> int:
        n = sum(c.nbytes() for c in self.caches.values())
        return n + (self.sink.nbytes() if self.sink is not None else 0)
