"""Encoding for the file and HLS sinks: H.264 + AAC into one PyAV container, and the write path
both sinks share.

`AVEncoder` turns timeline-stamped chunks into packets for whichever muxer it is given (the
fragmented MP4 of `publish/file.py`, the HLS segmenter of `publish/hls.py`). `EncodingSink` is
what the two sinks do alike around it: refuse writes before `open`, turn an I/O or FFmpeg failure
into an `OutputError` that names the output, refresh `durable_frames` after every write (muxing
either stream can complete a fragment or segment), and on `close` drain the encoders before the
muxer writes its last fragment. Where the bytes go and how `durable_frames` is counted stay with
each sink.
"""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np

from avatarstream.errors import OutputError
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.publish.interrupt import muxing
from avatarstream.publish.output import os_reason

_AAC_FRAME = 1024  # samples per AAC frame (the encoder's frame_size)


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


class EncodingSink:
    """Base of the sinks that publish through one `AVEncoder` (see the module doc).

    A subclass sets `_container` and `_enc` in its `open`, names its output in `_output` (for
    error messages: "the output out.mp4"), and counts `durable_frames` in `_update_durable`.
    `_close_output` and `_forget` extend closing where the sink holds more than the container.
    """

    durable_frames: int
    _container: av.container.OutputContainer | None
    _enc: AVEncoder | None

    @property
    def _output(self) -> str:
        raise NotImplementedError

    def _update_durable(self) -> None:
        raise NotImplementedError

    def _encoder(self) -> AVEncoder:
        if self._enc is None:
            raise RuntimeError(f"{type(self).__name__}.open() must be called before writing")
        return self._enc

    def _write_error(self) -> BaseException | None:
        """The OS error behind a failed write, where the sink saw it itself (the muxer reports
        it only as a failed callback); None: the muxer's own error says it."""
        return None

    def _failed(self, verb: str, e: BaseException) -> OutputError:
        cause = self._write_error() or e
        return OutputError(f"cannot {verb} {self._output}: {os_reason(cause)}")

    def write_video(self, chunk: VideoChunk) -> None:
        """Encode a chunk. Its first frame is an IDR keyframe: the file sink's previous fragment
        goes to disk there, the HLS sink cuts a segment there once `segment_seconds` passed."""
        try:
            with muxing():
                self._encoder().add_video(chunk)
        except (OSError, av.FFmpegError) as e:
            raise self._failed("write", e) from e
        self._update_durable()

    def write_audio(self, chunk: AudioChunk) -> None:
        """Encode the session's input audio at its timeline position."""
        try:
            with muxing():
                self._encoder().add_audio(chunk)
        except (OSError, av.FFmpegError) as e:
            raise self._failed("write", e) from e
        self._update_durable()

    def close(self) -> None:
        """Drain the encoders, let the muxer write what is left and its index, close the output.
        An OutputError when any write failed (then the output is not complete)."""
        if self._container is None:
            return
        try:
            with muxing():
                try:
                    if self._enc is not None:
                        self._enc.finish()
                finally:
                    self._close_output()
            failed = self._write_error()
            if failed is not None:  # the muxer's later writes were dropped: the output is cut
                raise OutputError(f"cannot write {self._output}: {os_reason(failed) or 'interrupted'}")
        except (OSError, av.FFmpegError) as e:
            raise self._failed("finish", e) from e
        finally:
            self._update_durable()
            self._forget()

    def _close_output(self) -> None:
        assert self._container is not None
        self._container.close()

    def _forget(self) -> None:
        self._container = self._enc = None
