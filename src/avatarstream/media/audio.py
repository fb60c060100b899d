"""Read speech from any file PyAV can decode, as a stream of mono float32 pieces at one rate.

`AudioReader` checks the file when it is made (so a bad file fails before any model loads) and
then decodes, downmixes and resamples it piece by piece while it is iterated: memory does not
grow with the length of the file.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import torch

from avatarstream.errors import InputError

log = logging.getLogger(__name__)

PIECE_SECONDS = 0.2


def _reason(e: BaseException) -> str:
    """The useful part of a PyAV error (no errno, no repeated file name)."""
    msg = getattr(e, "strerror", None) or str(e)
    return str(msg).rstrip(".")


class AudioReader:
    """Iterable of 1-D float32 torch tensors: mono, `sample_rate` Hz, ~0.2 s each, in file order.

    Decoded frames go through a PyAV AudioResampler (planar float at `sample_rate`); the channels
    are then averaged to mono.

    Construction validates the file: missing, empty, unreadable, without an audio stream, without
    a single decodable sample, or (when the container knows its duration) longer than
    `max_seconds` all raise InputError. `duration_s` is the container's duration (None if it does
    not say). Each iteration decodes the file afresh from the start.
    """

    def __init__(self, path: str | Path, *, sample_rate: int = 16000,
                 max_seconds: float | None = None) -> None:
        self.path = Path(path)
        self.sample_rate = int(sample_rate)
        self.max_seconds = max_seconds
        self.piece = max(1, round(PIECE_SECONDS * self.sample_rate))
        p = self.path
        if not p.exists():
            raise InputError(f"audio {p} not found; give a speech file (wav/mp3/flac/ogg/m4a)")
        if p.is_dir():
            raise InputError(f"audio {p} is a folder; give a speech file (wav/mp3/flac/ogg/m4a)")
        if p.stat().st_size == 0:
            raise InputError(f"audio {p} is empty (0 bytes)")
        self.duration_s = self._probe()

    def _open(self) -> av.container.InputContainer:
        try:
            return av.open(str(self.path))
        except (av.FFmpegError, OSError, ValueError) as e:
            raise InputError(f"audio {self.path} is not a readable audio file ({_reason(e)})") from e

    def _probe(self) -> float | None:
        """Duration from the container; checks that at least one sample decodes."""
        with self._open() as c:
            if not c.streams.audio:
                raise InputError(f"audio {self.path} has no audio stream")
            stream = c.streams.audio[0]
            duration = None
            if stream.duration is not None and stream.time_base is not None:
                duration = float(stream.duration * stream.time_base)
            elif c.duration is not None:
                duration = c.duration / av.time_base
            if duration is not None and duration < 0:
                duration = None
            if (self.max_seconds is not None and duration is not None
                    and duration > self.max_seconds + 1e-3):
                raise InputError(f"audio {self.path} is {duration:.1f} s long, over "
                                 f"--max-audio-seconds {self.max_seconds:g}; cut the audio or "
                                 "raise --max-audio-seconds")
            try:
                has_sound = any(frame.samples > 0 for frame in c.decode(stream))
            except (av.FFmpegError, OSError, ValueError) as e:
                raise InputError(f"audio {self.path} could not be decoded ({_reason(e)}); it is "
                                 "corrupt or not an audio file") from e
            if not has_sound:
                raise InputError(f"the audio {self.path} is empty (no sound samples)")
        return duration

    def __iter__(self) -> Iterator[torch.Tensor]:
        pending: list[np.ndarray] = []
        held = 0
        for x in self._resampled():
            pending.append(x)
            held += len(x)
            if held >= self.piece:
                buf = np.concatenate(pending)
                n = len(buf) - len(buf) % self.piece
                for i in range(0, n, self.piece):
                    yield torch.from_numpy(buf[i:i + self.piece].copy())
                pending = [buf[n:]]
                held = len(buf) - n
        if held:
            yield torch.from_numpy(np.concatenate(pending))

    def _resampled(self) -> Iterator[np.ndarray]:
        """Decoded audio as mono float32 at `sample_rate`, in the pieces the decoder gives."""
        # Keep the channels through the resampler and average them after: libswresample's
        # stereo->mono matrix adds each channel at -3 dB, which makes identical channels louder
        # than the source (and can exceed 1.0); the mean keeps the speech's level.
        resampler = av.AudioResampler(format="fltp", layout=None, rate=self.sample_rate)
        with self._open() as c:
            stream = c.streams.audio[0]
            packets = c.demux(stream)
            while True:
                try:
                    packet = next(packets)
                except StopIteration:
                    break
                except (av.FFmpegError, OSError) as e:  # a truncated/damaged tail ends the audio
                    log.warning("audio %s: reading stopped early (%s)", self.path, _reason(e))
                    break
                try:
                    frames = packet.decode()
                except (av.FFmpegError, ValueError) as e:  # one damaged packet: skip it
                    log.debug("audio %s: skipping an undecodable packet (%s)", self.path, e)
                    continue
                for frame in frames:
                    frame.pts = None  # the resampler counts samples itself; no gaps from timestamps
                    for out in resampler.resample(frame):
                        yield _mono(out)
            for out in resampler.resample(None):
                yield _mono(out)


def _mono(frame: av.AudioFrame) -> np.ndarray:
    """[n] float32: the mean of the channels of a planar float frame."""
    x = frame.to_ndarray()  # [channels, n]
    return (x[0] if x.shape[0] == 1 else x.mean(axis=0)).astype(np.float32, copy=False)


def read_all(path: str | Path, sample_rate: int = 16000) -> np.ndarray:
    """The whole file as one mono float32 array at `sample_rate` (for short files and tests)."""
    pieces = [x.numpy() for x in AudioReader(path, sample_rate=sample_rate)]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
