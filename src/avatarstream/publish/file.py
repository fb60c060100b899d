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
from pathlib import Path

import av

from avatarstream.errors import OutputError
from avatarstream.publish.encoder import AVEncoder, EncodingSink

log = logging.getLogger(__name__)


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


class FragmentedMP4Sink(EncodingSink):
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
            raise OutputError(f"cannot write {self._output}: {e.strerror or e}") from e
        self._container = av.open(self._file, "w", format="mp4",
                                  container_options={"movflags": self.MOVFLAGS})
        self._enc = AVEncoder(self._container, width, height, fps, sample_rate, crf=self.crf,
                              preset=self.preset)

    @property
    def _output(self) -> str:
        return f"the output {self.path}"

    def _update_durable(self) -> None:
        if self._file is not None:
            self.durable_frames = self._file.durable_samples

    def _close_output(self) -> None:
        """The muxer writes the last fragment and the index; then the file is closed."""
        super()._close_output()
        assert self._file is not None
        self._file.close()

    def _forget(self) -> None:
        super()._forget()
        self._file = None

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
