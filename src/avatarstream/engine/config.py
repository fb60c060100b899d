"""What a model brings to the engine: its modules (`ModelSet`) and its inference settings
(`PipelineConfig`: geometry, steps, guidance, continuity strategy). The stages, the chunk loop,
the executors and the live scheduler all read these; the registry builds them.

Geometry: the output video is `height` x `width` pixels, or `hr_size` square when neither is set
(every config written before non-square video existed). A model with a refiner generates at
`lr_size / hr_size` of that; latents are `spatial_stride` times smaller again, and the DiT folds
`patch_size` x `patch_size` latents into a token (the refiner `refiner_patch` x `refiner_patch` of
the output's latents), so each side must be a multiple of `pixel_multiple` output pixels
(`check_geometry` says which, with the reason and the nearest sizes that work). A model of our own
family takes both patch sizes from its networks' configs (`weights/spec.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from avatarstream.engine.causal import CausalSettings
from avatarstream.engine.module import Module
from avatarstream.errors import ConfigError


@dataclass
class PipelineConfig:
    """Geometry and inference settings of one model family member (defaults come with the model)."""

    lr_size: int  # base DiT resolution in pixels of a square output (latent = lr_size // 8)
    hr_size: int  # output resolution in pixels (the side of a square; `height`/`width` override it)
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
    # causal: latents of the previous block each block is given (SR context; 0: none, LiveAvatar)
    block_context: int = 1
    decode_overlap: bool = True  # VAE decode + publish on a thread of its own (bit-identical video)
    # prefix/interp: chunks made from the reference are given the scene frame at frame 0 (the
    # reference's first usable frame: Avatar V's driving first frame); False: reference only
    scene_frame: bool = True
    seed: int = 0
    # an invisible mark in every published frame saying it is AI-generated (provenance/watermark.py)
    watermark: bool = True
    # handoff (FlashHead): Lab colour correction of every decoded frame to the reference (0: off)
    color_strength: float = 1.0
    latent_stride: int = 4  # video frames per latent after the first (the VAE's; LTX: 8)
    ref_t_position: float = -8.0
    fps: int = 25
    sample_rate: int = 16000
    # non-square output: both set (pixels), or neither (hr_size square)
    height: int | None = None
    width: int | None = None
    spatial_stride: int = 8  # pixels per latent side (the VAE's; LTX: 32)
    patch_size: int = 2  # latents per DiT token side (FlashHead Lite: 1)
    refiner_patch: int = 1  # latents per refiner token side, at the output's latents

    def __post_init__(self) -> None:
        if (self.height is None) != (self.width is None):
            raise ConfigError(f"give the video's height and width together (got height {self.height}, "
                              f"width {self.width})")
        if self.height is not None:
            self.check_geometry()

    @property
    def out_hw(self) -> tuple[int, int]:
        """(H, W) of the output video in pixels."""
        if self.height is None or self.width is None:
            return self.hr_size, self.hr_size
        return self.height, self.width

    @property
    def lr_hw(self) -> tuple[int, int]:
        """(h, w) in pixels the DiT generates at (the output's for a direct model)."""
        return tuple(s * self.lr_size // self.hr_size for s in self.out_hw)  # type: ignore[return-value]

    @property
    def latent_hw(self) -> tuple[int, int]:
        """(h, w) of the DiT's latents."""
        return tuple(s // self.spatial_stride for s in self.lr_hw)  # type: ignore[return-value]

    @property
    def pixel_multiple(self) -> int:
        """What each side of the output must be a multiple of: one DiT token's pixels, times the
        refiner's upscale (a whole number of tokens at the DiT's resolution), and one refiner
        token's pixels (a whole number of them at the output's)."""
        dit = self.spatial_stride * self.patch_size * self.hr_size // self.lr_size
        return math.lcm(dit, self.spatial_stride * self.refiner_patch)

    def check_geometry(self) -> None:
        """A ConfigError naming the multiple when the output size cannot be generated."""
        h, w = self.out_hw
        m = self.pixel_multiple
        if h < m or w < m or h % m or w % m:
            up = self.hr_size // self.lr_size
            why = (f"{self.spatial_stride}x smaller latents, {self.patch_size}x{self.patch_size} latents "
                   f"a token" + (f", generated at 1/{up} of the output and upscaled" if up > 1 else ""))
            lo = [max(m, s // m * m) for s in (w, h)]  # each side rounded down, and up
            hi = [max(m, -(-s // m) * m) for s in (w, h)]
            sizes = dict.fromkeys(f"{x}x{y}" for x, y in (lo, hi))  # in order, once each
            raise ConfigError(f"video size {w}x{h} (width x height): both sides must be positive "
                              f"multiples of {m} pixels for this model ({why}); the nearest sizes "
                              f"that work: {' or '.join(sizes)}")

    def with_size(self, height: int, width: int) -> PipelineConfig:
        """This config rendering `height` x `width` pixels (checked: `check_geometry`)."""
        return dataclasses.replace(self, height=int(height), width=int(width))

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


MAX_SIDE = 4096  # pixels: --size beyond this is refused (a 4K frame is 3840x2160)
SIZE_HELP = ("video size in pixels, WIDTHxHEIGHT (e.g. 512x288) or one number for a square "
             "(default: the model's); each side a multiple of what the model needs (16 for "
             "FlashHead Pro, 32 for Lite and the bundled model; an error names the nearest sizes), "
             f"at most {MAX_SIDE}")


def parse_size(text: str) -> tuple[int, int]:
    """`--size` of generate, serve and bench realtime -> (height, width): "WxH" (also "W*H",
    Wan's spelling) or "N" for N x N. Width first, as ffmpeg and the official scripts write it."""
    parts = text.lower().replace("*", "x").split("x")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        nums = []
    if len(nums) not in (1, 2) or min(nums) < 1:
        raise ConfigError(f"--size {text!r}: give WIDTHxHEIGHT in pixels (e.g. 512x288) or one number "
                          "for a square")
    width, height = nums if len(nums) == 2 else nums * 2
    if max(width, height) > MAX_SIDE:
        raise ConfigError(f"--size {text!r}: each side may be at most {MAX_SIDE} pixels")
    return height, width


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
