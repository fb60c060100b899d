"""The session's speech: pulled from an audio source, turned into per-video-frame features, and
handed on (unchanged) to the publisher so the output carries the input audio.

Features are computed once per video frame, in order, and kept in a rolling window long enough
for the chunk furthest back in time that may still be generated (the interp schedule generates an
I chunk after the N chunk that follows it). Memory is bounded by that window, not by duration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from avatarstream.engine.clock import MediaClock
from avatarstream.engine.module import Module
from avatarstream.errors import InputError


class AudioContext:
    def __init__(
        self,
        chunks: Iterator[torch.Tensor],
        encoder: Module,
        streaming: Any,  # StreamingAudioFeatures over `encoder.model`
        clock: MediaClock,
        *,
        window: int,
        keep_frames: int,
        on_audio: Callable[[torch.Tensor, int], None] | None = None,
        max_samples: int | None = None,
    ) -> None:
        self._chunks = chunks
        self._encoder = encoder
        self._stream = streaming
        self.clock = clock
        self.window = window
        self.keep_frames = keep_frames
        self._on_audio = on_audio
        self._max_samples = max_samples
        self.samples = 0
        self.ended = False
        # Rolling per-frame features: frames [self._base, self._base + len) in self._feats [F, D].
        self._base = -(4 + window)
        self._feats: torch.Tensor | None = None

    # -- pulling audio ---------------------------------------------------------------------------
    def _pull_one(self) -> bool:
        try:
            chunk = next(self._chunks)
        except StopIteration:
            self.ended = True
            self._stream.end()
            if self.samples == 0:
                raise InputError("the audio is empty (zero samples): give a file with speech in it")
            return False
        chunk = chunk.reshape(-1).to(torch.float32)
        if chunk.numel() == 0:
            return True
        if self._on_audio is not None:
            self._on_audio(chunk, self.samples)
        self.samples += chunk.numel()
        if self._max_samples is not None and self.samples > self._max_samples:
            raise InputError(
                f"the audio is longer than the cap of {self._max_samples / self.clock.sample_rate:.0f} s;"
                " raise it with --max-audio-seconds"
            )
        self._stream.push(chunk)
        return True

    @property
    def total_frames(self) -> int | None:
        return self.clock.frames_for_samples(self.samples) if self.ended else None

    @property
    def total_latents(self) -> int | None:
        n = self.total_frames
        return None if n is None else self.clock.latents_for_frames(n)

    def ensure_positions(self, horizon: int) -> None:
        """Pull audio until features of every frame timeline latents < horizon need exist (or end)."""
        if horizon <= 0:
            return
        _, stop = self._frame_range(horizon - 1)
        while not self.ended and self._stream.available_frames() < stop:
            self._pull_one()

    # -- features --------------------------------------------------------------------------------
    def _frame_range(self, position: int) -> tuple[int, int]:
        """Video frames whose features latent `position` uses: [e - 4 - w, e + w)."""
        _, e = self.clock.video_span(position)
        return e - self.clock.temporal_stride - self.window, e + self.window

    def _compute_until(self, stop: int) -> None:
        have = self._base + (0 if self._feats is None else self._feats.shape[0])
        if stop <= have:
            return
        new = self._encoder.run(self._stream.features, have, stop)  # [1, n, D]
        new = new[0].float()
        self._feats = new if self._feats is None else torch.cat([self._feats, new], 0)
        # Drop what no future chunk can need.
        excess = self._feats.shape[0] - self.keep_frames
        if excess > 0:
            self._feats = self._feats[excess:].clone()
            self._base += excess

    def tokens(self, positions: tuple[int, ...]) -> torch.Tensor:
        """Audio tokens [1, T, A, D] for the chunk's timeline positions (A = 4 + 2 * window)."""
        ranges = [self._frame_range(p) for p in positions]
        self._compute_until(max(b for _, b in ranges))
        assert self._feats is not None
        out = []
        for a, b in ranges:
            lo = a - self._base
            if lo < 0:
                raise RuntimeError("audio features needed by this chunk were already released")
            out.append(self._feats[lo : lo + (b - a)])  # [A, D]
        return torch.stack(out, 0).unsqueeze(0)  # [1, T, A, D]

    def nbytes(self) -> int:
        return 0 if self._feats is None else self._feats.numel() * 4
