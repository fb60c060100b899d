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

Where the file is written
-------------------------
In place (`atomic=False`, for a path nobody else has: a server render's own file), or, with
`atomic=True` (what `generate --out` uses), beside the final path (`publish/output.py`): the new
file grows at `talk.partial-<pid>.mp4`, playable all along, and is renamed over `talk.mp4` only by
`close`. `abort` deletes the partial and `keep` (a failed run that wrote frames) leaves it under its
name; the old `talk.mp4` is untouched by both. A second writer of the same path is refused.

Content credentials
-------------------
Given `credentials` (provenance/credentials.py), `close` signs the complete file before it takes
its final name: a signed copy is written beside it and renamed over it (the partial in atomic
mode, then renamed over `path` as before; the file itself in place). A signing failure leaves the
complete unsigned file, and `signed` says what happened. What `keep` keeps of a failed or
interrupted run is AI-made too: it is signed the same way when it was finished whole (not after a
write error such as a full disk, where a signed copy could not be written anyway).

Write errors
------------
A failed write (disk full, a file-size limit, SIGINT in the middle of a write) cuts the file back
to the end of its last whole fragment and drops every later write, so the file still decodes to
`durable_frames` frames; the error is reported with the path and the OS's words ("no space left on
device"), not as the muxer's callback failure.

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
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import av

from avatarstream.errors import OutputError
from avatarstream.publish import interrupt
from avatarstream.publish.encoder import AVEncoder, EncodingSink
from avatarstream.publish.output import AtomicOutput, Kept, os_reason

if TYPE_CHECKING:
    from avatarstream.provenance.credentials import ContentCredentials, Signed

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

    def __init__(self, path: Path, *, track_id: int = 1, fsync: bool = False,
                 exclusive: bool = False) -> None:
        self.path = path
        self.track_id = track_id
        self.fsync = fsync
        mode = os.O_EXCL if exclusive else os.O_TRUNC  # exclusive: a new file, never an existing one
        self._fd: int | None = os.open(path, os.O_WRONLY | os.O_CREAT | mode, 0o644)
        self._buf = bytearray()  # bytes from the muxer not yet forming a whole box
        self._held = bytearray()  # a complete moof waiting for its mdat
        self._held_samples = 0
        self.durable_samples = 0
        self.bytes_written = 0
        self.error: BaseException | None = None  # the first failed write; later writes are dropped

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
                if self.error is None:
                    self.durable_samples += samples

    def _write(self, data: bytes) -> None:
        """Write whole boxes; on failure cut the file back to where they began (the end of the
        last whole fragment), remember the error and drop every later write."""
        assert self._fd is not None
        if self.error is not None:
            return
        view = memoryview(data)
        try:
            while view:
                n = self._os_write(self._fd, view)
                view = view[n:]
            if self.fsync:
                os.fsync(self._fd)
        except BaseException as e:  # also KeyboardInterrupt: never leave half a fragment
            self.error = e
            try:
                os.ftruncate(self._fd, self.bytes_written)
                os.lseek(self._fd, self.bytes_written, os.SEEK_SET)
            except OSError as t:
                log.debug("cutting %s back to its last fragment: %s", self.path, t)
            raise
        self.bytes_written += len(data)

    @staticmethod
    def _os_write(fd: int, data: memoryview) -> int:
        """One `os.write` (a seam for tests that simulate a full disk)."""
        return os.write(fd, data)

    def close(self) -> None:
        """Write whatever is left (complete or not) and close the file."""
        if self._fd is None:
            return
        try:
            rest = bytes(self._held) + bytes(self._buf)
            if rest and self.error is None:
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
    """Publish to a fragmented MP4 file, playable while it is being written.

    `atomic=False` writes at `path` itself; `atomic=True` writes beside it and renames over it on
    `close` (module doc), taking a lock on `path` in `reserve` (or `open`). `writing` is the file
    the bytes go to. `durable_frames` is the number of video frames a reader of that file can
    already decode; they stay in it if the process is killed. `write_*` run on the publisher
    thread; `reserve`, `open`, `close`, `keep` and `abort` on the caller's thread (never
    concurrently with writes).
    """

    MOVFLAGS = "frag_keyframe+empty_moov+delay_moov+default_base_moof"

    def __init__(self, path: str | Path, *, crf: int = 20, preset: str = "veryfast",
                 fsync: bool = False, atomic: bool = False,
                 credentials: ContentCredentials | None = None) -> None:
        self.path = Path(path)
        self.credentials = credentials  # sign the finished file (module doc); None: unsigned
        self.signed: Signed | None = None
        self.crf = crf
        self.preset = preset
        self.fsync = fsync
        self.durable_frames = 0
        self.writing = self.path
        self._finished = False  # the muxer finished the file (it may still be unsigned)
        self._target = AtomicOutput(self.path) if atomic else None
        self._file: FragmentFile | None = None
        self._container: av.container.OutputContainer | None = None
        self._enc: AVEncoder | None = None

    def reserve(self) -> None:
        """Take the lock on `path` now (atomic mode; a no-op otherwise): a second writer of the
        same path is refused with an OutputError before any work is done."""
        if self._target is not None:
            self._target.reserve()

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        """Create the file (the partial one in atomic mode; else truncate `path`) and set up the
        encoders."""
        if self._target is not None:
            self.writing = self._target.begin()
        try:
            self._file = FragmentFile(self.writing, fsync=self.fsync,
                                      exclusive=self._target is not None)
        except OSError as e:
            if self._target is not None:
                self._target.discard()
            raise OutputError(f"cannot write {self._output}: {os_reason(e)}") from e
        self._container = av.open(self._file, "w", format="mp4",
                                  container_options={"movflags": self.MOVFLAGS})
        self._enc = AVEncoder(self._container, width, height, fps, sample_rate, crf=self.crf,
                              preset=self.preset)

    @property
    def _output(self) -> str:
        if self.writing != self.path:
            return f"{self.writing} (the new {self.path})"
        return f"the output {self.path}"

    def _write_error(self) -> BaseException | None:
        return None if self._file is None else self._file.error

    def _update_durable(self) -> None:
        if self._file is not None:
            self.durable_frames = self._file.durable_samples

    def _close_output(self) -> None:
        """The muxer writes the last fragment and the index; then the file is closed."""
        try:
            super()._close_output()
        finally:
            assert self._file is not None
            self._file.close()

    def _forget(self) -> None:
        super()._forget()
        self._file = None

    def close(self) -> None:
        """Finish the file, sign it when the sink has credentials; in atomic mode rename it over
        `path`. On an OutputError the partial file and the lock stay: follow with `keep` or
        `abort`. Signing and the rename finish whatever signal comes (publish/interrupt.py): the
        run then ends with `path` complete and signed, and says so."""
        finished = self._container is not None
        if finished:
            super().close()
            self._finished = True
        with interrupt.held() as signals:
            try:
                if finished and self.credentials is not None:
                    self.signed = self.credentials.sign_in_place(self.writing, self.path.name)
                if self._target is None:
                    return
                if self._target.partial is None:
                    self._target.discard()  # reserved, never opened: drop the lock
                    return
                self._target.commit()
                self.writing = self.path
            finally:
                if signals:
                    _finished_anyway(signals, self.writing, self.signed)

    def keep(self) -> Kept | None:
        """The run failed: finish what was written (a full disk cannot take more: the file then
        ends at its last whole fragment) and, in atomic mode, leave it under its partial name when
        it has frames (returned), else delete it. In place: kept at `path` when it has frames."""
        wrote = self._file is not None
        whole = self._finished  # finished without a write error: a file that can be signed
        if self._container is not None:
            try:
                super().close()
                whole = True
            except OutputError as e:
                log.debug("finishing the kept %s: %s", self.writing, e)
        unsigned = self.signed is None or not self.signed.signed
        if whole and unsigned and self.credentials is not None and self.durable_frames > 0:
            with interrupt.held():  # already stopping: a second Ctrl-C waits for the signing
                self.signed = self.credentials.sign_in_place(self.writing, self.path.name)
        if self._target is None:
            if wrote and self.durable_frames <= 0:
                self.path.unlink(missing_ok=True)
            return None
        return _with_signing(self._target.keep(self.durable_frames), self.credentials, self.signed)

    def abort(self) -> None:
        """Stop without finishing and delete what this run wrote (in atomic mode the partial file;
        the file at `path` is then untouched)."""
        container, file = self._container, self._file
        self._container = self._enc = self._file = None
        if file is not None:
            try:
                if container is not None:
                    container.close()
            except (OSError, av.FFmpegError) as e:  # best effort: the file is removed below anyway
                log.debug("closing the muxer of %s on abort: %s", self.writing, e)
            try:
                file.close()
            except OSError as e:
                log.debug("closing %s on abort: %s", self.writing, e)
        if self._target is not None:
            self._target.discard()
        elif file is not None:
            self.path.unlink(missing_ok=True)
        self.durable_frames = 0


class ReservedOutput:
    """An atomic output whose bytes another process writes in place at `writing` (the decode rank
    of `generate --workers`): this side holds the lock and ends it as `end_sinks` ends a sink —
    `close` signs it (given `credentials`) and renames it over `path`, `keep` keeps it when it
    holds frames, `abort` deletes it."""

    def __init__(self, path: str | Path, credentials: ContentCredentials | None = None) -> None:
        self.path = Path(path)
        self._target = AtomicOutput(self.path)
        self.writing = self._target.begin()  # takes the lock: a second writer is refused here
        self.durable_frames = 0
        self.credentials = credentials
        self.signed: Signed | None = None

    def close(self) -> None:
        with interrupt.held() as signals:
            try:
                if self.credentials is not None:
                    self.signed = self.credentials.sign_in_place(self.writing, self.path.name)
                self._target.commit()
            finally:
                if signals:
                    _finished_anyway(signals, self.path, self.signed)

    def keep(self) -> Kept | None:
        self.durable_frames = decodable_frames(self.writing)
        if self.credentials is not None and self.durable_frames > 0:
            with interrupt.held():
                self.signed = self.credentials.sign_in_place(self.writing, self.path.name)
        return _with_signing(self._target.keep(self.durable_frames), self.credentials, self.signed)

    def abort(self) -> None:
        self._target.discard()


def decodable_frames(path: Path) -> int:
    """Video frames (packets) a reader finds in the MP4 at `path`; 0 when it does not open."""
    try:
        with av.open(str(path)) as c:
            return sum(1 for packet in c.demux(video=0) if packet.size)
    except (av.FFmpegError, OSError, IndexError, ValueError):
        return 0


def _finished_anyway(signals: list[int], path: Path, signed: Signed | None) -> None:
    """A signal came while the finished file was being signed and renamed: say where it is."""
    what = ("complete and signed" if signed is not None and signed.signed else
            "complete but NOT signed (no content credentials)" if signed is not None else "complete")
    log.warning("%s came while the video was being signed: that was finished first; %s is %s",
                interrupt.names(signals), path, what)


def _with_signing(kept: Kept | None, credentials: ContentCredentials | None,
                  signed: Signed | None) -> Kept | None:
    """`kept`, noting that it is unsigned when it should have been signed and is not."""
    if kept is None or credentials is None or (signed is not None and signed.signed):
        return kept
    why = signed.error if signed is not None and signed.error else "the run ended before it was whole"
    return replace(kept, unsigned=why)
