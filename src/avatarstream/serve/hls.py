"""Live HLS with fragmented-MP4 segments (CMAF: `init.mp4` + `segment_NNNNN.m4s`).

The publish package's HLSSink writes MPEG-TS segments; players without WebRTC (Safari, hls.js,
ffplay) all read fMP4 segments too, which carry the same H.264 + AAC without the TS overhead. The
muxer, segmenting, atomic playlist and cleanup are HLSSink's; only the segment format changes.
"""

from __future__ import annotations

import re

from avatarstream.publish.hls import PLAYLIST, HLSSink

INIT = "init.mp4"
NAME = re.compile(r"^(index\.m3u8|init\.mp4|segment_\d{5}\.m4s)$")


class FMP4HLSSink(HLSSink):
    def _muxer_options(self) -> dict[str, str]:
        opts = super()._muxer_options()
        opts.update(hls_segment_type="fmp4", hls_fmp4_init_filename=INIT,
                    hls_segment_filename=str(self.dir / "segment_%05d.m4s"))
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
