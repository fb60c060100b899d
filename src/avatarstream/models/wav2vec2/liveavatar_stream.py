"""LiveAvatar's audio input over a bounded window: what a stream of unknown length can compute.

The official path (`liveavatar.py`) encodes the **whole file at once**: the normalisation, the
self-attention and the 50 → 30 fps resampling all see every sample, so no feature exists before
the file ends (docs/real-models.md, LiveAvatar's "Audio"). `LiveAvatarAudioStream` keeps a trailing window of
`history_seconds` of samples (plus `lookahead_frames` of future audio a block waits for) and, per
block, encodes that window alone:

1. normalise the window and run the encoder at 50 Hz: `[L+1, T50, C]` (as the official path);
2. video frame j takes the 30-fps frame k = round(j · 30/25), as the official bucketing does, and
   that frame's state is read at its own time, k/30 s, by linear interpolation between the two
   50 Hz frames around it (the official path stretches the 30-fps grid over the whole file with
   `align_corners`, which the window cannot know; the two grids differ by under one 30-fps frame).

Memory and time per block are constant in the stream's length (one encoder pass over the
window). How far this is from the whole-file encoding is measured in
tests/models/test_liveavatar_audio_stream.py on the `wav2vec2-a` fixture's network and written
in docs/real-models.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from avatarstream.models.wav2vec2.liveavatar import liveavatar_states
from avatarstream.models.wav2vec2.model import Wav2Vec2


@dataclass(frozen=True)
class LiveAvatarStreamConfig:
    sample_rate: int = 16000
    fps: int = 25  # video frames per second
    mid_fps: int = 30  # the official encoder's intermediate rate (the bucketing grid)
    feature_rate: int = 50  # wav2vec2's frames per second (320x down at 16 kHz)
    history_seconds: float = 8.0  # past audio every block's encoding sees
    # video frames of future audio a block waits for (latency): the encoder is bidirectional, and
    # one block (0.48 s) of it halves the distance to the whole-file features (docs/real-models.md)
    lookahead_frames: int = 12

    @property
    def samples_per_frame(self) -> int:
        return self.sample_rate // self.fps

    @property
    def window_samples(self) -> int:
        return int(round(self.history_seconds * self.sample_rate))


class LiveAvatarAudioStream:
    """Push samples as they arrive; `block(start, stop)` is the DiT's `audio_input` for video
    frames [start, stop) `[1, L+1, C, stop − start]`, from the window that ends `lookahead_frames`
    after `stop` (silence where the stream has not reached yet or has ended). Samples older than
    the window behind the newest block are dropped."""

    def __init__(self, model: Wav2Vec2, cfg: LiveAvatarStreamConfig = LiveAvatarStreamConfig()) -> None:
        self.model, self.cfg = model, cfg
        self._buf = torch.zeros(0)  # samples from `_first` on
        self._first = 0
        self.ended = False  # no more samples come: windows stop at the last one

    def end(self) -> None:
        self.ended = True

    def push(self, samples: torch.Tensor) -> None:
        self._buf = torch.cat([self._buf, samples.detach().reshape(-1).float().cpu()])

    def _window(self, lo: int, hi: int) -> torch.Tensor:
        """Samples [lo, hi) of the stream `[hi − lo]`, zeros where none were pushed."""
        out = torch.zeros(hi - lo)
        a, b = max(lo, self._first), min(hi, self._first + self._buf.numel())
        if b > a:
            out[a - lo : b - lo] = self._buf[a - self._first : b - self._first]
        return out

    def block(self, start: int, stop: int) -> torch.Tensor:
        c = self.cfg
        hi = (stop + c.lookahead_frames) * c.samples_per_frame
        if self.ended:  # the last window ends with the audio (silence only where it must)
            hi = max(stop * c.samples_per_frame, min(hi, self._first + self._buf.numel()))
        lo = max(0, hi - c.window_samples)
        wave = self._window(lo, hi)
        # drop what no later block's window reaches (blocks come in order)
        keep_from = max(self._first, stop * c.samples_per_frame - c.window_samples)
        self._buf = self._buf[keep_from - self._first :].clone()
        self._first = keep_from
        dev = next(self.model.parameters()).device
        states = liveavatar_states(self.model, wave.to(dev))  # [L+1, T50, C]
        k = torch.round(torch.arange(start, stop, dtype=torch.float64) * c.mid_fps / c.fps)
        # the 30-fps frame's time in 50 Hz frames of this window
        pos = (k / c.mid_fps * c.feature_rate - lo / (c.sample_rate / c.feature_rate))
        pos = pos.clamp(0, states.shape[1] - 1)
        i0 = pos.floor().long()
        i1 = (i0 + 1).clamp(max=states.shape[1] - 1)
        w = (pos - i0.double()).float().to(dev)[None, :, None]
        out = states[:, i0] * (1 - w) + states[:, i1] * w  # [L+1, n, C]
        return out.permute(0, 2, 1)[None]  # [1, L+1, C, n]

    def nbytes(self) -> int:
        return self._buf.numel() * self._buf.element_size()
