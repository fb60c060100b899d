"""LiveAvatar's chunk work as engine stages (docs/real-models.md, LiveAvatar's "Generate"; the TPP pipeline's loop).

    reference (once)  the reference picture encoded alone: a one-frame latent (the TPP pipeline's
                      choice, quirk 6); the picture repeated over `motion_frames` (73) frames and
                      encoded: the 19 motion latents FramePack reads (never refreshed); the
                      precomputed umT5 context of the prompt (`models encode-text`)
    per block         CausalSchedule plans 3 latents (no given frames), Context pulls their audio
                      (raw samples per frame: engine/pcm_stream.py), then
      LiveAvatarAudioStage    the block's new samples into the session's bounded window,
                              encoded by wav2vec2 (models/wav2vec2/liveavatar_stream.py):
                              `[1, 25, C, 12]`, the block's 12 video frames
      LiveAvatarDenoiseStage  the block through every Euler step (engine/liveavatar.py), AAS
                              before block `aas_block`
      PrimedDecodeStage       Wan2.1 streaming decode; before the first block the conv caches
                              are primed with the first 7 motion latents (output discarded) and
                              block 0's first 3 frames are dropped, as the TPP pipeline does, so
                              N blocks publish 12·N − 3 frames: what the media clock counts for
                              3·N latents

Rolling state of a session, constant in its length: the reference record (`state.dit_reference`,
shared by every session of an avatar), the denoiser's rings, sink and text K/V
(`state.causal`), the audio window (`state.family`), the VAE's conv caches.
All stages take one session at a time (`batch_key` None).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from avatarstream.engine.config import ModelSet, PipelineConfig
from avatarstream.engine.liveavatar import LiveAvatarDenoiser
from avatarstream.engine.module import Module
from avatarstream.engine.pcm_stream import frames_from_tokens
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.engine.stages.decode_publish import to_uint8_frames
from avatarstream.engine.stages.reference import check_reference_size, frame_validity
from avatarstream.engine.stages.whole_decode import encode_latents
from avatarstream.errors import ConfigError, InputError
from avatarstream.models.liveavatar import LiveAvatarConfig
from avatarstream.models.wav2vec2.liveavatar_stream import LiveAvatarAudioStream, LiveAvatarStreamConfig

PRIME_LATENTS = 7  # motion latents decoded (and discarded) before the first block (tpp:1119-1128)
DROP_FRAMES = 3  # frames of block 0 dropped after the priming


@dataclass
class LiveAvatarReference:
    """What a LiveAvatar session keeps of its reference (computed once per avatar)."""

    ref: torch.Tensor  # [1, C, 1, h, w] the reference picture's latent
    motion: torch.Tensor  # [1, C, T_m, h, w] the motion latents (reference × motion_frames)
    context: torch.Tensor  # [L, text_dim] the prompt's umT5 output

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ref, self.motion, self.context))

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a prepared-reference file stores (`from_tensors` reads it back)."""
        return {"ref": self.ref.contiguous(), "motion": self.motion.contiguous(),
                "context": self.context.contiguous()}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> LiveAvatarReference:
        return cls(ref=t["ref"], motion=t["motion"], context=t["context"])


class LiveAvatarReferenceStage:
    name = "reference"

    def __init__(self, vae: Module, text: Module, *, motion_frames: int,
                 out_hw: tuple[int, int] | None = None) -> None:
        """out_hw: (H, W) the reference must have, the video's (None: not checked)."""
        self.vae, self.text, self.motion_frames, self.out_hw = vae, text, motion_frames, out_hw

    def run(self, state: SessionState, frames: torch.Tensor, prompt: str = "",
            scene: torch.Tensor | None = None) -> None:
        """frames: [F, 3, H, W] uint8 (the first is the reference picture); the prompt's context
        comes from the model's text module (a file made once by `models encode-text`)."""
        if scene is not None:
            raise ConfigError("LiveAvatar starts from its reference picture; --scene is not supported")
        check_reference_size(frames, self.out_hw)
        image = frames[:1].permute(1, 0, 2, 3).float() / 127.5 - 1.0  # [3, 1, H, W]
        if not bool(frame_validity(image).all()):
            raise InputError("the reference picture is blank; give one that shows the person's face")
        picture = image[None].to(self.vae.device)  # [1, 3, 1, H, W]
        ref = encode_latents(self.vae, picture).float()  # [1, C, 1, h, w]
        video = picture.expand(-1, -1, self.motion_frames, -1, -1).contiguous()
        motion = encode_latents(self.vae, video).float()  # [1, C, 1 + (motion_frames − 1)/4, h, w]
        context = self.text.call("encode", [prompt])
        state.dit_reference = LiveAvatarReference(ref=ref, motion=motion, context=context.float())
        state.store.set_scene(ref[:, :, 0], torch.zeros(1, 0))
        state.text, state.text_mask = None, None


class AudioWindow:
    """A session's bounded audio window in its rolling state, and how far it has been fed."""

    def __init__(self, stream: LiveAvatarAudioStream) -> None:
        self.stream, self.pushed = stream, 0

    def nbytes(self) -> int:
        return self.stream.nbytes()


class LiveAvatarAudioStage(Stage):
    """The block's new samples (out of the Context stage's raw-sample tokens, up to `lookahead`
    frames past the block) into the session's window; rec.audio becomes the block's wav2vec2
    states `[1, L, C, 4·block]`."""

    name = "audio"
    reads = ("audio",)
    writes = ("audio",)

    def __init__(self, audio: Module, *, block: int, window: int, config: LiveAvatarStreamConfig) -> None:
        super().__init__()
        if window < 3 + config.lookahead_frames:
            raise ConfigError(f"LiveAvatar's audio window ({window}) must reach {config.lookahead_frames} "
                              "frames past a block: PipelineConfig.audio_window = 3 + lookahead")
        self.audio, self.block, self.window, self.config = audio, block, window, config

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        if not isinstance(state.family, AudioWindow):
            state.family = AudioWindow(LiveAvatarAudioStream(self.audio.model, self.config))
        w: AudioWindow = state.family
        a = 4 * self.block * rec.plan.id  # the block's first video frame
        b = a + 4 * self.block
        need = b + self.config.lookahead_frames
        if need > w.pushed:
            w.stream.push(frames_from_tokens(rec.audio[0], rec.plan.positions, self.window, w.pushed, need))
            w.pushed = need
        rec.audio = self.audio.run(w.stream.block, a, b)  # [1, L, C, b − a]


class LiveAvatarDenoiseStage(Stage):
    name = "denoise"
    reads = ("audio", "sigma_noise")
    writes = ("lr_latents",)

    def __init__(self, dit: Module, *, block: int, ring_blocks: int, seed: int, adaptive_sink: bool) -> None:
        super().__init__()
        self.dit, self.block, self.ring_blocks, self.seed = dit, block, ring_blocks, seed
        self.aas_block = 4 if adaptive_sink else None

    def new_denoiser(self, state: SessionState, steps: list[int] | None = None) -> LiveAvatarDenoiser:
        ref: LiveAvatarReference = state.dit_reference
        den = LiveAvatarDenoiser(self.dit, block=self.block, ring_blocks=self.ring_blocks, seed=self.seed,
                                 steps=steps, aas_block=self.aas_block)
        den.start(ref.ref, ref.motion, ref.context)
        return den

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        if state.causal is None:
            state.causal = self.new_denoiser(state)
        den: LiveAvatarDenoiser = state.causal
        if den.wants_sink_swap():
            den.adaptive_attention_sink(den.first)
        rec.lr_latents = den.denoise(rec.sigma_noise.float(), rec.audio, rec.plan.id)  # [1, C, F, h, w]


class PrimedDecodeStage(Stage):
    """Streaming decode of every block in order (Wan2.1's 2-frame conv caches), primed per
    session; trimmed to the audio; published (frames carry their index: pts = index / fps)."""

    name = "decode_publish"
    reads = ("lr_latents",)
    writes = ()

    def __init__(self, vae: Module, *, fps: int) -> None:
        super().__init__()
        self.vae, self.fps = vae, fps

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        x = rec.lr_latents  # [1, C, F, h, w]
        drop = 0
        if state.vae_cache.chunks == 0:
            motion = state.dit_reference.motion
            self.vae.call("decode_step", motion[:, :, :PRIME_LATENTS].to(x), state.vae_cache)
            drop = DROP_FRAMES
        video = self.vae.call("decode_step", x, state.vae_cache)[0, :, drop:]  # [3, F', H, W]
        start = state.frames_emitted
        n = video.shape[1]
        if state.total_frames is not None:
            n = max(0, min(n, state.total_frames - start))
        if n > 0:
            state.publisher.put_video(to_uint8_frames(video[:, :n].cpu()), start, self.fps)
        state.frames_emitted = state.frames_published = start + n
        state.store.put(rec.plan, x, torch.zeros(1, x.shape[2], 0), x[:, :, :0])
        state.store.take_emitted(rec.plan.id)  # nothing waits for a publication slot


def liveavatar_stages(m: ModelSet, c: PipelineConfig) -> list[Stage]:
    """The model stages of a LiveAvatar block (`ModelSet.stages`)."""
    if c.strategy != "causal":
        raise ConfigError(f"LiveAvatar streams block-causally (strategy causal); it cannot run the "
                          f"{c.strategy!r} strategy")
    audio = LiveAvatarStreamConfig(sample_rate=c.sample_rate, fps=c.fps, lookahead_frames=c.audio_window - 3)
    return [LiveAvatarAudioStage(m.audio, block=c.block, window=c.audio_window, config=audio),
            LiveAvatarDenoiseStage(m.dit, block=c.block, ring_blocks=c.kv_blocks, seed=c.seed,
                                   adaptive_sink=c.adaptive_sink),
            PrimedDecodeStage(m.vae, fps=c.fps)]


def liveavatar_reference(m: ModelSet, c: PipelineConfig) -> LiveAvatarReferenceStage:
    """The reference stage of a LiveAvatar model (`ModelSet.reference`)."""
    # a rank without the DiT (the decode rank) primes its decoder with the same motion latents
    frames = (m.dit.model.config if m.dit.model is not None else LiveAvatarConfig()).motion_frames
    return LiveAvatarReferenceStage(m.vae, m.text, motion_frames=frames, out_hw=c.out_hw)
