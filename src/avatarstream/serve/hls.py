"""Live HLS with fragmented-MP4 segments (CMAF: `init.mp4` + `segment_NNNNN.m4s`).

The publish package's HLSSink writes MPEG-TS segments; players without WebRTC (Safari, hls.js,
ffplay) all read fMP4 segments too, which carry the same H.264 + AAC without the TS overhead. The
muxer, segmenting, atomic playlist and cleanup are HLSSink's; the segment format and the playlist
kind change: a live session is open-ended, so its playlist is a sliding window of the last
`LIVE_SEGMENTS` segments and older segments are deleted (disk use bounded by the window, not by
the session's length), where a file render's HLS keeps every segment (an EVENT playlist).
"""

from __future__ import annotations

import re

from avatarstream.publish.hls import PLAYLIST, HLSSink

INIT = "init.mp4"
LIVE_SEGMENTS = 10  # segments in the live playlist (and on disk, plus the one being written)
NAME = re.compile(r"^(index\.m3u8|init\.mp4|segment_\d{5}\.m4s)$")


class FMP4HLSSink(HLSSink):
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
