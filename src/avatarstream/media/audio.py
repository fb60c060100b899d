"""Read speech from any file PyAV can decode, as a stream of mono float32 pieces at one rate.

`AudioReader` checks the file when it is made (so a bad file fails before any model loads) and
then decodes, downmixes and resamples it piece by piece while it is iterated: memory does not
grow with the length of the file.

Damaged files
-------------
The check decodes every packet once (no resampling: a second of speech costs well under a
millisecond) and counts the bytes of the packets the decoder rejects, plus the rest of the file
when reading stops early. Bytes, not durations, because a damaged file's stated duration cannot
be trusted (a VBR MP3 without its Xing header states 3x its length; garbage holds no timestamps).
A file with some damage is read without it, with a warning saying how much was skipped (a
skipped packet shortens the audio, and the video with it); a file with more than
`MAX_DAMAGED_FRACTION` (5 %) damaged is refused: past a few clicks' worth, the video would
silently be a different length from the speech the user gave (an MP3 whose second half is
garbage used to give a half-length video and exit 0).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import torch

from avatarstream.errors import InputError

log = logging.getLogger(__name__)

PIECE_SECONDS = 0.2
MAX_DAMAGED_FRACTION = 0.05  # of an audio file's data that may be undecodable (module doc)


def _reason(e: BaseException) -> str:
    """The useful part of a PyAV error (no errno, no repeated file name)."""
    msg = getattr(e, "strerror", None) or str(e)
    return str(msg).rstrip(".")


class AudioReader:
    """Iterable of 1-D float32 torch tensors: mono, `sample_rate` Hz, ~0.2 s each, in file order.

    Decoded frames go through a PyAV AudioResampler (planar float at `sample_rate`); the channels
    are then averaged to mono.

    Construction validates the file: missing, empty, unreadable, without an audio stream, without
    a single decodable sample, (when the container knows its duration) longer than `max_seconds`,
    or with more than `max_damaged` of its data undecodable all raise InputError; less damage is
    logged as a warning and described by `damage`. `duration_s` is the container's duration (None
    if it does not say). Each iteration decodes the file afresh from the start.
    """

    def __init__(self, path: str | Path, *, sample_rate: int = 16000,
                 max_seconds: float | None = None,
                 max_damaged: float = MAX_DAMAGED_FRACTION) -> None:
        self.path = Path(path)
        self.sample_rate = int(sample_rate)
        self.max_seconds = max_seconds
        self.max_damaged = max_damaged
        self.damage: Damage | None = None
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
            damage = scan(c, stream, self.path.stat().st_size)
        if damage.samples == 0:
            if damage.error is not None:
                raise InputError(f"audio {self.path} could not be decoded ({_reason(damage.error)}); "
                                 "it is corrupt or not an audio file")
            raise InputError(f"the audio {self.path} is empty (no sound samples)")
        if damage.fraction > self.max_damaged:
            raise InputError(f"audio {self.path} is damaged: {damage.describe()}, over the "
                             f"{self.max_damaged:.0%} allowed; repair it, or re-encode what is readable "
                             f"(ffmpeg -i {self.path.name} readable.wav) and give that")
        if damage.damaged_bytes:
            log.warning("audio %s: %s; skipped (the video is that much shorter than the file)",
                        self.path, damage.describe())
            self.damage = damage
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
            for packet, frames, error in decoded_packets(c, c.streams.audio[0]):
                if packet is None:  # a truncated/damaged tail ends the audio
                    log.warning("audio %s: reading stopped early (%s)", self.path, _reason(error))
                    break
                if error is not None:  # one damaged packet: skip it
                    log.debug("audio %s: skipping an undecodable packet (%s)", self.path, error)
                    continue
                for frame in frames:
                    frame.pts = None  # the resampler counts samples itself; no gaps from timestamps
                    for out in resampler.resample(frame):
                        yield _mono(out)
            for out in resampler.resample(None):
                yield _mono(out)


@dataclass(frozen=True)
class Damage:
    """What one decoding pass found: bytes of packets decoded and rejected, bytes never read (the
    demuxer stopped early), samples decoded at `rate`, the decoded time where damage first
    occurred, and the first decoder error."""

    good_bytes: int
    bad_bytes: int
    unread_bytes: int
    samples: int
    rate: int
    first_s: float | None
    error: BaseException | None

    @property
    def damaged_bytes(self) -> int:
        return self.bad_bytes + self.unread_bytes

    @property
    def fraction(self) -> float:
        total = self.good_bytes + self.damaged_bytes
        return self.damaged_bytes / total if total else 0.0

    def describe(self) -> str:
        """"12.5 % of its data could not be decoded (about 0.9 s, the first at 3.2 s)"."""
        decoded_s = self.samples / self.rate if self.rate else 0.0
        about = self.damaged_bytes * decoded_s / self.good_bytes if self.good_bytes else 0.0
        where = "" if self.first_s is None else f", the first at {self.first_s:.1f} s"
        return f"{self.fraction:.1%} of its data could not be decoded (about {about:.1f} s{where})"


def decoded_packets(c: av.container.InputContainer, stream: av.audio.stream.AudioStream,
                    ) -> Iterator[tuple[av.Packet | None, list[av.AudioFrame], BaseException | None]]:
    """(packet, its frames, None) for each packet of `stream` (the demuxer's last, empty one
    flushes the decoder); (packet, [], error) for one the decoder rejects; (None, [], error) last
    when reading stops early (a truncated or damaged file)."""
    packets = c.demux(stream)
    while True:
        try:
            packet = next(packets)
        except StopIteration:
            return
        except (av.FFmpegError, OSError) as e:
            yield None, [], e
            return
        try:
            yield packet, packet.decode(), None
        except (av.FFmpegError, ValueError) as e:
            yield packet, [], e


def scan(c: av.container.InputContainer, stream: av.audio.stream.AudioStream, file_size: int) -> Damage:
    """Decode every packet of `stream` once, counting what decodes and what does not (`Damage`)."""
    good = bad = samples = 0
    end = 0  # the file offset after the last packet read
    first_s: float | None = None
    error: BaseException | None = None
    stopped = False
    for packet, frames, e in decoded_packets(c, stream):
        error = error or e
        if packet is None:  # reading stopped: the rest of the file is lost
            stopped = True
            break
        if packet.pos is not None and packet.pos >= 0:
            end = packet.pos + packet.size
        if e is not None:
            bad += packet.size
            first_s = samples / stream.rate if first_s is None else first_s
            continue
        good += packet.size
        samples += sum(f.samples for f in frames)
    unread = max(0, file_size - end) if stopped else 0
    if unread and first_s is None:
        first_s = samples / stream.rate
    return Damage(good, bad, unread, samples, int(stream.rate or 0), first_s, error)


def _mono(frame: av.AudioFrame) -> np.ndarray:
    """[n] float32: the mean of the channels of a planar float frame."""
    x = frame.to_ndarray()  # [channels, n]
    return (x[0] if x.shape[0] == 1 else x.mean(axis=0)).astype(np.float32, copy=False)


def read_all(path: str | Path, sample_rate: int = 16000) -> np.ndarray:
    """The whole file as one mono float32 array at `sample_rate` (for short files and tests)."""
    pieces = [x.numpy() for x in AudioReader(path, sample_rate=sample_rate)]
    return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
