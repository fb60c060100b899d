"""Inputs bounded before the expensive step (issue 30): a picture's size read from its header and
refused before decoding (a large JPEG decoded at a fraction of its size instead), video frames
likewise; a partly corrupt audio file skipped with a warning, or refused past 5 % damage."""

from __future__ import annotations

import struct
import subprocess
import sys
import zlib
from pathlib import Path

import av
import numpy as np
import pytest

from avatarstream.errors import InputError
from avatarstream.media.audio import MAX_DAMAGED_FRACTION, AudioReader, read_all
from avatarstream.media.image import MAX_PIXELS, check_pixels, picture_size
from avatarstream.media.reference import load_reference
from media.test_reference_audio import encode_picture, stripes, write_image, write_ramp_video

SR = 16000


def write_big_png(path: Path, width: int, height: int) -> Path:
    """A valid PNG of any size (grey levels by row: not blank), compressed row by row (never
    held decoded in memory)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z = zlib.compressobj(9)
    rows = (b"\x00" + bytes([y % 200 + 20]) * (3 * width) for y in range(height))  # filter byte + RGB
    idat = b"".join(z.compress(row) for row in rows) + z.flush()
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
                     + chunk(b"IDAT", idat) + chunk(b"IEND", b""))
    return path


# -- pictures ------------------------------------------------------------------------------------
PICTURES = [("png", "png", "rgb24", "image2", {}), ("jpg", "mjpeg", "yuvj420p", "image2", {}),
            ("webp", "libwebp", "yuv420p", "image2", {}), ("webp", "libwebp", "bgra", "image2", {"lossless": "1"}),
            ("webp", "libwebp", "yuva420p", "image2", {}), ("bmp", "bmp", "bgr24", "image2", {})]


@pytest.mark.parametrize("ext,codec,pix,fmt,opts", PICTURES, ids=[f"{p[0]}-{p[2]}" for p in PICTURES])
def test_picture_size_is_read_from_the_header(tmp_path, ext, codec, pix, fmt, opts):
    img = (np.random.default_rng(0).random((61, 83, 3)) * 255).astype(np.uint8)
    path = encode_picture(tmp_path / f"a.{ext}", img, codec, pix, fmt, **opts)
    size = picture_size(path)
    assert (size.width, size.height, size.reduce) == (83, 61, 0)
    assert picture_size(path.read_bytes()) == size  # an upload's bytes, as the file
    with av.open(str(path)) as c:  # what the decoder says
        assert (c.streams.video[0].codec_context.width, c.streams.video[0].codec_context.height) == (83, 61)
    assert picture_size(tmp_path / "missing.png") is None and picture_size(b"RIFF") is None
    assert picture_size(b"GIF89a" + struct.pack("<HH", 83, 61) + bytes(20)).width == 83


def test_an_8000_px_png_is_refused_before_it_is_decoded(tmp_path):
    """Bug 3 (CLI side): the 8000x8000 PNG (64 MP, 190 MB decoded) is refused from its header; a
    fresh process shows nothing was decoded (its peak memory grows by a few MB, not hundreds)."""
    path = write_big_png(tmp_path / "big.png", 8000, 8000)
    assert path.stat().st_size < 1_000_000  # small on disk: a byte limit would let it through
    with pytest.raises(InputError, match=r"big.png is 8000x8000 pixels \(64.0 MP\), over the limit of 40.0 MP"):
        load_reference(path, size=64, max_frames=1)
    code = f"""
import resource
from avatarstream.errors import InputError
from avatarstream.media.reference import load_reference
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    load_reference({str(path)!r}, size=64, max_frames=1)
except InputError:
    pass
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) < 40  # MB; decoding it costs ~190 MB, the old loader ~1.2 GB


def test_pictures_over_the_limit(tmp_path):
    """A JPEG over the limit is decoded at 1/2..1/8 of its size (the crop is the same picture); a
    PNG has no such mode and is refused; at the limit itself both load."""
    img = stripes(1600, 1000)
    jpg = write_image(tmp_path / "photo.jpg", img)
    png = write_image(tmp_path / "photo.png", img)
    assert check_pixels(jpg, 1_000_000).reduce == 1 and check_pixels(jpg, 99_999).reduce == 3
    ref = load_reference(jpg, size=64, max_frames=1, max_pixels=500_000)
    assert ref.source_size == (800, 500)  # decoded at half size: 0.4 MP
    full = load_reference(jpg, size=64, max_frames=1)
    assert (ref.frames.int() - full.frames.int()).abs().max() <= 16  # the same green square
    with pytest.raises(InputError, match=r"1600x1000 pixels \(1.6 MP\), over the limit of 0.5 MP"):
        load_reference(png, size=64, max_frames=1, max_pixels=500_000)
    with pytest.raises(InputError, match="over the limit"):
        check_pixels(jpg, 1_600_000 // 65)  # even 1/8 of it is too big
    assert load_reference(png, size=64, max_frames=1, max_pixels=1_600_000).frames.shape == (1, 3, 64, 64)
    assert MAX_PIXELS == 40_000_000


def test_video_frames_over_the_limit(tmp_path):
    video = write_ramp_video(tmp_path / "ref.mp4", frames=9)  # 96 x 64
    with pytest.raises(InputError, match=r"ref.mp4 is 96x64 pixels \(0.0 MP\), over the limit"):
        load_reference(video, size=32, max_frames=9, max_pixels=96 * 64 - 1)
    assert load_reference(video, size=32, max_frames=9, max_pixels=96 * 64).frames.shape[0] == 9


def test_a_picture_whose_header_is_not_read_is_bounded_by_the_decoder(tmp_path):
    tiff = encode_picture(tmp_path / "ref.tiff", stripes(120, 80), "tiff", "rgb24")
    assert picture_size(tiff) is None
    with pytest.raises(InputError, match="over the limit of 0.0 MP"):
        load_reference(tiff, size=32, max_frames=1, max_pixels=120 * 80 - 1)
    assert load_reference(tiff, size=32, max_frames=1, max_pixels=120 * 80).source_size == (120, 80)


# -- damaged audio -------------------------------------------------------------------------------
def write_mp3(path: Path, seconds: float = 6.0) -> Path:
    x = (0.3 * np.sin(2 * np.pi * 220 * np.arange(int(seconds * 44100)) / 44100)).astype(np.float32)
    with av.open(str(path), "w") as c:
        s = c.add_stream("mp3", rate=44100)
        s.layout = "mono"
        frame = av.AudioFrame.from_ndarray(x[None], format="fltp", layout="mono")
        frame.sample_rate = 44100
        for p in [*s.encode(frame), *s.encode()]:
            c.mux(p)
    return path


def garble(path: Path, start: float, stop: float) -> Path:
    """Overwrite bytes [start, stop) (fractions of the file) with random bytes."""
    data = bytearray(path.read_bytes())
    a, b = int(start * len(data)), int(stop * len(data))
    data[a:b] = np.random.default_rng(1).integers(0, 256, b - a, dtype=np.uint8).tobytes()
    out = path.with_name(f"{path.stem}-garbled-{start:g}-{stop:g}.mp3")
    out.write_bytes(bytes(data))
    return out


def test_an_mp3_with_a_corrupt_second_half_is_refused(tmp_path):
    """Bug 4: it used to give a half-length video, exit 0, no message."""
    bad = garble(write_mp3(tmp_path / "speech.mp3"), 0.5, 1.0)
    with pytest.raises(InputError) as e:
        AudioReader(bad)
    msg = str(e.value)
    assert str(bad) in msg and "damaged" in msg and f"over the {MAX_DAMAGED_FRACTION:.0%} allowed" in msg
    assert "the first at 3.0 s" in msg  # where the damage starts, roughly (6 s file)
    assert AudioReader(bad, max_damaged=0.6).damage.fraction == pytest.approx(0.5, abs=0.03)


def test_a_little_damage_is_skipped_with_a_warning(tmp_path, caplog):
    good = write_mp3(tmp_path / "speech.mp3")
    bad = garble(good, 0.5, 0.52)
    with caplog.at_level("WARNING", logger="avatarstream.media.audio"):
        reader = AudioReader(bad)
    assert 0 < reader.damage.fraction < MAX_DAMAGED_FRACTION
    assert str(bad) in caplog.text and "could not be decoded (about 0.2 s, the first at 3.0 s)" in caplog.text
    assert 0 < len(read_all(good, SR)) - len(read_all(bad, SR)) < 0.3 * SR  # what was skipped
    assert AudioReader(good).damage is None
