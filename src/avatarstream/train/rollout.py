"""Rollouts for feedback alignment: the engine's own chunk loop, recorded.

A rollout is `Pipeline.run` of a registry model (`load_model`) on one condition (reference frames
+ speech): the same reference encoding, continuity schedule (the prefix hand-off included),
scene anchor, appearance anchor, streamed VAE decode and watermark as `avatarstream generate`.
The only difference is a stage that records what the DiT's sampler did: for every chunk, the
guided denoiser's inputs (clean given frames and mask, audio tokens, text, the reference cache
the chunk saw, the scene anchor, the guidance) and the sampler's state before every step and
after the last (`ChunkSteps`). From that record the trainer re-runs any DiT (the policy with
gradients, the frozen anchor without) on exactly the inputs the rollout had: `denoiser_for`.

The reference cache is recorded as the chunk saw it (with the appearance anchor after chunk 0)
and is held fixed when the policy is re-run: the gradient flows through the chunk's tokens, not
back into the reference tokens' K/V (the cost of one more reference pass per chunk, for a term
the conditioning path shares with every step).

`save_rollout` / `load_rollout`: a rollout's records as safetensors (no pickle: a pairs folder
is data someone may hand you), what `train dpo` reads.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from avatarstream.cache.reference import ReferenceCache
from avatarstream.engine.config import ModelSet
from avatarstream.engine.denoiser import Guidance, GuidedDenoiser
from avatarstream.engine.pipeline import Pipeline, default_stages
from avatarstream.engine.stages.audio_to_video import AudioToVideoStage
from avatarstream.errors import ConfigError, InputError
from avatarstream.eval.benchmark import CollectSink
from avatarstream.publish.base import ending
from avatarstream.samplers import sample_euler, sample_stochastic_euler
from avatarstream.train.rewards import Condition


def _normal(t: torch.Tensor | None) -> torch.Tensor | None:
    """A detached copy usable in autograd (an inference-mode tensor cannot be saved for backward)."""
    if t is None:
        return None
    with torch.inference_mode(False), torch.no_grad():
        return t.detach().clone()


def _normal_ref(r: ReferenceCache) -> ReferenceCache:
    return ReferenceCache([_normal(k) for k in r.k], [_normal(v) for v in r.v], _normal(r.motion),
                          _normal(r.t_pos), r.tokens_per_frame, _normal(r.key_valid))


@dataclass
class ChunkSteps:
    """One chunk's sampling: the denoiser's inputs and the flat states s_0 … s_S (s_0 the initial
    state, s_{j+1} the state after step j; the last is the clean sample before the given frames
    are put back). `sigmas` [S + 1]; `overshoot` of the stochastic sampler (0: the ODE)."""

    x_clean: torch.Tensor  # [1, C, T, h, w] initial latents with the given frames in place
    m_clean: torch.Tensor  # [1, T, Dm]
    given: torch.Tensor  # [1, T] bool
    audio: torch.Tensor  # [1, T, A, Da]
    text: torch.Tensor
    text_mask: torch.Tensor | None
    anchor: torch.Tensor | None
    reference: ReferenceCache
    scales: tuple[float, float] | None
    distilled: bool
    sigmas: torch.Tensor
    overshoot: float
    states: list[torch.Tensor] = field(default_factory=list)

    def guidance(self) -> Guidance:
        return Guidance(self.scales, distilled=self.distilled)

    def free_mask(self) -> torch.Tensor:
        """[1, N] bool over the flat state: the entries the sampler generates (not given)."""
        gx = self.given[:, None, :, None, None].expand_as(self.x_clean)
        gm = self.given[:, :, None].expand_as(self.m_clean)
        return ~torch.cat([gx.flatten(1), gm.flatten(1)], dim=1)

    def step_params(self, j: int) -> tuple[float, float, float, float]:
        """(σ, σ_o, a, std) of step j of `sample_stochastic_euler`: x_{j+1} = a·(s + (σ_o − σ)·v)
        + std·z (std 0: deterministic)."""
        s, s_next = float(self.sigmas[j]), float(self.sigmas[j + 1])
        s_o = max(s_next - self.overshoot * (s - s_next), 0.0)
        if s_next > 0.0 and s_o < s_next:
            a = (1.0 - s_next) / (1.0 - s_o)
            return s, s_o, a, max(s_next ** 2 - (a * s_o) ** 2, 0.0) ** 0.5
        return s, s_o, 1.0, 0.0


def denoiser_for(net: torch.nn.Module, ch: ChunkSteps) -> GuidedDenoiser:
    """The guided denoiser of `net` on a recorded chunk's inputs (call it on a flat state and σ)."""
    return GuidedDenoiser(net, ch.x_clean, ch.m_clean, ch.given, audio=ch.audio, text=ch.text,
                          text_mask=ch.text_mask, reference=ch.reference, anchor=ch.anchor,
                          guidance=ch.guidance())


class RecordingA2V(AudioToVideoStage):
    """The model's AudioToVideoStage (same weights module, sampler, guidance), recording each chunk."""

    @classmethod
    def wrap(cls, base: AudioToVideoStage, log: list[ChunkSteps]) -> RecordingA2V:
        rec = cls.__new__(cls)
        rec.__dict__.update(base.__dict__)
        rec.log = log
        return rec

    def sample(self, den: GuidedDenoiser, items: Any) -> torch.Tensor:
        if len(items) != 1:
            raise RuntimeError("a rollout is a batch of one stream")
        g = den.guidance
        sc = g.scales if g.distilled else g.cfg
        ch = ChunkSteps(_normal(den.x_clean), _normal(den.m_clean), _normal(den.given), _normal(den.audio),
                        _normal(den.text), _normal(den.text_mask), _normal(den.anchor), _normal_ref(den.reference),
                        None if sc is None else (float(sc[0]), float(sc[1])),
                        g.distilled, self.sigmas.clone(), 0.0 if self.sampler == "euler" else self.overshoot)
        ch.states.append(_normal(den.initial()))
        keep = lambda info: ch.states.append(_normal(info["x"]))  # noqa: E731
        if self.sampler == "euler":
            out = sample_euler(den, den.initial(), self.sigmas, callback=keep)
        else:
            rec = items[0][0]
            gen = torch.Generator().manual_seed(self.seed * 7919 + rec.plan.id)
            out = sample_stochastic_euler(den, den.initial(), self.sigmas, overshoot=self.overshoot,
                                          generator=[gen], callback=keep)
        self.log.append(ch)
        return out


@dataclass
class Rollout:
    """frames [F, S, S, 3] uint8 (what the user would see), the chunks' records, the seed."""

    frames: np.ndarray
    chunks: list[ChunkSteps]
    seed: int
    chunk_starts: list[int]


def reference_tensor(reference: np.ndarray, size: int, max_frames: int) -> torch.Tensor:
    """[k, 3, size, size] uint8 of the first 1 + 4j usable reference frames."""
    from avatarstream.media.reference import square_resize, usable_frame_count

    k = usable_frame_count(min(len(reference), max_frames))
    return torch.stack([square_resize(f, size) for f in reference[:k]])


def rollout(models: ModelSet, cond: Condition, seed: int, *, sampler: str | None = None,
            overshoot: float | None = None, sinks: list | None = None) -> Rollout:
    """Run the model's pipeline on `cond` with noise seed `seed` (its sampler unless `sampler`:
    euler | stochastic with `overshoot`), recording every chunk. `sinks`: more outputs (a file)."""
    c = models.config
    if c.strategy not in ("prefix", "interp") or models.stages is not None:
        raise ConfigError(f"{models.name}: alignment rollouts need our DiT with the prefix or interp "
                          f"strategy (this model runs {c.strategy!r})")
    cfg = dataclasses.replace(c, seed=int(seed), sampler=sampler or c.sampler,
                              overshoot=c.overshoot if overshoot is None else float(overshoot))
    log: list[ChunkSteps] = []

    def stages(m: ModelSet, pc: Any) -> list:
        out = default_stages(m, pc)
        out[0] = RecordingA2V.wrap(out[0], log)
        return out

    ref = reference_tensor(cond.reference, cfg.hr_size, cfg.ref_pixel_frames)
    step = cfg.sample_rate // 5
    audio = iter([torch.from_numpy(cond.audio[i:i + step].copy()) for i in range(0, len(cond.audio), step)])
    sink, extra = CollectSink(), list(sinks or [])
    for s in extra:
        s.open(cfg.out_hw[1], cfg.out_hw[0], cfg.fps, cfg.sample_rate)
    with ending(extra):  # finished (or, on a failure, ended) like generate's outputs
        Pipeline(models, cfg, stages=stages).run(ref, audio, [sink, *extra])
    n = int(round(len(cond.audio) / cfg.sample_rate * cfg.fps))
    frames = np.stack(sink.frames[:n])
    return Rollout(frames, log, int(seed), sink.chunk_starts)


# -- files ------------------------------------------------------------------------------------------
_TENSORS = ("x_clean", "m_clean", "given", "audio", "text", "text_mask", "anchor", "sigmas")


def save_rollout(path: str | Path, r: Rollout, meta: dict[str, Any] | None = None) -> None:
    """The rollout's chunk records as one safetensors file (frames are in the video beside it)."""
    from safetensors.torch import save_file

    t: dict[str, torch.Tensor] = {}
    info: list[dict[str, Any]] = []
    for i, ch in enumerate(r.chunks):
        for name in _TENSORS:
            v = getattr(ch, name)
            if v is not None:
                t[f"c{i}.{name}"] = v.contiguous()
        for j, s in enumerate(ch.states):
            t[f"c{i}.state{j}"] = s.contiguous()
        ref = ch.reference
        for j, (k, v) in enumerate(zip(ref.k, ref.v)):
            t[f"c{i}.ref.k{j}"], t[f"c{i}.ref.v{j}"] = k.contiguous(), v.contiguous()
        t[f"c{i}.ref.motion"], t[f"c{i}.ref.t_pos"] = ref.motion.contiguous(), ref.t_pos.contiguous()
        if ref.key_valid is not None:
            t[f"c{i}.ref.key_valid"] = ref.key_valid.contiguous()
        info.append({"scales": ch.scales, "distilled": ch.distilled, "overshoot": ch.overshoot,
                     "states": len(ch.states), "layers": len(ref.k), "tokens_per_frame": ref.tokens_per_frame})
    header = {"chunks": info, "seed": r.seed, "chunk_starts": r.chunk_starts, **(meta or {})}
    save_file(t, str(path), metadata={"avatarstream-rollout": json.dumps(header)})


def load_rollout(path: str | Path) -> tuple[list[ChunkSteps], dict[str, Any]]:
    """(chunk records, header) of a file `save_rollout` wrote; anything else is an InputError."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            header = json.loads((f.metadata() or {})["avatarstream-rollout"])
            t = {k: f.get_tensor(k) for k in f.keys()}
        chunks = []
        for i, info in enumerate(header["chunks"]):
            get = lambda name: t.get(f"c{i}.{name}")  # noqa: E731
            ref = ReferenceCache([t[f"c{i}.ref.k{j}"] for j in range(info["layers"])],
                                 [t[f"c{i}.ref.v{j}"] for j in range(info["layers"])],
                                 t[f"c{i}.ref.motion"], t[f"c{i}.ref.t_pos"], int(info["tokens_per_frame"]),
                                 get("ref.key_valid"))
            sc = info["scales"]
            ch = ChunkSteps(get("x_clean"), get("m_clean"), get("given").bool(), get("audio"), get("text"),
                            get("text_mask"), get("anchor"), ref, None if sc is None else (float(sc[0]), float(sc[1])),
                            bool(info["distilled"]), get("sigmas"), float(info["overshoot"]),
                            [t[f"c{i}.state{j}"] for j in range(info["states"])])
            if ch.text_mask is not None:
                ch.text_mask = ch.text_mask.bool()
            chunks.append(ch)
    except Exception as e:  # noqa: BLE001 - safetensors' own error, a missing key, a bad header: one message
        raise InputError(f"{path}: not a rollout record ({type(e).__name__}: {e})") from None
    return chunks, header
