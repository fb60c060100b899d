"""The sink protocol: where published frames and the session's audio go; and how a run ends them."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from avatarstream.errors import AvatarStreamError, OutputError
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.publish.output import Kept

if TYPE_CHECKING:
    from avatarstream.provenance.credentials import ContentCredentials


@runtime_checkable
class Sink(Protocol):
    """Receives timed video and audio in timeline order (video and audio interleave freely).

    `open` is called once before anything is written; `close` finishes the output normally;
    `abort` removes whatever a run that published nothing useful left behind. `durable_frames`
    is how many video frames a reader of the output can already decode (a killed process keeps
    at least those). The file and HLS sinks also have `reserve` (take the output's lock before
    any work) and `keep` (a failed run: keep what was written, return where): `end_sinks`.
    """

    durable_frames: int

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None: ...

    def write_video(self, chunk: VideoChunk) -> None: ...

    def write_audio(self, chunk: AudioChunk) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


def end_sinks(sinks: Sequence[Sink], ok: bool) -> list[Kept]:
    """End every sink of a run, whatever happens to one of them.

    ok: close each (an atomic output replaces the old one); a sink whose close fails keeps what it
    wrote instead, and the first such OutputError is raised after every sink is ended, naming what
    was kept. Not ok: each sink with `keep` keeps what it wrote (deletes it when it holds no
    frame); any other sink is closed when it published frames, else aborted. Returns what was kept
    beside its final path (`Kept`), for the caller to tell the user.
    """
    kept: list[Kept] = []
    done: list[str] = []  # where the outputs that closed whole are (said when another one failed)
    error: OutputError | None = None
    for sink in sinks:
        if ok:
            try:
                sink.close()
                done.extend(_written(sink))
                continue
            except OutputError as e:
                error = error or e
        keep = getattr(sink, "keep", None)
        if keep is not None:
            k = keep()
            if k is not None:
                kept.append(k)
        elif sink.durable_frames > 0:
            sink.close()
        else:
            sink.abort()
    if error is not None:
        raise OutputError("; ".join([with_kept(str(error), kept), *done])) from error
    return kept


def _written(sink: Sink) -> list[str]:
    """"the complete video is in OUT (signed ...)" for a sink that closed whole and has a path."""
    path = getattr(sink, "path", None)
    if path is None:
        return []
    signed = getattr(sink, "signed", None)
    how = " (signed with its content credentials)" if getattr(signed, "signed", False) else ""
    return [f"the complete video is in {path}{how}"]


def with_kept(message: str, kept: Sequence[Kept]) -> str:
    """`message`, then where each kept output is ("...; the 50 frames written are kept in ...")."""
    return "; ".join([message.rstrip("."), *(k.note() for k in kept)])


@contextmanager
def ending(sinks: Sequence[Sink]) -> Iterator[None]:
    """Run the body, then end the sinks (`end_sinks`, ok when the body finished). When the body
    fails (a user error, a bug, SIGINT) after something was kept, its message says where:
    an AvatarStreamError's or KeyboardInterrupt's message gets it appended (the CLI prints those
    as one line), any other exception a note under its traceback."""
    try:
        yield
    except BaseException as e:
        kept = end_sinks(sinks, ok=False)
        if kept:
            if isinstance(e, (AvatarStreamError, KeyboardInterrupt)):
                e.args = (with_kept(str(e) or "interrupted", kept),)
            else:
                e.add_note(with_kept("the run failed", kept))
        raise
    end_sinks(sinks, ok=True)


def generate_outputs(out: str | Path, hls: str | Path | None = None, *,
                     credentials: ContentCredentials | None = None,
                     rtmp: str | None = None) -> list[Sink]:
    """The sinks of `generate --out OUT [--hls DIR] [--rtmp URL]`: atomic (a new file replaces an
    old one only when complete) and reserved now, so a second run writing the same path is refused
    before any work (OutputError); an RTMP server that cannot be reached is refused then too.
    `credentials` (provenance/credentials.py) sign the file at close."""
    from avatarstream.publish.file import FragmentedMP4Sink
    from avatarstream.publish.hls import HLSSink
    from avatarstream.publish.rtmp import RTMPSink

    sinks: list = [FragmentedMP4Sink(out, atomic=True, credentials=credentials)]
    if hls:
        sinks.append(HLSSink(hls, atomic=True))
    if rtmp:
        sinks.append(RTMPSink(rtmp, max_ahead_s=8.0))  # the run keeps <= 8 s ahead of the stream
    for i, sink in enumerate(sinks):
        try:
            sink.reserve()
        except OutputError:
            for held in sinks[:i]:
                held.abort()
            raise
    return sinks
