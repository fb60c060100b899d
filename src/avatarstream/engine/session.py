"""Rolling session state: the only things that survive from one chunk to the next.

Reference caches (once per request), the appearance anchor, the latents later chunks are given
(continuity), refined latents waiting for their publication slot (interp), the causal strategy's
rolling KV caches and attention sink, the VAE conv cache,
the audio feature stream and the media clock position. Its size depends on the chunk size and
never on how long the session has run (`nbytes` is what the tests and benchmarks watch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from avatarstream.engine.schedule import SCENE_CHUNK, ChunkPlan


@dataclass
class _Kept:
    lr: dict[int, torch.Tensor]  # chunk frame index -> [B, C, h, w]
    motion: dict[int, torch.Tensor]  # chunk frame index -> [B, Dm]


class ChunkStore:
    """Latents kept for continuity, and refined latents waiting to be published, keyed by chunk."""

    def __init__(self) -> None:
        self._kept: dict[int, _Kept] = {}
        self._emitted: dict[int, torch.Tensor] = {}  # chunk id -> [B, C, E, H, W] refined latents

    def put(self, plan: ChunkPlan, lr: torch.Tensor, motion: torch.Tensor, hr: torch.Tensor) -> None:
        """Keep the frames of `plan.keep` (lr [B,C,T,h,w], motion [B,T,Dm]) and the emitted hr."""
        self._kept[plan.id] = _Kept(
            lr={i: lr[:, :, i].clone() for i in plan.keep},
            motion={i: motion[:, i].clone() for i in plan.keep},
        )
        self._emitted[plan.id] = hr

    def set_scene(self, lr: torch.Tensor, motion: torch.Tensor) -> None:
        """The scene frame (lr [B,C,h,w], motion [B,Dm]): what a schedule's `SCENE_CHUNK` frames
        are given. Kept for the whole session (one latent frame)."""
        self._kept[SCENE_CHUNK] = _Kept(lr={0: lr.clone()}, motion={0: motion.clone()})

    def scene(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        k = self._kept.get(SCENE_CHUNK)
        return None if k is None else (k.lr[0], k.motion[0])

    def given(self, plan: ChunkPlan) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """(chunk frame index, clean latent [B,C,h,w], motion [B,Dm]) for every given frame."""
        out = []
        for g in plan.given:
            kept = self._kept.get(g.source_chunk)
            if kept is None:
                raise RuntimeError(f"chunk {plan.id} is given a frame of chunk {g.source_chunk}, "
                                   "which is not in the store (no scene frame set?)")
            out.append((g.index, kept.lr[g.source_index], kept.motion[g.source_index]))
        return out

    def put_emitted(self, chunk_id: int, hr: torch.Tensor) -> None:
        """Refined latents of a chunk made elsewhere (a pipeline-parallel refine process)."""
        self._emitted[chunk_id] = hr

    def take_emitted(self, chunk_id: int) -> torch.Tensor:
        return self._emitted.pop(chunk_id)

    def release(self, ids: tuple[int, ...]) -> None:
        for cid in ids:
            self._kept.pop(cid, None)

    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self._emitted.values())
        for k in self._kept.values():
            n += sum(t.numel() * t.element_size() for t in k.lr.values())
            n += sum(t.numel() * t.element_size() for t in k.motion.values())
        return n


@dataclass
class SessionState:
    """Per-session rolling state. Created by the pipeline; stages read and update it."""

    batch: int = 1
    dit_reference: Any = None  # ReferenceCache of the DiT (grows by one anchor frame at most)
    refiner_reference: Any = None  # ReferenceCache of the SR refiner
    text: torch.Tensor | None = None  # [B, L, Dt]
    text_mask: torch.Tensor | None = None  # [B, L]
    anchor_added: bool = False
    store: ChunkStore = field(default_factory=ChunkStore)
    vae_cache: Any = None  # ConvCache of the streaming decoder
    publisher: Any = None  # where its video and audio go: put_video / put_audio (a Publisher)
    audio: Any = None  # AudioContext: streaming features of the session's speech
    causal: Any = None  # CausalDenoiser (causal strategy): per-step rolling KV caches + sink
    family: Any = None  # a model family's own rolling state (FlashHead: its trailing audio window)
    total_frames: int | None = None  # video frames of the whole output, once the audio has ended
    frames_published: int = 0
    frames_emitted: int = 0  # handed to decode & publish: ahead of frames_published by the chunk
    # the decode thread is working on (what pacing against the media clock counts)
    chunks_done: int = 0

    def rolling_nbytes(self) -> int:
        n = self.store.nbytes()
        for obj in (self.vae_cache, self.dit_reference, self.refiner_reference, self.causal, self.family):
            if obj is not None and hasattr(obj, "nbytes"):
                n += int(obj.nbytes() if callable(obj.nbytes) else obj.nbytes)
        return n
