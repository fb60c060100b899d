"""Probe and normalise one input video, and find its shot cuts.

`normalise_video` decodes a user's file once with PyAV: every frame is resampled in time to 25 fps
(output frame k shows the source frame whose timestamp is nearest to k / 25, as ffmpeg's `fps`
filter does), shrunk (swscale, area) so that its longer side is at most `max_side`, and turned
upright by its display rotation (a phone video stores its pictures sideways with a display matrix:
read as stored, its faces would lie on their side, unseen by dlib; `media.reference.upright`). The
rotation is known once a frame is decoded, so the output size comes from the first frame (the
upright picture's, width and height swapped for a quarter turn) and the work file is opened then.
The audio is downmixed and resampled to 16 kHz mono (`media.audio.read_all`) and cut or padded to
640 samples a frame. While the frames go by, PySceneDetect's `ContentDetector` is fed each one
(the API on frames we hand it, so the file is decoded once): its cut frames split the video into
shots.

The normalised frames are written to a lossless work file (libx264rgb at qp 0, a key frame every
25 frames so that a shot can be read back by seeking), the audio to a 16-bit WAV beside it. Later
stages read shots from those files (a window's audio is read alone, by seeking in the WAV), so no
stage holds a whole video in memory.

Bounds (`Bounds`): timestamps, not bytes, decide how many 25 fps frames an input becomes, so a
1.5 KB file declaring one frame at 1/10000 fps, or a 37-minute jump between two timestamps, would
turn into hundreds of thousands of copies of one frame (gigabytes of memory and work file). No
source frame is shown longer than `max_gap_s` (a longer timestamp gap, or a last frame that would
last longer, cuts the input there: what follows a gap of minutes is not the same shot), and no
input gives more than `max_seconds` of video (the rest is not read). Each cut is recorded
(`NormalisedVideo.trimmed`: reason `frame_gap` or `too_long`, the frame it happened at, a detail)
and goes into the manifest.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from fractions import Fraction
from itertools import chain
from pathlib import Path

import av
import numpy as np

from avatarstream.data.clip import FPS, SAMPLE_RATE, SPF
from avatarstream.data.shards import write_pcm
from avatarstream.errors import InputError
from avatarstream.media.audio import AudioReader
from avatarstream.media.reference import quarter_turns, upright

GOP = 25  # key-frame interval of the work file (frames): a seek lands at most a second early


@dataclass(frozen=True)
class Bounds:
    """What one input may become (module doc): seconds of 25 fps video, and the longest a source
    frame may be shown (a longer timestamp gap cuts the input)."""

    max_seconds: float = 3600.0
    max_gap_s: float = 2.0

    @property
    def max_frames(self) -> int:
        return max(1, int(self.max_seconds * FPS))


@dataclass(frozen=True)
class NormalisedVideo:
    """A normalised input: work files, frame count and size, and shots as [start, end) frame ranges."""

    video: str
    source: str
    video_path: str
    audio_path: str
    frames: int
    width: int
    height: int
    has_audio: bool
    shots: list[tuple[int, int]]
    trimmed: list[dict] = field(default_factory=list)  # why the input was cut short (module doc)


def output_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    """(width, height) with the longer side at most `max_side`, both even, aspect kept."""
    k = min(1.0, max_side / max(width, height))
    return max(2, int(round(width * k / 2)) * 2), max(2, int(round(height * k / 2)) * 2)


def upright_size(frame: av.VideoFrame, max_side: int) -> tuple[int, int]:
    """`output_size` of the frame as a viewer sees it (width and height swapped for a quarter turn)."""
    w, h = (frame.width, frame.height) if quarter_turns(frame) % 2 == 0 else (frame.height, frame.width)
    return output_size(w, h, max_side)


def frames_at_25(container: av.container.InputContainer, max_side: int, bounds: Bounds | None = None,
                 trimmed: list[dict] | None = None) -> Iterator[np.ndarray]:
    """Upright RGB frames [H, W, 3] uint8 at 25 fps, all of the first frame's `upright_size`: slot k
    gets the source frame nearest to k / 25 s (the earlier one on a tie); the last source frame
    lasts one source frame interval. Within `bounds` (module doc): a cut is appended to `trimmed`."""
    bounds = bounds or Bounds()
    trimmed = trimmed if trimmed is not None else []
    stream = container.streams.video[0]
    rate = float(stream.average_rate or stream.guessed_rate or FPS)
    size: tuple[int, int] | None = None
    t0: float | None = None
    prev: np.ndarray | None = None
    prev_t = 0.0
    interval = 1.0 / FPS  # the last interval between two source frames
    k = 0

    def cut(reason: str, detail: str) -> None:
        trimmed.append({"reason": reason, "at_frame": k, "detail": detail})

    for frame in container.decode(stream):
        if frame.time is None:
            continue
        t0 = frame.time if t0 is None else t0
        t = frame.time - t0
        if prev is not None and t - prev_t > bounds.max_gap_s:
            cut("frame_gap", f"{t - prev_t:.3f} s between two frames at {prev_t:.3f} s (over {bounds.max_gap_s:g} s): "
                "the input ends before the gap")
            rate = 1.0 / interval  # the last frame before the gap lasts as long as the one before it
            break
        size = size or upright_size(frame, max_side)
        cur = upright(frame, size, interpolation="AREA")
        while k / FPS <= t:
            if k >= bounds.max_frames:
                cut("too_long", f"longer than {bounds.max_seconds:g} s: the rest is not read")
                return
            slot = k / FPS
            yield cur if prev is None or t - slot < slot - prev_t else prev
            k += 1
        if prev is not None and t > prev_t:
            interval = t - prev_t
        prev, prev_t = cur, t
    if prev is not None:
        last = 1.0 / rate if rate > 0 else 1.0 / FPS  # one source frame interval
        if last > bounds.max_gap_s:
            cut("frame_gap", f"the last frame would last {last:.3f} s (frame rate {stream.average_rate or rate}; "
                f"over {bounds.max_gap_s:g} s): it is shown for {bounds.max_gap_s:g} s")
            last = bounds.max_gap_s
        while k / FPS < prev_t + last - 1e-9:
            if k >= bounds.max_frames:
                cut("too_long", f"longer than {bounds.max_seconds:g} s: the rest is not read")
                return
            yield prev
            k += 1


class CutFinder:
    """PySceneDetect's ContentDetector fed frame by frame; `cuts` are the first frames of new shots."""

    def __init__(self, threshold: float, min_shot_frames: int) -> None:
        from scenedetect import ContentDetector, FrameTimecode

        self._timecode = FrameTimecode
        self._detector = ContentDetector(threshold=threshold, min_scene_len=min_shot_frames)
        self.cuts: list[int] = []
        self._n = 0

    def add(self, rgb: np.ndarray) -> None:
        bgr = np.ascontiguousarray(rgb[..., ::-1])  # OpenCV order
        found = self._detector.process_frame(self._timecode(self._n, fps=Fraction(FPS)), bgr)
        self.cuts += [int(c.frame_num) for c in found]
        self._n += 1

    def shots(self) -> list[tuple[int, int]]:
        """[start, end) ranges covering every frame added."""
        if self._n:
            self.cuts += [int(c.frame_num) for c in self._detector.post_process(self._timecode(self._n - 1, fps=Fraction(FPS)))]
        edges = [0] + sorted({c for c in self.cuts if 0 < c < self._n}) + [self._n]
        return [(a, b) for a, b in zip(edges[:-1], edges[1:]) if b > a]


def _reason(e: BaseException) -> str:
    return str(getattr(e, "strerror", None) or e).rstrip(".")


def _first(frames: Iterator[np.ndarray], source: str) -> np.ndarray:
    """The first frame (its size is the work file's); InputError if there is none."""
    try:
        first = next(frames, None)
    except av.error.FFmpegError as e:
        raise InputError(f"{source}: damaged video ({_reason(e)})") from e
    if first is None:
        raise InputError(f"{source}: no decodable video frame")
    return first


def normalise_video(source: str, video: str, work: Path, max_side: int, cut_threshold: float,
                    min_shot_frames: int, bounds: Bounds | None = None) -> NormalisedVideo:
    """Decode `source` once: write `work/VIDEO.mkv` (25 fps, upright, longer side <= max_side,
    lossless) and `work/VIDEO.wav` (16 kHz mono), and find the shot cuts, within `bounds`
    (module doc). InputError if it holds no video."""
    trimmed: list[dict] = []
    try:
        container = av.open(source)
    except (OSError, av.error.FFmpegError) as e:
        raise InputError(f"{source}: not a readable video ({_reason(e)})") from e
    with container:
        if not container.streams.video:
            raise InputError(f"{source}: no video stream")
        frames = frames_at_25(container, max_side, bounds, trimmed)
        first = _first(frames, source)
        size = first.shape[1], first.shape[0]
        finder = CutFinder(cut_threshold, min_shot_frames)
        vpath = work / f"{video}.mkv"
        with av.open(str(vpath), "w", format="matroska") as out:
            o = out.add_stream("libx264rgb", rate=FPS)
            o.width, o.height = size
            o.pix_fmt = "rgb24"
            o.options = {"qp": "0", "preset": "ultrafast", "g": str(GOP)}
            o.thread_count = 1
            n = 0
            try:
                for f in chain([first], frames):
                    finder.add(f)
                    for p in o.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                        out.mux(p)
                    n += 1
            except av.error.FFmpegError as e:
                raise InputError(f"{source}: damaged video ({_reason(e)})") from e
            for p in o.encode():
                out.mux(p)
    audio, has_audio = _audio(source, n * SPF)
    apath = work / f"{video}.wav"
    write_pcm(apath, audio)
    return NormalisedVideo(video, source, str(vpath), str(apath), n, size[0], size[1], has_audio, finder.shots(),
                           trimmed)


def _audio(source: str, samples: int) -> tuple[np.ndarray, bool]:
    """The first `samples` of the input's audio at 16 kHz mono (zeros after its end; all zeros
    and False without audio). Decoding stops there: the rest of a long file is never held."""
    out = np.zeros(samples, np.float32)
    try:
        reader = AudioReader(source, sample_rate=SAMPLE_RATE)
    except InputError:
        return out, False
    got = 0
    try:
        for piece in reader:
            x = piece.numpy()[: samples - got]
            out[got:got + x.size] = x
            got += x.size
            if got >= samples:
                break
    except InputError:
        return np.zeros(samples, np.float32), False
    return out, True


def read_frames(path: str, start: int, end: int) -> np.ndarray:
    """Frames [start, end) of a work file: [end - start, H, W, 3] uint8 (seeks to the key frame before)."""
    out: list[np.ndarray] = []
    with av.open(path) as c:
        s = c.streams.video[0]
        c.seek(int(round(start / FPS / s.time_base)), stream=s, backward=True)
        for f in c.decode(s):
            i = int(round(f.time * FPS))
            if i >= end:
                break
            if i >= start:
                out.append(f.to_ndarray(format="rgb24"))
    if len(out) != end - start:
        raise InputError(f"{path}: expected {end - start} frames from {start}, read {len(out)}")
    return np.stack(out)


def read_audio(path: str, start: int, end: int) -> np.ndarray:
    """Samples of frames [start, end) of a work WAV: [(end - start) * 640] float32 (only those are
    read: the WAV is 16-bit PCM mono, `write_pcm`'s)."""
    import wave

    try:
        with wave.open(path, "rb") as w:
            w.setpos(min(start * SPF, w.getnframes()))
            raw = w.readframes((end - start) * SPF)
    except (OSError, EOFError, wave.Error) as e:
        raise InputError(f"{path}: unreadable work audio ({e})") from e
    return np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
