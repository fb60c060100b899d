"""PCMFrames: the session's speech cut into video frames of raw samples, as "audio features".

A model whose audio encoder cannot run per frame (FlashHead re-encodes a trailing 8 s window every
chunk: every feature depends on the whole window) still gets its audio through the engine's
`AudioContext`, which pulls the source, publishes the input audio, knows when it has ended and
keeps a bounded window: this stream is the `StreamingAudioFeatures` protocol with each frame's
feature being its `samples_per_frame` samples. The family's audio stage cuts the new samples of
a chunk out of the chunk's tokens and runs the real encoder (engine/stages/flashhead.py).

Frames before 0 and past the end of the audio are silence (the official stream pads with zeros).
Memory: the samples not yet handed out (the `AudioContext` asks for frames in order, once each).
"""

from __future__ import annotations

import torch


class PCMFrames:
    def __init__(self, samples_per_frame: int = 640) -> None:
        self.spf = samples_per_frame
        self._buf = torch.zeros(0)  # samples from frame `_first` on
        self._first = 0
        self._pushed = 0
        self.ended = False

    def push(self, samples: torch.Tensor) -> None:
        s = samples.detach().reshape(-1).to(torch.float32).cpu()
        self._buf = torch.cat([self._buf, s])
        self._pushed += s.numel()

    def end(self) -> None:
        self.ended = True

    def available_frames(self) -> int:
        """Whole frames pushed so far."""
        return self._pushed // self.spf

    def features(self, start: int, stop: int) -> torch.Tensor:
        """Frames [start, stop) -> `[1, stop − start, samples_per_frame]`; what lies before frame
        `start` is dropped (asked for once)."""
        n = max(0, stop - start)
        out = torch.zeros(n * self.spf)
        lo = max(start, self._first)
        if stop > lo:
            have = self._buf[(lo - self._first) * self.spf : (stop - self._first) * self.spf]
            off = (lo - start) * self.spf
            out[off : off + have.numel()] = have
        if stop > self._first:
            self._buf = self._buf[(stop - self._first) * self.spf :].clone()
            self._first = stop
        return out.view(1, n, self.spf)


def frames_from_tokens(tokens: torch.Tensor, positions: tuple[int, ...], window: int,
                       start: int, stop: int) -> torch.Tensor:
    """The samples of video frames [start, stop) out of a chunk's `AudioContext` tokens
    `[T, 4 + 2·window, spf]` at timeline `positions` (token i of position p is frame
    4p − 3 − window + i): `[(stop − start)·spf]`. ValueError when a frame is in no token."""
    t, a, spf = tokens.shape
    first = torch.tensor(positions)[:, None] * 4 - 3 - window  # [T, 1]
    frame = first + torch.arange(a)[None]  # [T, A] video frame of each token slot
    keep = (frame >= start) & (frame < stop)
    out = torch.zeros(stop - start, spf, dtype=tokens.dtype)
    seen = torch.zeros(stop - start, dtype=torch.bool)
    idx = frame[keep] - start
    out[idx] = tokens[keep]
    seen[idx] = True
    if not bool(seen.all()):
        raise ValueError(f"frames [{start}, {stop}) are not all in the tokens of positions {positions}")
    return out.reshape(-1)
