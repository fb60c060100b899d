"""Live HLS with fragmented-MP4 segments (CMAF: `init.mp4` + `segment_NNNNN.m4s`).

The publish package's HLSSink writes MPEG-TS segments; players without WebRTC (Safari, hls.js,
ffplay) all read fMP4 segments too, which carry the same H.264 + AAC without the TS overhead. The
muxer, segmenting, atomic playlist and cleanup are HLSSink's; the segment format and the playlist
kind change: a live session is open-ended, so its playlist is a sliding window of the last
`LIVE_SEGMENTS` segments and older segments are deleted (disk use bounded by the window, not by
the session's length), where a file render's HLS keeps every segment (an EVENT playlist).

A full disk: FFmpeg's HLS muxer does not report a failed segment write (it leaves empty or cut
segments and goes on), so the sink looks at its folder's free space before every chunk and
stops with an OutputError ("no space left on device") below `min_free_bytes`; the session then
ends with that message in its `session_ended` event. Its errors never name the folder (a
client reads them).
"""

from __future__ import annotations

import os
import re

from avatarstream.errors import OutputError
from avatarstream.media.frames import VideoChunk
from avatarstream.publish.hls import PLAYLIST, HLSSink

INIT = "init.mp4"
LIVE_SEGMENTS = 10  # segments in the live playlist (and on disk, plus the one being written)
NAME = re.compile(r"^(index\.m3u8|init\.mp4|segment_\d{5}\.m4s)$")
MIN_FREE_BYTES = 8 * 1024 * 1024  # below this free on the disk, a live HLS output stops


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer can still put on the file system holding `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class FMP4HLSSink(HLSSink):
    min_free_bytes = MIN_FREE_BYTES

    @property
    def _output(self) -> str:
        return "the session's HLS output"

    def write_video(self, chunk: VideoChunk) -> None:
        free = free_bytes(self.dir)
        if free < self.min_free_bytes:
            raise OutputError(f"no space left on device: {self._output} stopped with "
                              f"{free // 1024} KiB free on the server's disk")
        super().write_video(chunk)

    def _muxer_options(self) -> dict[str, str]:
        opts = super()._muxer_options()
        opts.pop("hls_playlist_type", None)  # live: a sliding window, not an EVENT playlist
        opts.update(hls_segment_type="fmp4", hls_fmp4_init_filename=INIT,
                    hls_segment_filename=str(self.dir / "segment_%05d.m4s"),
                    hls_list_size=str(LIVE_SEGMENTS),
                    hls_flags=opts["hls_flags"] + "+delete_segments")
        return opts

    def abort(self) -> None:
        super().abort()
        for f in [*self.dir.glob("segment_*.m4s*"), self.dir / INIT]:
            f.unlink(missing_ok=True)
        if self._made_dir:
            try:
                self.dir.rmdir()
            except OSError:
                pass


__all__ = ["FMP4HLSSink", "INIT", "NAME", "PLAYLIST"]
