"""FlashHead's chunk work as engine stages (docs/real-models.md, "The official FlashHead loop"; stream mode).

    reference (once)  y = VAE encode of the reference image repeated over a chunk's F frames;
                      the scene frame = y's latent 0 (chunk 0's given latent); the picture kept
                      for colour correction
    per chunk         HandoffSchedule plans it (engine/handoff_schedule.py), Context pulls its
                      audio (raw samples per frame: engine/pcm_stream.py), then
      FlashHeadAudioStage    the chunk's new samples into the session's trailing 8 s window,
                             re-encoded whole (wav2vec2): the DiT's audio context [1, F, 5, L, C]
      FlashHeadDenoiseStage  re-noising sampler over flow_sigmas(steps, shift); the given
                             latents written before every step and after the last
      WholeChunkDecodeStage  decode whole, colour-correct, publish frames [h, F), re-encode the
                             last h frames: the next chunk's given latents (stages/whole_decode.py)

Rolling state of a session, constant in its length: y and the colour reference
(`state.dit_reference`, shared by every session of an avatar), the trailing audio window
(`state.family`, the model family's own slot), the hand-off latents (the store, released chunk
by chunk).
All of these stages take one session at a time (`batch_key` None): the official model runs batch 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from avatarstream.engine.config import ModelSet, PipelineConfig
from avatarstream.engine.handoff_schedule import HandoffSchedule
from avatarstream.engine.module import Module
from avatarstream.engine.pcm_stream import frames_from_tokens
from avatarstream.engine.schedule import ChunkPlan
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.engine.stages.reference import check_reference_size, frame_validity
from avatarstream.engine.stages.whole_decode import WholeChunkDecodeStage, encode_latents
from avatarstream.errors import ConfigError, InputError
from avatarstream.models.wav2vec2.flashhead import FlashHeadAudioConfig, FlashHeadAudioStream
from avatarstream.samplers.renoise import sample_renoise
from avatarstream.samplers.schedules import flow_sigmas


@dataclass
class FlashHeadReference:
    """What a FlashHead session keeps of its reference (computed once per avatar)."""

    y: torch.Tensor  # [1, C, T, h, w] latents of the reference repeated over a chunk's frames
    color: torch.Tensor  # [1, 3, 1, H, W] the reference picture in [-1, 1] (colour correction)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.y, self.color))

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a prepared-reference file stores (`from_tensors` reads it back)."""
        return {"y": self.y.contiguous(), "color": self.color.contiguous()}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> FlashHeadReference:
        return cls(y=t["y"], color=t["color"])


class FlashHeadReferenceStage:
    name = "reference"

    def __init__(self, vae: Module, *, frames: int, out_hw: tuple[int, int] | None = None) -> None:
        """out_hw: (H, W) the reference must have, the video's (None: not checked)."""
        self.vae, self.frames, self.out_hw = vae, frames, out_hw

    def run(self, state: SessionState, frames: torch.Tensor, prompt: str = "",
            scene: torch.Tensor | None = None) -> None:
        """frames: [F, 3, H, W] uint8 (the first is the reference picture). No prompt, no scene:
        FlashHead has no text encoder and starts from its reference."""
        if scene is not None:
            raise ConfigError("FlashHead starts from its reference picture; --scene is not supported")
        check_reference_size(frames, self.out_hw)
        image = frames[:1].permute(1, 0, 2, 3).float() / 127.5 - 1.0  # [3, 1, H, W]
        if not bool(frame_validity(image).all()):
            raise InputError("the reference picture is blank; give one that shows the person's face")
        color = image[None].to(self.vae.device)  # [1, 3, 1, H, W]
        y = encode_latents(self.vae, color.expand(-1, -1, self.frames, -1, -1).contiguous())
        state.dit_reference = FlashHeadReference(y=y, color=color)
        state.store.set_scene(y[:, :, 0].float(), torch.zeros(1, 1))  # chunk 0's given latent
        state.text, state.text_mask = None, None


class AudioWindow:
    """A session's trailing audio window (`FlashHeadAudioStream`) in its rolling state."""

    def __init__(self, stream: FlashHeadAudioStream) -> None:
        self.stream = stream

    def nbytes(self) -> int:
        return self.stream.window.numel() * self.stream.window.element_size()


class FlashHeadAudioStage(Stage):
    """The chunk's new samples (out of the Context stage's raw-sample tokens) pushed into the
    session's trailing window, which is encoded whole: rec.audio becomes `[1, F, 5, L, C]`."""

    name = "audio"
    reads = ("audio",)
    writes = ("audio",)

    def __init__(self, audio: Module, *, schedule: HandoffSchedule, config: FlashHeadAudioConfig) -> None:
        super().__init__()
        self.audio, self.geometry, self.config = audio, schedule, config

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        if rec.plan.positions != self.geometry.positions(rec.plan.id):
            raise ConfigError(f"the chunk loop planned this chunk for latents of another stride than "
                              f"the model's {self.geometry.stride} frames (PipelineConfig.latent_stride "
                              "must reach the handoff schedule)")
        a, b = self.geometry.chunk_frames(rec.plan.id)
        samples = frames_from_tokens(rec.audio[0], rec.plan.positions, self.geometry.window, a, b)
        if not isinstance(state.family, AudioWindow):
            state.family = AudioWindow(FlashHeadAudioStream(self.audio.model, self.config))
        window: AudioWindow = state.family
        window.stream.push(samples)
        rec.audio = self.audio.run(window.stream.context)  # [1, F, 5, L, C]


Draws = Callable[[ChunkPlan, int], torch.Tensor]
"""Noise draw i of a chunk (0: the initial x; i + 1: the draw after step i), `[1, C, T, h, w]`."""


class FlashHeadDenoiseStage(Stage):
    name = "denoise"
    reads = ("audio",)
    writes = ("lr_latents",)

    def __init__(self, dit: Module, *, steps: int, shift: float, seed: int,
                 draws: Draws | None = None) -> None:
        """draws: the noise to use (tests replay a fixture's); default: a generator per chunk,
        seeded by (seed, chunk id)."""
        super().__init__()
        self.dit, self.seed, self.draws = dit, seed, draws
        self.sigmas = flow_sigmas(steps, shift)  # [S + 1], FlashHead's table at 4 steps, shift 5

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        plan, ref = rec.plan, state.dit_reference
        y = ref.y  # [1, C, T, h, w]
        given = state.store.given(plan)
        if [i for i, _, _ in given] != list(range(len(given))):
            raise RuntimeError(f"chunk {plan.id}: FlashHead's given latents must lead the chunk")
        motion = torch.stack([lat for _, lat, _ in given], dim=2).to(y)  # [1, C, m, h, w]
        shape = (1, y.shape[1], plan.length, *y.shape[-2:])
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + plan.id)

        def draw(i: int) -> torch.Tensor:
            """Draw i (0: the initial x): injected, or the chunk's own generator's next."""
            return self.draws(plan, i) if self.draws is not None else torch.randn(shape, generator=g)

        def write(x: torch.Tensor) -> torch.Tensor:
            x = x.clone()
            x[:, :, : motion.shape[2]] = motion
            return x

        def denoise(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            return self.dit.call("forward", x, sigma, rec.audio, y)

        rec.lr_latents = sample_renoise(denoise, draw(0).to(y), self.sigmas, noise=lambda i: draw(i + 1),
                                        given=write)  # [1, C, T, h, w]


def frames_per_chunk(c: PipelineConfig) -> int:
    """Video frames a chunk decodes to (33 for both variants)."""
    return 1 + c.latent_stride * (c.chunk - 1)


def flashhead_stages(m: ModelSet, c: PipelineConfig) -> list[Stage]:
    """The model stages of a FlashHead chunk (`ModelSet.stages`)."""
    if c.strategy != "handoff":
        raise ConfigError(f"FlashHead continues its chunks by the motion hand-off (strategy handoff); "
                          f"it cannot run the {c.strategy!r} strategy")
    stride = c.latent_stride
    audio = FlashHeadAudioConfig(sample_rate=c.sample_rate, fps=c.fps, frame_num=frames_per_chunk(c))
    return [FlashHeadAudioStage(m.audio, schedule=HandoffSchedule(c.chunk, c.overlap, stride), config=audio),
            FlashHeadDenoiseStage(m.dit, steps=c.steps, shift=c.shift, seed=c.seed),
            WholeChunkDecodeStage(m.vae, fps=c.fps, overlap=c.overlap, handoff=(c.overlap - 1) * stride + 1,
                                  strength=c.color_strength)]


def flashhead_reference(m: ModelSet, c: PipelineConfig) -> FlashHeadReferenceStage:
    """The reference stage of a FlashHead model (`ModelSet.reference`)."""
    return FlashHeadReferenceStage(m.vae, frames=frames_per_chunk(c), out_hw=c.out_hw)
