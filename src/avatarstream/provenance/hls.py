"""A remote HLS stream, fetched by `verify` itself and handed to FFmpeg as one local file.

FFmpeg's own HLS reader sends the user's headers to every host a playlist names (a bearer key
reached other hosts' segments, keys and redirects) and knows no limits (a live playlist that never
ends, a master playlist that names itself). So `verify` reads the playlists with its `Fetcher`
(provenance/fetch.py: headers only to the URL's origin, http(s) only, bounded) and writes the
segments it needs, one after the other, into one local file: MPEG-TS segments concatenate into an
MPEG-TS stream, fragmented-MP4 segments after their init section (`EXT-X-MAP`) into a fragmented
MP4. The watermark detector then reads that file with FFmpeg restricted to local files of media
formats (no playlist format: nothing it reads can name another file).

- Every URI in a remote playlist is resolved against the playlist's URL and must be http(s): a
  remote playlist never names a local file.
- A master playlist: its first variant is read (the nesting is bounded by `max_depth`).
- A media playlist: segments in order until `SECONDS` of media (what the detector reads, 250
  frames, with room to spare) or `max_segments`; a live playlist (no `EXT-X-ENDLIST`) is read
  once, as it stands (it is never polled).
- `EXT-X-KEY` AES-128 segments are decrypted here (AES-CBC, the key fetched under the same rules,
  the IV given or the media sequence number); SAMPLE-AES and other methods are refused.
- `EXT-X-BYTERANGE` is a Range request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives import padding
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from avatarstream.errors import InputError
from avatarstream.provenance.fetch import Fetcher, checked_url, shown_url

SECONDS = 12.0  # media read from a stream: the detector's 250 frames at 25 fps, and a margin
MAX_KEY_BYTES = 1024
_ATTR = re.compile(r'([A-Z0-9-]+)=("[^"]*"|[^,]*)')


def is_playlist_start(data: bytes) -> bool:
    """Whether `data` begins like an M3U playlist (what FFmpeg would read as HLS)."""
    return data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"#EXTM3U")


def _attrs(text: str) -> dict[str, str]:
    return {k: v.strip('"') for k, v in _ATTR.findall(text)}


@dataclass
class Stream:
    """What was read of a remote stream: the local file and how it was made."""

    path: Path
    playlists: int = 0
    segments: int = 0
    seconds: float = 0.0
    live: bool = False
    _keys: dict[str, bytes] = field(default_factory=dict)

    def summary(self) -> dict:
        return {"playlists": self.playlists, "segments": self.segments,
                "seconds": round(self.seconds, 3), "live": self.live}


def _lines(fetcher: Fetcher, text: bytes, url: str) -> list[str]:
    if not is_playlist_start(text):
        raise InputError(f"cannot verify {shown_url(url)}: it is not an HLS playlist (no #EXTM3U)")
    lines = text.decode("utf-8", errors="replace").splitlines()
    if len(lines) > fetcher.limits.max_playlist_lines:
        raise InputError(f"cannot verify {shown_url(url)}: the playlist has more than "
                         f"{fetcher.limits.max_playlist_lines} lines (--max-playlist-lines)")
    return [ln.strip() for ln in lines if ln.strip()]


def read_stream(fetcher: Fetcher, text: bytes, url: str, folder: Path) -> Stream:
    """The stream whose playlist `text` was read from `url`, into a file in `folder`."""
    stream = Stream(folder / "stream")
    depth = 1
    while True:
        stream.playlists += 1
        lines = _lines(fetcher, text, url)
        variant = next((checked_url(lines[i + 1], url) for i, ln in enumerate(lines[:-1])
                        if ln.startswith("#EXT-X-STREAM-INF") and not lines[i + 1].startswith("#")), None)
        if variant is None:
            break
        depth += 1
        if depth > fetcher.limits.max_depth:
            raise InputError(f"cannot verify {shown_url(url)}: its playlists nest more than "
                             f"{fetcher.limits.max_depth} deep (--max-playlist-depth)")
        url, text = fetcher.read(variant, fetcher.limits.max_playlist_bytes, "playlist")
    _read_segments(fetcher, lines, url, stream)
    return stream


def _read_segments(fetcher: Fetcher, lines: list[str], url: str, stream: Stream) -> None:
    sequence, duration, key, init = 0, 0.0, None, None
    byterange: tuple[int, int | None] | None = None
    ends: dict[str, int] = {}  # the end of the last byte range read of each URI
    stream.live = "#EXT-X-ENDLIST" not in lines
    written_init = None
    with open(stream.path, "wb") as out:
        for line in lines:
            if line.startswith("#EXT-X-MEDIA-SEQUENCE:"):
                sequence = int(line.split(":", 1)[1]) if line.split(":", 1)[1].isdigit() else 0
            elif line.startswith("#EXTINF:"):
                value = line.split(":", 1)[1].split(",", 1)[0]
                duration = float(value) if re.fullmatch(r"\d+(\.\d+)?", value) else 0.0
            elif line.startswith("#EXT-X-BYTERANGE:"):
                n, _, at = line.split(":", 1)[1].partition("@")
                byterange = (int(n), int(at) if at.isdigit() else None) if n.isdigit() else None
            elif line.startswith("#EXT-X-KEY:"):
                key = _attrs(line.split(":", 1)[1])
                if key.get("METHOD", "NONE") not in ("NONE", "AES-128"):
                    raise InputError(f"cannot verify {shown_url(url)}: segments encrypted with "
                                     f"{key.get('METHOD')} (only AES-128 is read)")
                key = None if key.get("METHOD", "NONE") == "NONE" else key
            elif line.startswith("#EXT-X-MAP:"):
                init = _attrs(line.split(":", 1)[1]).get("URI")
                init = checked_url(init, url) if init else None
            elif not line.startswith("#"):
                segment = checked_url(line, url)
                if stream.segments >= fetcher.limits.max_segments or stream.seconds >= SECONDS:
                    return
                if init is not None and init != written_init:
                    out.write(fetcher.read(init, fetcher.limits.max_bytes)[1])
                    written_init = init
                rng = None
                if byterange is not None:
                    start = byterange[1] if byterange[1] is not None else ends.get(segment, 0)
                    rng = (start, byterange[0])
                    ends[segment] = start + byterange[0]
                data = fetcher.read(segment, fetcher.limits.max_bytes, byterange=rng)[1]
                if key is not None:
                    data = _decrypt(fetcher, stream, key, url, sequence, data)
                out.write(data)
                stream.segments += 1
                stream.seconds += duration
                sequence, duration, byterange = sequence + 1, 0.0, None
    if not stream.segments:
        raise InputError(f"cannot verify {shown_url(url)}: the playlist names no segment")


def _decrypt(fetcher: Fetcher, stream: Stream, key: dict[str, str], url: str, sequence: int,
             data: bytes) -> bytes:
    if not key.get("URI"):
        raise InputError(f"cannot verify {shown_url(url)}: an AES-128 key without a URI")
    uri = checked_url(key["URI"], url)
    if uri not in stream._keys:
        stream._keys[uri] = fetcher.read(uri, MAX_KEY_BYTES, "key")[1]
    secret = stream._keys[uri]
    iv_text = key.get("IV", "")
    try:
        iv = bytes.fromhex(iv_text[2:]) if iv_text.lower().startswith("0x") else sequence.to_bytes(16, "big")
        if len(secret) != 16 or len(iv) != 16:
            raise ValueError("the key and the IV must be 16 bytes")
        clear = Cipher(algorithms.AES(secret), modes.CBC(iv)).decryptor()
        unpad = padding.PKCS7(128).unpadder()
        return unpad.update(clear.update(data) + clear.finalize()) + unpad.finalize()
    except ValueError as e:
        raise InputError(f"cannot verify {shown_url(url)}: cannot decrypt a segment ({e})") from None
