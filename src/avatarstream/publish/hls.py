"""The HLS sink: a live HLS stream (MPEG-TS segments + `index.m3u8`) written into a folder.

FFmpeg's `hls` muxer cuts a segment at the first keyframe after `segment_seconds`; every chunk
starts with a forced keyframe and libx264 puts one at least every `segment_seconds`, so segments
stay close to that length. Each segment is written under a temporary name and renamed when it is
complete (`temp_file`), and the playlist is rewritten (atomically) after every segment, so a
player polling `index.m3u8` only ever sees whole segments. The playlist is an EVENT playlist
listing every segment (`hls_list_size` 0), so a viewer can join live or seek back to the start;
`#EXT-X-ENDLIST` is added at the end.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import av

from avatarstream.errors import OutputError
from avatarstream.publish.encoder import AVEncoder, EncodingSink

log = logging.getLogger(__name__)

PLAYLIST = "index.m3u8"
_EXTINF = re.compile(r"^#EXTINF:([0-9.]+)", re.MULTILINE)


class HLSSink(EncodingSink):
    """Publish H.264 + AAC as live HLS into `directory` (created if missing).

    `durable_frames` is the number of video frames in the segments the playlist lists (what a
    player can fetch now). `abort` removes the playlist and segments this sink wrote.
    """

    def __init__(self, directory: str | Path, *, segment_seconds: float = 2.0,
                 crf: int = 20, preset: str = "veryfast") -> None:
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
        self._container: av.container.OutputContainer | None = None
        self._enc: AVEncoder | None = None
        self._made_dir = False
        self._fps = 0

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        """Create the folder and start the muxer (segments appear as the video is written)."""
        try:
            if not self.dir.exists():
                self.dir.mkdir(parents=True)
                self._made_dir = True
            self._container = av.open(str(self.playlist), "w", format="hls",
                                      container_options=self._muxer_options())
        except (OSError, av.FFmpegError) as e:
            raise OutputError(f"cannot write {self._output}: {e}") from e
        self._fps = fps
        self._enc = AVEncoder(self._container, width, height, fps, sample_rate, crf=self.crf,
                              preset=self.preset,
                              keyint=max(1, round(self.segment_seconds * fps)))

    def _muxer_options(self) -> dict[str, str]:
        return {"hls_time": f"{self.segment_seconds:g}", "hls_list_size": "0",
                "hls_playlist_type": "event",
                "hls_segment_filename": str(self.dir / "segment_%05d.ts"),
                "hls_flags": "independent_segments+temp_file"}

    @property
    def _output(self) -> str:
        return f"the HLS output in {self.dir}"

    def listed_seconds(self) -> float:
        """Total duration of the segments the playlist lists now (0 before the first)."""
        try:
            text = self.playlist.read_text()
        except (FileNotFoundError, UnicodeDecodeError):
            return 0.0
        return sum(float(m) for m in _EXTINF.findall(text))

    def _update_durable(self) -> None:
        self.durable_frames = round(self.listed_seconds() * self._fps)

    def abort(self) -> None:
        """Stop and remove the playlist and segments (and the folder if this sink made it)."""
        container = self._container
        self._container = self._enc = None
        if container is not None:
            try:
                container.close()
            except (OSError, av.FFmpegError) as e:
                log.debug("closing the HLS muxer in %s on abort: %s", self.dir, e)
        for f in [self.playlist, *self.dir.glob("segment_*.ts*"), *self.dir.glob(PLAYLIST + ".tmp")]:
            f.unlink(missing_ok=True)
        if self._made_dir:
            try:
                self.dir.rmdir()
            except OSError:
                pass  # someone else put files there: leave it
        self.durable_frames = 0
