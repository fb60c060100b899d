"""The HLS sink: a live HLS stream (MPEG-TS segments + `index.m3u8`) written into a folder.

FFmpeg's `hls` muxer cuts a segment at the first keyframe after `segment_seconds`; every chunk
starts with a forced keyframe and libx264 puts one at least every `segment_seconds`, so segments
stay close to that length. Each segment is written under a temporary name and renamed when it is
complete (`temp_file`), and the playlist is rewritten (atomically) after every segment, so a
player polling the playlist only ever sees whole segments. The playlist is an EVENT playlist
listing every segment (`hls_list_size` 0), so a viewer can join live or seek back to the start;
`#EXT-X-ENDLIST` is added at the end.

An HLS output that replaces an old one (`atomic=True`, what `generate --hls` uses) follows the
file sink's rule per playlist (`publish/output.py`): the run's segments get names of their own
(`segment_<pid>_00000.ts`: the old playlist's segments are never overwritten), its live playlist
is `index.partial-<pid>.m3u8` (playable while it grows), and `close` renames it over `index.m3u8`
and only then deletes the segments the old playlist listed. A failed run's playlist and segments
are kept (`keep`) or deleted (`abort`); the old stream stays whole either way. Without `atomic`
the sink writes `index.m3u8` and `segment_00000.ts`… in place (a server session's own folder).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import av

from avatarstream.errors import OutputError
from avatarstream.publish.encoder import AVEncoder, EncodingSink
from avatarstream.publish.output import AtomicOutput, Kept, os_reason, partial_tag

log = logging.getLogger(__name__)

PLAYLIST = "index.m3u8"
_EXTINF = re.compile(r"^#EXTINF:([0-9.]+)", re.MULTILINE)
_MAP_URI = re.compile(r'^#EXT-X-MAP:.*URI="([^"]+)"', re.MULTILINE)


def listed_files(playlist_text: str) -> list[str]:
    """The plain file names a playlist refers to (segments and an init segment), in order;
    URLs and paths outside its folder are left out (never deleted on its behalf)."""
    names = _MAP_URI.findall(playlist_text)
    names += [ln.strip() for ln in playlist_text.splitlines() if ln.strip() and not ln.startswith("#")]
    return [n for n in names if "/" not in n and "\\" not in n and n not in (".", "..") and ":" not in n]


class HLSSink(EncodingSink):
    """Publish H.264 + AAC as live HLS into `directory` (created if missing).

    `durable_frames` is the number of video frames in the segments the live playlist lists (what
    a player can fetch now); `live_playlist` is that playlist (`index.m3u8`, or the partial one in
    atomic mode). `abort` removes the playlist and segments this sink wrote.
    """

    def __init__(self, directory: str | Path, *, segment_seconds: float = 2.0,
                 crf: int = 20, preset: str = "veryfast", atomic: bool = False) -> None:
        self.dir = Path(directory)
        if self.dir.exists() and not self.dir.is_dir():
            raise OutputError(f"the HLS output {self.dir} exists and is not a folder")
        if segment_seconds <= 0:
            raise ValueError("segment_seconds must be positive")
        self.segment_seconds = segment_seconds
        self.crf = crf
        self.preset = preset
        self.durable_frames = 0
        self.playlist = self.dir / PLAYLIST
        self.live_playlist = self.playlist
        self._target = AtomicOutput(self.playlist) if atomic else None
        self._tag = ""  # the run's segment names: segment_<tag>_NNNNN.ts (atomic mode)
        self._container: av.container.OutputContainer | None = None
        self._enc: AVEncoder | None = None
        self._made_dir = False
        self._fps = 0

    def _make_dir(self) -> None:
        if not self.dir.exists():
            try:
                self.dir.mkdir(parents=True)
            except OSError as e:
                raise OutputError(f"cannot write {self._output}: {os_reason(e)}") from e
            self._made_dir = True

    def reserve(self) -> None:
        """Atomic mode: create the folder and take the lock on its playlist now (a second writer
        is refused before any work); a no-op otherwise."""
        if self._target is not None:
            self._make_dir()
            self._target.reserve()

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        """Create the folder and start the muxer (segments appear as the video is written)."""
        self._make_dir()
        if self._target is not None:
            self.live_playlist = self._target.begin(
                clash=lambda tag: any(self.dir.glob(f"segment_{tag}_*")))
            self._tag = partial_tag(self.live_playlist)
        try:
            self._container = av.open(str(self.live_playlist), "w", format="hls",
                                      container_options=self._muxer_options())
        except (OSError, av.FFmpegError) as e:
            if self._target is not None:
                self._target.discard()
            raise OutputError(f"cannot write {self._output}: {os_reason(e)}") from e
        self._fps = fps
        self._enc = AVEncoder(self._container, width, height, fps, sample_rate, crf=self.crf,
                              preset=self.preset,
                              keyint=max(1, round(self.segment_seconds * fps)))

    def _segment_pattern(self) -> str:
        return f"segment_{self._tag}_%05d.ts" if self._tag else "segment_%05d.ts"

    def _muxer_options(self) -> dict[str, str]:
        return {"hls_time": f"{self.segment_seconds:g}", "hls_list_size": "0",
                "hls_playlist_type": "event",
                "hls_segment_filename": str(self.dir / self._segment_pattern()),
                "hls_flags": "independent_segments+temp_file"}

    @property
    def _output(self) -> str:
        if self.live_playlist != self.playlist:
            return f"the HLS output {self.live_playlist} (the new {self.playlist})"
        return f"the HLS output in {self.dir}"

    def listed_seconds(self) -> float:
        """Total duration of the segments the live playlist lists now (0 before the first)."""
        try:
            text = self.live_playlist.read_text()
        except (FileNotFoundError, UnicodeDecodeError):
            return 0.0
        return sum(float(m) for m in _EXTINF.findall(text))

    def _update_durable(self) -> None:
        self.durable_frames = round(self.listed_seconds() * self._fps)

    def close(self) -> None:
        """Finish the stream (`#EXT-X-ENDLIST`); in atomic mode replace `index.m3u8` with it and
        delete the old playlist's segments. On an OutputError the new playlist and the lock stay:
        follow with `keep` or `abort`."""
        if self._container is not None:
            super().close()
        if self._target is None:
            return
        if self._target.partial is None or not self.live_playlist.exists():  # nothing was published
            self.abort()
            return
        try:
            old = listed_files(self.playlist.read_text())
        except (FileNotFoundError, UnicodeDecodeError):
            old = []
        new = set(listed_files(self.live_playlist.read_text()))
        self._target.commit()
        self.live_playlist = self.playlist
        for name in old:
            if name not in new:
                (self.dir / name).unlink(missing_ok=True)

    def keep(self) -> Kept | None:
        """The run failed: finish the partial stream and keep its playlist and segments when it
        lists any (atomic mode; returned), else delete them. In place: as `close`, or `abort`
        when nothing was listed."""
        if self._container is not None:
            try:
                super().close()
            except OutputError as e:
                log.debug("finishing the kept HLS output in %s: %s", self.dir, e)
        if self.durable_frames <= 0:
            self.abort()
            return None
        if self._target is None:
            return None
        return self._target.keep(self.durable_frames)

    def abort(self) -> None:
        """Stop and remove the playlist and segments this run wrote (and the folder if this sink
        made it and nothing else is in it)."""
        container = self._container
        self._container = self._enc = None
        if container is not None:
            try:
                container.close()
            except (OSError, av.FFmpegError) as e:
                log.debug("closing the HLS muxer in %s on abort: %s", self.dir, e)
        if self._target is None or self._tag:  # atomic and never opened: nothing of ours to delete
            live = self.live_playlist
            segments = f"segment_{self._tag}_*.ts*" if self._tag else "segment_*.ts*"
            for f in [live, *self.dir.glob(segments), live.with_name(live.name + ".tmp")]:
                f.unlink(missing_ok=True)
        if self._target is not None:
            self._target.discard()
            self.live_playlist, self._tag = self.playlist, ""
        if self._made_dir:
            try:
                self.dir.rmdir()
            except OSError:
                pass  # someone else put files there: leave it
        self.durable_frames = 0
