"""DecodePublishStage: streaming causal-VAE decode of the refined latents, in timeline order,
trimmed to the audio's length, then published (frames carry their index: pts = index / fps).

Batch-first: `prepare` takes what the chunks publish from each session's rolling store (in the
caller's thread: the store is the denoising thread's) into a `DecodeJob`, which groups the entries
of different sessions that share a conv-cache layout into one decode call (`ConvCache.stack` /
`split`); a session's own entries stay in order, one group after the other.

**Overlapped decode**: with a worker (`BackgroundWorker`, given by the executor) the job runs on a
thread of its own while the next chunks are denoised. On a CPU the decoder is the largest single
cost of a chunk at 256 px, and the chunk loop is a chain of small ops that two cores share poorly;
with the worker, the decode of chunk k runs on its own core while the DiT and the refiner make
chunk k+1: the same ops on the same data in the same order (only the worker touches the conv
caches and `frames_published` of the sessions it decodes), so the video is bit-identical to the
inline decode (tests/engine), and at most one job waits in between (constant memory,
back-pressure). A session's first frames are decoded inline, with every core, so time to first
frame is not held back (measured on 2 AVX2 cores, 256 px, the 11.4M-parameter model: inline 1.05x
real time, TTFF 1.28 s; the worker from the first chunk 1.10x, TTFF 1.91 s; from the second chunk
on 1.11x, TTFF 1.31 s).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from avatarstream.cache.conv import ConvCache
from avatarstream.engine.module import Module
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import Item, Stage
from avatarstream.engine.worker import BackgroundWorker, SplitWorker
from avatarstream.models.vae import patches_to_uint8


def to_uint8_frames(video: torch.Tensor) -> np.ndarray:
    """[3, F, H, W] in [-1, 1] -> [F, H, W, 3] uint8."""
    return patches_to_uint8(video[None])[0].numpy()


@dataclass
class _Entry:
    state: SessionState
    hr: torch.Tensor  # [1, C, E, H/8, W/8] refined latents
    start: int  # timeline frame of the first decoded frame
    frames: int  # frames to publish (the rest, past the end of the audio, are dropped)

    def key(self) -> tuple:
        return tuple(self.hr.shape), self.state.vae_cache.layout(), self.start == 0


@dataclass
class DecodeJob:
    """Decodes and publishes groups of entries, one VAE call per group, groups in order."""

    vae: Module
    fps: int
    groups: list[list[_Entry]] = field(default_factory=list)

    @property
    def states(self) -> list[SessionState]:
        return [e.state for g in self.groups for e in g]

    def add(self, entry: _Entry) -> None:
        """Into the first group after this session's last one whose entries decode alike."""
        after = max((i for i, g in enumerate(self.groups) if any(e.state is entry.state for e in g)),
                    default=-1)
        for g in self.groups[after + 1 :]:
            if g[0].key() == entry.key():
                g.append(entry)
                return
        self.groups.append([entry])

    def run(self) -> None:
        for group in self.groups:
            caches = [e.state.vae_cache for e in group]
            cache = ConvCache.stack(caches)
            hr = torch.cat([e.hr for e in group], 0)
            # A stream's first chunk decodes its first latent (one frame) alone and publishes it
            # before the rest: the first frame is out a whole chunk's decode sooner. The VAE's
            # streaming cache makes the two calls the one call's computation (float rounding).
            parts = hr.split([1, hr.shape[2] - 1], dim=2) if group[0].start == 0 and hr.shape[2] > 1 else (hr,)
            done = 0
            for part in parts:
                frames = self._decode(part, cache)  # uint8 [B, F, H, W, 3]
                self._publish(group, frames, done)
                done += frames.shape[1]
            ConvCache.split(cache, caches)

    # -- in two parts, on two threads (`SplitWorker`) -------------------------------------------
    def splittable(self) -> bool:
        """Whether this job can decode in two parts: a VAE that has them (ours, decoding
        eagerly) and no stream's first chunk (that one is split for its first frame instead)."""
        m = self.vae.model
        return (hasattr(m, "decode_front") and getattr(m, "decode_backend", None) is None
                and all(g[0].start > 0 for g in self.groups))

    def run_front(self) -> list[torch.Tensor]:
        """The low-resolution part of every group's decode: features for `run_back`."""
        keys = self.vae.model.is_back_layer
        out = []
        for group in self.groups:
            caches = [e.state.vae_cache for e in group]
            cache = ConvCache.stack(caches, lambda k: not keys(k))
            out.append(self.vae.call("decode_front", torch.cat([e.hr for e in group], 0), cache))
            ConvCache.split(cache, caches, lambda k: not keys(k), count=False)
        return out

    def run_back(self, features: list[torch.Tensor]) -> None:
        """The rest of every group's decode, then its frames published, groups in order."""
        keys = self.vae.model.is_back_layer
        for group, h in zip(self.groups, features):
            caches = [e.state.vae_cache for e in group]
            cache = ConvCache.stack(caches, keys)
            frames = self.vae.call("decode_back", h, cache).cpu()
            ConvCache.split(cache, caches, keys)
            self._publish(group, frames, 0)

    def _publish(self, group: list[_Entry], frames: torch.Tensor, done: int) -> None:
        """Row i of `frames` (uint8 [B, F, H, W, 3]) to entry i's session: the frames after the
        `done` already published of the entry, up to its count (past the audio: dropped)."""
        for i, e in enumerate(group):
            n = max(0, min(e.frames - done, frames.shape[1]))
            if n:
                e.state.publisher.put_video(frames[i, :n].numpy(), e.start + done, self.fps)
                e.state.frames_published = e.start + done + n

    def _decode(self, z: torch.Tensor, cache: ConvCache) -> torch.Tensor:
        """The next frames of the streams in `cache` as uint8 pictures [B, F, H, W, 3]: straight
        from the VAE where it converts while it unfolds its pixel patches (ours), else its video."""
        if hasattr(self.vae.model, "decode_step_frames"):
            return self.vae.call("decode_step_frames", z, cache).cpu()
        return patches_to_uint8(self.vae.call("decode_step", z, cache)).cpu()


class DecodePublishStage(Stage):
    name = "decode_publish"
    reads = ("hr_latents",)
    writes = ()

    def __init__(self, vae: Module, *, fps: int) -> None:
        super().__init__()
        self.vae, self.fps = vae, fps
        self.worker: BackgroundWorker | SplitWorker | None = None  # set by the executor: overlapped decode

    def batch_key(self, rec, state):  # type: ignore[no-untyped-def]
        return "decode"  # one job per round; `DecodeJob` groups what decodes alike

    def prepare(self, items: Sequence[Item]) -> DecodeJob:
        """Take every chunk the items publish from the store; advance `frames_emitted`."""
        job = DecodeJob(self.vae, self.fps)
        for rec, state in items:
            for cid in rec.plan.publish:
                hr = state.store.take_emitted(cid)  # [1, C, E, H/8, W/8]
                start = state.frames_emitted
                # causal VAE: the stream's first latent decodes to one frame, every later one four
                n = 4 * hr.shape[2] - (3 if start == 0 else 0)
                if state.total_frames is not None:
                    n = max(0, min(n, state.total_frames - start))
                state.frames_emitted = start + n
                if n > 0:  # past the end of the audio: nothing to show
                    job.add(_Entry(state, hr, start, n))
        return job

    def run(self, items: Sequence[Item]) -> None:
        job = self.prepare(items)
        if not job.groups:
            return
        if self.worker is not None and all(e.start > 0 for g in job.groups for e in g):
            if isinstance(self.worker, SplitWorker) and job.splittable():
                self.worker.submit_split(job.run_front, job.run_back, tag=job.states)
            else:
                self.worker.submit(job.run, tag=job.states)
            return
        if self.worker is not None:
            self.worker.wait()  # what is decoded here comes after what the thread still has
        job.run()
