"""WholeChunkDecodeStage: decode a chunk's latents at once, colour-correct, publish, hand off.

For a VAE that cannot stream (LTX-Video's decoder is not causal) or a model that was trained on
whole-chunk decodes (FlashHead Pro decodes each chunk with fresh Wan caches), and whose next chunk
continues from *pixels*: the continuity schedule's kept latents are not the denoised ones but the
re-encoding of the last `handoff` decoded, colour-corrected frames (docs/real-models.md, "The official FlashHead loop", steps 3-5).

    video = decode(x)                              [1, 3, F, H, W], F = 1 + s·(T − 1)
    video = match_colors(video, reference, strength)      (stages/color.py; 0: off)
    publish video[h : F] (trimmed to the audio)    h = handoff = (overlap − 1)·s + 1 frames,
                                                   dropped in every chunk (stream mode)
    kept  = encode(video[F − h : F])               [1, C, overlap, h', w'] -> the store, as this
                                                   chunk's frames T − overlap .. T − 1

It runs in the generating thread (the next chunk needs the hand-off) and one session at a time.
"""

from __future__ import annotations

import torch

from avatarstream.engine.module import Module
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.engine.stages.color import match_colors
from avatarstream.engine.stages.decode_publish import to_uint8_frames


def encode_latents(vae: Module, video: torch.Tensor) -> torch.Tensor:
    """The latents a VAE encodes `video` to: Wan's mean (its `encode` returns (mean, logvar)),
    or the tensor a VAE returns on its own."""
    out = vae.call("encode", video)
    return out[0] if isinstance(out, tuple) else out


class WholeChunkDecodeStage(Stage):
    name = "decode_publish"
    reads = ("lr_latents",)
    writes = ()

    def __init__(self, vae: Module, *, fps: int, overlap: int, handoff: int, strength: float) -> None:
        """overlap: latents the next chunk is given; handoff: the video frames they encode (and
        that are not published); strength: colour correction to the reference (0: off)."""
        super().__init__()
        if not 0.0 <= strength <= 1.0:
            raise ValueError(f"colour correction strength must be in [0, 1], got {strength}")
        self.vae, self.fps = vae, fps
        self.overlap, self.handoff, self.strength = overlap, handoff, strength

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        x = rec.lr_latents  # [1, C, T, h, w]
        video = self.vae.call("decode", x).float()  # [1, 3, F, H, W]
        if self.strength > 0.0:
            video = match_colors(video, state.dit_reference.color, self.strength)
        h = self.handoff
        start = state.frames_emitted
        n = video.shape[2] - h
        if state.total_frames is not None:
            n = max(0, min(n, state.total_frames - start))
        if n > 0:
            state.publisher.put_video(to_uint8_frames(video[0, :, h : h + n].cpu()), start, self.fps)
        state.frames_emitted = state.frames_published = start + n
        kept = encode_latents(self.vae, video[:, :, -h:].contiguous()).to(x)  # [1, C, overlap, h, w]
        lr = torch.cat([x[:, :, : -self.overlap], kept], dim=2)  # [1, C, T, h, w]
        state.store.put(rec.plan, lr, torch.zeros(1, lr.shape[2], 1), x[:, :, :0])
        state.store.take_emitted(rec.plan.id)  # nothing waits for a publication slot
