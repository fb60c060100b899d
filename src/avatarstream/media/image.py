"""Still images: PNG out through PyAV's png encoder (no imaging library needed); the size of a
picture read from its header, so that decoded pixels are bounded before anything is decoded."""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import av
import numpy as np

from avatarstream.errors import InputError, OutputError


def write_png(path: str | Path, img: np.ndarray) -> Path:
    """[H, W, 3] uint8 -> PNG file; returns the path. An unwritable path is an OutputError."""
    path = Path(path)
    img = np.ascontiguousarray(img)
    try:
        with av.open(str(path), "w", format="image2") as c:
            s = c.add_stream("png", rate=1)
            s.width, s.height, s.pix_fmt = img.shape[1], img.shape[0], "rgb24"
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
            for p in s.encode():
                c.mux(p)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e}") from e
    return path


# -- decoded pixels, bounded before decoding ------------------------------------------------------
MAX_PIXELS = 40_000_000
"""Default limit on the pixels (width x height) a reference image or video frame may decode to:
40 MP holds every common camera's full-resolution picture (24-36 MP sensors, 8K video frames at
33 MP) while bounding what one picture costs to read: the reference loader needs about 20 bytes
per pixel (decoded RGB, its crop as floats for the antialiased resize), so 0.8 GB at the limit
against 1.25 GB for an 8000x8000 PNG. A JPEG above it is decoded at 1/2, 1/4 or 1/8 of its size
(the decoder's DCT scaling: memory as for the smaller picture), so 48-200 MP phone photos load."""

JPEG_REDUCTIONS = 3  # the JPEG decoder scales by 1/2**k for k <= 3 (FFmpeg's `lowres`)
DECODER_SLACK = 2  # decoders count padded, aligned frames (a 96x64 H.264 frame counts ~2x): their
# limit is a backstop at this multiple; the exact limit is checked on headers and decoded frames
LIMIT_HINT = "scale it down (a face needs about 1 MP) or raise --max-megapixels"


@dataclass(frozen=True)
class PictureSize:
    """width x height from a picture's header; `reduce`: decode a JPEG at 1/2**reduce of it."""

    width: int
    height: int
    format: str
    reduce: int = 0

    @property
    def pixels(self) -> int:
        return self.width * self.height


def megapixels(pixels: int) -> str:
    return f"{pixels / 1e6:.1f} MP"


def check_pixels(source: str | Path | bytes, max_pixels: int = MAX_PIXELS, *,
                 what: str = "image", hint: str = LIMIT_HINT) -> PictureSize | None:
    """Refuse a picture over `max_pixels` from its header alone (nothing is decoded).

    `source` is a file or its bytes (an upload in memory). Returns its size (with the JPEG
    reduction that brings it under the limit, if one is needed), or None when it is not a PNG,
    JPEG, WebP, GIF or BMP (a video, say: `decoder_options` bounds those while they decode).
    Raises InputError naming `what`, the size and the limit, then `hint` (what to do).
    """
    size = picture_size(source)
    if size is None or size.pixels <= max_pixels:
        return size
    if size.format == "jpeg":
        for k in range(1, JPEG_REDUCTIONS + 1):
            if -(-size.width // 2 ** k) * -(-size.height // 2 ** k) <= max_pixels:
                return PictureSize(size.width, size.height, size.format, k)
    raise too_many_pixels(what, size.width, size.height, max_pixels, hint)


def too_many_pixels(what: str, width: int, height: int, max_pixels: int,
                    hint: str = LIMIT_HINT) -> InputError:
    return InputError(f"{what} is {width}x{height} pixels ({megapixels(width * height)}), over the "
                      f"limit of {megapixels(max_pixels)}" + (f"; {hint}" if hint else ""))


def decoder_options(max_pixels: int, size: PictureSize | None = None) -> dict[str, str]:
    """FFmpeg decoder options: refuse a frame far over `max_pixels` before allocating it (at
    `DECODER_SLACK` times the limit: pictures whose header `check_pixels` cannot read, video
    streams), and the JPEG DCT scaling `size.reduce` (the decoder checks its limit against the
    full size, then allocates 1/4**reduce of it)."""
    limit = max(max_pixels, size.pixels if size is not None and size.reduce else 0)
    opts = {"max_pixels": str(DECODER_SLACK * limit)}
    if size is not None and size.reduce:
        opts["lowres"] = str(size.reduce)
    return opts


def picture_size(source: str | Path | bytes) -> PictureSize | None:
    """(width, height) from the header of a PNG, JPEG, WebP, GIF or BMP file or its bytes; None
    for anything else. Reads the first bytes only (a JPEG: its segment headers, skipping them)."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _size_from(io.BytesIO(bytes(source)))
    try:
        with open(source, "rb") as f:
            return _size_from(f)
    except OSError:
        return None


def _size_from(f: BinaryIO) -> PictureSize | None:
    head = f.read(32)
    if head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR":
        w, h = struct.unpack(">II", head[16:24])
        return PictureSize(w, h, "png")
    if head[:6] in (b"GIF87a", b"GIF89a"):
        w, h = struct.unpack("<HH", head[6:10])
        return PictureSize(w, h, "gif")
    if head[:2] == b"BM" and len(head) >= 26:
        if struct.unpack("<I", head[14:18])[0] == 12:  # OS/2 BITMAPCOREHEADER
            w, h = struct.unpack("<HH", head[18:22])
        else:
            w, h = struct.unpack("<ii", head[18:26])
        return PictureSize(abs(w), abs(h), "bmp")
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp_size(head)
    if head[:2] == b"\xff\xd8":
        f.seek(2)
        return _jpeg_size(f)
    return None


def _webp_size(head: bytes) -> PictureSize | None:
    kind = head[12:16]
    if kind == b"VP8X":  # extended: the canvas, 24-bit sizes minus one
        w = int.from_bytes(head[24:27], "little") + 1
        h = int.from_bytes(head[27:30], "little") + 1
    elif kind == b"VP8L" and head[20:21] == b"\x2f":  # lossless: 14-bit sizes minus one
        bits = int.from_bytes(head[21:25], "little")
        w, h = (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    elif kind == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":  # lossy: after the frame start code
        w, h = (v & 0x3FFF for v in struct.unpack("<HH", head[26:30]))
    else:
        return None
    return PictureSize(w, h, "webp")


_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _jpeg_size(f: BinaryIO) -> PictureSize | None:
    """Walk the marker segments (seeking over their bodies) to the first frame header (SOFn)."""
    for _ in range(4096):
        byte = f.read(1)
        if not byte:
            return None
        if byte != b"\xff":
            continue
        marker = f.read(1)
        while marker == b"\xff":  # fill bytes
            marker = f.read(1)
        if not marker:
            return None
        m = marker[0]
        if m in (0x01, 0xD8) or 0xD0 <= m <= 0xD7:  # no length
            continue
        if m in (0xD9, 0xDA):  # end of image, start of scan: no frame header before them
            return None
        raw = f.read(2)
        if len(raw) < 2:
            return None
        length = struct.unpack(">H", raw)[0]
        if m in _SOF:
            body = f.read(5)
            if len(body) < 5:
                return None
            h, w = struct.unpack(">HH", body[1:5])
            return PictureSize(w, h, "jpeg")
        f.seek(length - 2, io.SEEK_CUR)
    return None
