"""The file sink: a fragmented MP4 (H.264 + AAC) that is playable at every moment, even after kill -9.

How the file stays playable
---------------------------
The MP4 muxer runs in fragmented mode (`frag_keyframe+empty_moov+delay_moov+default_base_moof`):
after the initial `ftyp`/`moov` boxes the file is a sequence of `moof`+`mdat` fragments, each
independently decodable. A fragment is cut at every video keyframe, and every published video
chunk starts with a forced keyframe (IDR), so the fragment holding chunk k reaches the file when
chunk k+1 (or `close`) arrives. libx264 runs with `tune=zerolatency` (no lookahead, no B-frames)
so each frame is encoded as soon as it is given.

The muxer does not write to the file directly: it writes into `FragmentFile`, which splits the
byte stream into top-level MP4 boxes and hands the OS only *whole* boxes, a `moof` together with
its `mdat`. So the file on disk is always a valid fragmented MP4 (no half fragment a player would
choke on), and `durable_frames` counts exactly the video samples of the fragments already passed
to the OS. Data the OS has accepted survives the death of the process (kill -9); with
`fsync=True` each fragment is also forced to the device (survives power loss, costs a sync per
fragment).

`delay_moov` lets the muxer write the `moov` after it has seen the first packets, so the AAC
encoder's priming samples are hidden by an edit list and the audio starts exactly at 0.

Audio and video timing
----------------------
Video pts are timeline frame indices (`start_frame + i`, time base 1/fps); audio pts are timeline
sample indices (time base 1/sample_rate). The audio written is the session's input audio; a gap
between audio chunks is filled with silence and an overlap is dropped, so audio time never drifts
from the timeline.
"""

from __future__ import annotations

import logging
import os
import struct
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

from avatarstream.errors import OutputError
from avatarstream.media.frames import AudioChunk, VideoChunk

log = logging.getLogger(__name__)

_AAC_FRAME = 1024  # samples per AAC frame (the encoder's frame_size)


def check_writable(path: str | Path) -> None:
    """Raise OutputError unless `path` can be created or overwritten as a file. Creates nothing."""
    p = Path(path)
    if p.is_dir():
        raise OutputError(f"the output {p} is a folder; give a file path such as {p / 'out.mp4'}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"cannot write the output {p}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write the output {p}: the folder {parent} is not writable")
    if p.exists() and not os.access(p, os.W_OK):
        raise OutputError(f"cannot write the output {p}: the file exists and is not writable")


class AVEncoder:
    """H.264 (libx264, yuv420p) + AAC encoders muxing into one PyAV output container.

    Shared by the file and HLS sinks. Video frames get pts from their timeline index and the first
    frame of every chunk is forced to be an IDR keyframe (a fragment/segment boundary); audio is
    re-framed to whole AAC frames with pts from the timeline sample index.
    """

    def __init__(self, container: av.container.OutputContainer, width: int, height: int, fps: int,
                 sample_rate: int, *, crf: int = 20, preset: str = "veryfast",
                 keyint: int | None = None) -> None:
        if width % 2 or height % 2:
            raise ValueError(f"H.264 yuv420p needs even frame sizes, got {width}x{height}")
        self.container = container
        self.fps = int(fps)
        self.sample_rate = int(sample_rate)
        self.video = container.add_stream("libx264", rate=self.fps)
        self.video.width, self.video.height = width, height
        self.video.pix_fmt = "yuv420p"
        self.video.time_base = Fraction(1, self.fps)
        self.video.codec_context.time_base = Fraction(1, self.fps)
        self.video.options = {"crf": str(crf), "preset": preset, "tune": "zerolatency",
                              "forced-idr": "1", "keyint": str(keyint or 2 * self.fps)}
        self.audio = container.add_stream("aac", rate=self.sample_rate)
        self.audio.layout = "mono"
        self.audio.time_base = Fraction(1, self.sample_rate)
        self._v_tb = Fraction(1, self.fps)
        self._a_tb = Fraction(1, self.sample_rate)
        self.next_frame = 0  # timeline index of the next video frame expected
        self.frames_encoded = 0
        self._pending = np.zeros(0, np.float32)  # audio not yet encoded; first = timeline sample _a_next
        self._a_next = 0

    # -- video -------------------------------------------------------------------------------
    def add_video(self, chunk: VideoChunk) -> None:
        """Encode and mux a chunk [N, H, W, 3] uint8; frames before `next_frame` are dropped."""
        if chunk.fps != self.fps:
            raise ValueError(f"video chunk at {chunk.fps} fps, the sink was opened at {self.fps}")
        skip = max(0, self.next_frame - chunk.start_frame)
        frames = chunk.frames[skip:]
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb), format="rgb24")
            frame.pts = chunk.start_frame + skip + i
            frame.time_base = self._v_tb
            if i == 0:
                frame.pict_type = av.video.frame.PictureType.I  # fragment boundary at chunk start
            self.container.mux(self.video.encode(frame))
        if len(frames):
            self.next_frame = chunk.start_frame + skip + len(frames)
            self.frames_encoded += len(frames)

    # -- audio -------------------------------------------------------------------------------
    def add_audio(self, chunk: AudioChunk) -> None:
        """Queue mono float32 samples at the timeline position `start_sample` and encode whole frames.

        A gap before the chunk is filled with silence, samples already written are dropped.
        """
        if chunk.sample_rate != self.sample_rate:
            raise ValueError(f"audio chunk at {chunk.sample_rate} Hz, the sink was opened at "
                             f"{self.sample_rate} Hz")
        expected = self._a_next + len(self._pending)
        x = np.asarray(chunk.samples, np.float32).reshape(-1)
        if chunk.start_sample > expected:
            x = np.concatenate([np.zeros(chunk.start_sample - expected, np.float32), x])
        elif chunk.start_sample < expected:
            x = x[expected - chunk.start_sample:]
        if not len(x):
            return
        self._pending = np.concatenate([self._pending, x])
        while len(self._pending) >= _AAC_FRAME:
            self._encode_audio(self._pending[:_AAC_FRAME])
            self._pending = self._pending[_AAC_FRAME:]

    def _encode_audio(self, samples: np.ndarray) -> None:
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples[None]), format="fltp",
                                           layout="mono")  # [1, n] planar
        frame.sample_rate = self.sample_rate
        frame.pts = self._a_next
        frame.time_base = self._a_tb
        self._a_next += len(samples)
        self.container.mux(self.audio.encode(frame))

    # -- end ---------------------------------------------------------------------------------
    def finish(self) -> None:
        """Encode the last partial audio frame and drain both encoders into the muxer."""
        if len(self._pending):
            self._encode_audio(self._pending)  # AAC accepts a short last frame
            self._pending = np.zeros(0, np.float32)
        self.container.mux(self.video.encode(None))
        self.container.mux(self.audio.encode(None))


class FragmentFile:
    """Write-only file object for the MP4 muxer that writes whole top-level boxes only.

    A `moof` is held back until its `mdat` is complete and both go to the OS in one write, so the
    file on disk always ends on a fragment boundary. `durable_samples` counts the samples of track
    `track_id` (the video track) in fragments already written. It has no `seek`, so the muxer
    treats the output as a stream and never rewrites earlier bytes.
    """

    def __init__(self, path: Path, *, track_id: int = 1, fsync: bool = False) -> None:
        self.path = path
        self.track_id = track_id
        self.fsync = fsync
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._buf = bytearray()  # bytes from the muxer not yet forming a whole box
        self._held = bytearray()  # a complete moof waiting for its mdat
        self._held_samples = 0
        self.durable_samples = 0
        self.bytes_written = 0

    def write(self, data: bytes) -> int:
        self._buf += data
        self._cut_boxes()
        return len(data)

    def flush(self) -> None:
        """Nothing is buffered in user space beyond the box being assembled."""

    def _cut_boxes(self) -> None:
        while len(self._buf) >= 8:
            size, kind = struct.unpack_from(">I4s", self._buf)
            if size == 1:
                if len(self._buf) < 16:
                    return
                size = struct.unpack_from(">Q", self._buf, 8)[0]
            elif size == 0:
                return  # "extends to end of file": only known at close
            if size < 8:
                raise OutputError(f"cannot write the output {self.path}: the MP4 muxer wrote an "
                                  f"invalid box size {size}")
            if len(self._buf) < size:
                return
            box = bytes(self._buf[:size])
            del self._buf[:size]
            if kind == b"moof":
                self._held += box
                self._held_samples += _moof_samples(box, self.track_id)
            elif self._held and kind != b"mdat":
                self._held += box  # boxes between moof and mdat travel with the fragment
            else:
                samples = self._held_samples
                self._write(bytes(self._held) + box)
                self._held.clear()
                self._held_samples = 0
                self.durable_samples += samples

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        if self.fsync:
            os.fsync(self._fd)
        self.bytes_written += len(data)

    def close(self) -> None:
        """Write whatever is left (complete or not) and close the file."""
        if self._fd is None:
            return
        try:
            rest = bytes(self._held) + bytes(self._buf)
            if rest:
                self._write(rest)
                self.durable_samples += self._held_samples
        finally:
            self._held.clear()
            self._buf.clear()
            os.close(self._fd)
            self._fd = None


def _moof_samples(moof: bytes, track_id: int) -> int:
    """Number of samples of `track_id` in a `moof` box (sum of its `trun` sample counts)."""
    total = 0
    for kind, start, end in _children(moof, 8, len(moof)):
        if kind != b"traf":
            continue
        tid = None
        count = 0
        for sub, s, _e in _children(moof, start + 8, end):
            if sub == b"tfhd":
                tid = struct.unpack_from(">I", moof, s + 12)[0]  # after size, type, version+flags
            elif sub == b"trun":
                count += struct.unpack_from(">I", moof, s + 12)[0]
        if tid == track_id:
            total += count
    return total


def _children(data: bytes, start: int, end: int):  # type: ignore[no-untyped-def]
    """Yield (type, start, end) of the boxes laid out in data[start:end]."""
    pos = start
    while pos + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, pos)
        if size == 1:
            size = struct.unpack_from(">Q", data, pos + 8)[0]
        elif size == 0:
            size = end - pos
        if size < 8 or pos + size > end:
            return
        yield kind, pos, pos + size
        pos += size


class FragmentedMP4Sink:
    """Publish to a fragmented MP4 file at its final path, playable while it is being written.

    `durable_frames` is the number of video frames a reader of the file can already decode; they
    stay in the file if the process is killed. `write_*` run on the publisher thread; `open`,
    `close` and `abort` on the caller's thread (never concurrently with writes).
    """

    MOVFLAGS = "frag_keyframe+empty_moov+delay_moov+default_base_moof"

    def __init__(self, path: str | Path, *, crf: int = 20, preset: str = "veryfast",
                 fsync: bool = False) -> None:
        self.path = Path(path)
        self.crf = crf
        self.preset = preset
        self.fsync = fsync
        self.durable_frames = 0
        self._file: FragmentFile | None = None
        self._container: av.container.OutputContainer | None = None
        self._enc: AVEncoder | None = None

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        """Create (or truncate) the file and set up the encoders."""
        try:
            self._file = FragmentFile(self.path, fsync=self.fsync)
        except OSError as e:
            raise OutputError(f"cannot write the output {self.path}: {e.strerror or e}") from e
        self._container = av.open(self._file, "w", format="mp4",
                                  container_options={"movflags": self.MOVFLAGS})
        self._enc = AVEncoder(self._container, width, height, fps, sample_rate, crf=self.crf,
                              preset=self.preset)

    def _encoder(self) -> AVEncoder:
        if self._enc is None:
            raise RuntimeError("FragmentedMP4Sink.open() must be called before writing")
        return self._enc

    def write_video(self, chunk: VideoChunk) -> None:
        """Encode a chunk (its first frame an IDR: the previous chunk's fragment goes to disk)."""
        try:
            self._encoder().add_video(chunk)
        except (OSError, av.FFmpegError) as e:
            raise OutputError(f"cannot write the output {self.path}: {e}") from e
        self._update_durable()

    def write_audio(self, chunk: AudioChunk) -> None:
        """Encode the session's input audio at its timeline position."""
        try:
            self._encoder().add_audio(chunk)
        except (OSError, av.FFmpegError) as e:
            raise OutputError(f"cannot write the output {self.path}: {e}") from e
        self._update_durable()

    def _update_durable(self) -> None:
        if self._file is not None:
            self.durable_frames = self._file.durable_samples

    def close(self) -> None:
        """Drain the encoders, write the last fragment and the index, close the file."""
        if self._container is None:
            return
        try:
            try:
                if self._enc is not None:
                    self._enc.finish()
            finally:
                self._container.close()
                assert self._file is not None
                self._file.close()
        except (OSError, av.FFmpegError) as e:
            raise OutputError(f"cannot finish the output {self.path}: {e}") from e
        finally:
            self._update_durable()
            self._container = self._enc = self._file = None

    def abort(self) -> None:
        """Stop without finishing and delete the file (the run produced nothing worth keeping)."""
        container, file = self._container, self._file
        self._container = self._enc = self._file = None
        if file is None:
            return
        try:
            if container is not None:
                container.close()
        except (OSError, av.FFmpegError) as e:  # best effort: the file is removed below anyway
            log.debug("closing the muxer of %s on abort: %s", self.path, e)
        try:
            file.close()
        except OSError as e:
            log.debug("closing %s on abort: %s", self.path, e)
        self.path.unlink(missing_ok=True)
        self.durable_frames = 0
