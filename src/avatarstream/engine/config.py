"""What a model brings to the engine: its modules (`ModelSet`) and its inference settings
(`PipelineConfig`: geometry, steps, guidance, continuity strategy). The stages, the chunk loop,
the executors and the live scheduler all read these; the registry builds them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from avatarstream.engine.causal import CausalSettings
from avatarstream.engine.module import Module
from avatarstream.errors import ConfigError


@dataclass
class PipelineConfig:
    """Geometry and inference settings of one model family member (defaults come with the model)."""

    lr_size: int  # base DiT resolution in pixels (latent = lr_size // 8)
    hr_size: int  # output resolution in pixels
    latent_channels: int
    motion_dim: int
    chunk: int  # latent frames per chunk
    ref_frames: int  # reference latent frames at most (video: 1 + 4 (R - 1) pixel frames)
    steps: int
    sampler: str = "euler"  # "euler" | "stochastic"
    shift: float = 1.0
    overshoot: float = 0.2
    # CFG scales (audio, reference): inputs of a CFG-distilled DiT (one pass), classifier-free
    # guidance of any other (2-3 passes a step); both None: the plain conditional prediction, one
    # None: 1.0 (that stream unguided)
    audio_scale: float | None = None
    ref_scale: float | None = None
    guidance_input: bool = False  # the DiT is CFG-distilled: the scales are its inputs
    sr_sigma: float = 0.6
    sr_window: int = 1
    audio_window: int = 1
    strategy: str = "prefix"
    overlap: int = 2
    interp_gap: int = 1
    interp_anchor: int = 1
    block: int = 3  # causal: latent frames per block
    kv_blocks: int = 4  # causal: blocks of history in each rolling KV cache
    adaptive_sink: bool = True  # causal: Adaptive Attention Sink (first generated frame as sink)
    rolling_rope: bool = True  # causal: the sink's RoPE position moves with the window
    history_level: str = "same"  # causal: "same" (timestep forcing) or "next" (CausalSettings)
    decode_overlap: bool = True  # VAE decode + publish on a thread of its own (bit-identical video)
    # prefix/interp: chunks made from the reference are given the scene frame at frame 0 (the
    # reference's first usable frame: Avatar V's driving first frame); False: reference only
    scene_frame: bool = True
    seed: int = 0
    # handoff (FlashHead): Lab colour correction of every decoded frame to the reference (0: off)
    color_strength: float = 1.0
    latent_stride: int = 4  # video frames per latent after the first (the VAE's; LTX: 8)
    ref_t_position: float = -8.0
    fps: int = 25
    sample_rate: int = 16000

    @property
    def guidance(self) -> tuple[float, float] | None:
        """(audio, reference) scales for the DiT, or None (neither set: no guidance)."""
        if self.audio_scale is None and self.ref_scale is None:
            return None
        return (float(1.0 if self.audio_scale is None else self.audio_scale),
                float(1.0 if self.ref_scale is None else self.ref_scale))

    @property
    def ref_pixel_frames(self) -> int:
        return 1 + 4 * (self.ref_frames - 1)

    def chunk_for_seconds(self, seconds: float) -> int:
        """Latent frames a chunk of `seconds` of video takes (rounded; including the prefix
        overlap, at least what the strategy needs): `--seconds-per-chunk` of generate and serve."""
        if not seconds > 0:
            raise ConfigError(f"--seconds-per-chunk must be positive, got {seconds:g}")
        return max(self.overlap + 1, self.interp_anchor + 2, round(seconds * self.fps / 4))

    def causal_settings(self) -> CausalSettings:
        return CausalSettings(block=self.block, kv_blocks=self.kv_blocks,
                              adaptive_sink=self.adaptive_sink, rolling_rope=self.rolling_rope,
                              history_level=self.history_level,
                              ref_t_position=self.ref_t_position,
                              guidance=self.guidance if self.guidance_input else None)


@dataclass
class ModelSet:
    """The modules of one model: what the stages call through their protocols."""

    name: str
    dit: Module
    refiner: Module | None  # None: a direct model (the DiT works at the output resolution)
    vae: Module
    audio: Module
    text: Module
    config: PipelineConfig
    make_audio_stream: Callable[[], object]  # -> StreamingAudioFeatures for a new session
    # a model family with its own chunk work (FlashHead): its stage builder, used instead of
    # `pipeline.default_stages`, and its reference stage, instead of `ReferenceStage` (a builder
    # (models, config) -> an object with `run(state, frames, prompt, scene)`); None: ours
    stages: Callable[[ModelSet, PipelineConfig], list] | None = None
    reference: Callable[[ModelSet, PipelineConfig], Any] | None = None

    def modules(self) -> list[Module]:
        return [m for m in (self.dit, self.refiner, self.vae, self.audio, self.text) if m is not None]
