"""DecodePublishStage: streaming causal-VAE decode of the refined latents, in timeline order,
trimmed to the audio's length, then published (frames carry their index: pts = index / fps)."""

from __future__ import annotations

import torch

from avatarstream.engine.module import Module
from avatarstream.engine.publisher import Publisher
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage


def to_uint8_frames(video: torch.Tensor) -> "np.ndarray":  # noqa: F821
    """[3, F, H, W] in [-1, 1] -> [F, H, W, 3] uint8."""
    v = ((video.float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)
    return v.permute(1, 2, 3, 0).contiguous().numpy()


class DecodePublishStage(Stage):
    name = "decode_publish"
    reads = ("hr_latents",)
    writes = ()

    def __init__(self, vae: Module, publisher: Publisher, *, fps: int) -> None:
        super().__init__()
        self.vae, self.publisher, self.fps = vae, publisher, fps

    def run(self, rec: ChunkRecord, state: SessionState) -> None:
        for cid in rec.plan.publish:
            hr = state.store.take_emitted(cid)  # [1, C, E, H/8, W/8]
            start = state.frames_published
            if state.total_frames is not None and start >= state.total_frames:
                continue  # past the end of the audio: nothing to show
            frames = self.vae.call("decode_step", hr, state.vae_cache)  # [1, 3, F, H, W]
            n = frames.shape[2]
            if state.total_frames is not None:
                n = min(n, state.total_frames - start)
            self.publisher.put_video(to_uint8_frames(frames[0, :, :n]), start, self.fps)
            state.frames_published += n
