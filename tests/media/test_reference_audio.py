"""Reading what a user gives: reference images and videos (square crops, the 1 + 4k frame
layout, clear errors) and audio in any container, rate and channel layout (mono 16 kHz)."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pytest

from avatarstream.media.synthetic import write_wav
from avatarstream.errors import InputError
from avatarstream.media.audio import AudioReader, read_all
from avatarstream.media.reference import load_reference, usable_frame_count

FPS, SR, SIZE = 25, 16000, 64


# -- inputs made on the fly ----------------------------------------------------------------------
def stripes(width: int, height: int) -> np.ndarray:
    """[H, W, 3]: red left margin, green center square, blue right margin (for crop checks)."""
    img = np.zeros((height, width, 3), np.uint8)
    m = (width - height) // 2
    img[:, :m] = (255, 0, 0)
    img[:, m:m + height] = (0, 255, 0)
    img[:, m + height:] = (0, 0, 255)
    return img


def encode_picture(path: Path, img: np.ndarray, codec: str, pix: str, fmt: str | None = None,
                   **options: str) -> Path:
    """img `[H, W, 3]` uint8 written as one picture by `codec` (container from the suffix, or `fmt`)."""
    with av.open(str(path), "w", format=fmt) as c:
        s = c.add_stream(codec, rate=1, options=options)
        s.width, s.height, s.pix_fmt = img.shape[1], img.shape[0], pix
        for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def write_image(path: Path, img: np.ndarray) -> Path:
    codec, pix = {".png": ("png", "rgb24"), ".jpg": ("mjpeg", "yuvj444p"),
                  ".webp": ("libwebp", "yuv420p")}[path.suffix]
    return encode_picture(path, img, codec, pix)


def write_ramp_video(path: Path, frames: int, width: int = 96, height: int = 64) -> Path:
    """Frame i is a uniform gray of level 8·i, so a decoded frame tells its index."""
    codec = "libvpx-vp9" if path.suffix == ".webm" else "libx264"
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=FPS)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            img = np.full((height, width, 3), 8 * i, np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def write_sine(path: Path, codec: str, rate: int, channels: int, seconds: float = 1.0,
               freq: float = 440.0) -> Path:
    """A 0.3-amplitude sine, the same on every channel."""
    x = (0.3 * np.sin(2 * np.pi * freq * np.arange(int(seconds * rate)) / rate)).astype(np.float32)
    layout = "stereo" if channels == 2 else "mono"
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=rate)
        s.layout = layout
        frame = av.AudioFrame.from_ndarray(np.stack([x] * channels), format="fltp", layout=layout)
        frame.sample_rate = rate
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def native_decode(path: Path) -> tuple[int, int, int]:
    """(samples, rate, codec frame size) as decoded by PyAV without resampling."""
    with av.open(str(path)) as c:
        s = c.streams.audio[0]
        return sum(f.samples for f in c.decode(s)), s.rate, s.codec_context.frame_size or 0


# -- reference -----------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".png", ".jpg", ".webp"])
def test_reference_image_is_one_square_center_crop(tmp_path, suffix):
    path = write_image(tmp_path / f"ref{suffix}", stripes(160, 100))
    ref = load_reference(path, size=SIZE, max_frames=61)
    assert ref.frames.shape == (1, 3, SIZE, SIZE) and str(ref.frames.dtype) == "torch.uint8"
    assert ref.is_image and ref.fps is None and ref.source_size == (160, 100)
    rgb = ref.frames[0].permute(1, 2, 0).numpy().astype(int)  # [H, W, 3]
    inner = rgb[:, 2:-2]  # the crop is the green square; lossy codecs bleed a pixel at the edges
    assert inner[..., 1].min() > 200 and inner[..., 0].max() < 60 and inner[..., 2].max() < 60


@pytest.mark.parametrize("suffix", [".mp4", ".mkv", ".webm"])
def test_reference_video_first_frames_in_1_plus_4k(tmp_path, suffix):
    path = write_ramp_video(tmp_path / f"ref{suffix}", frames=30)
    ref = load_reference(path, size=32, max_frames=61)
    assert ref.frames.shape == (29, 3, 32, 32)  # 30 decoded -> 1 + 4·7
    assert not ref.is_image and ref.fps == FPS and ref.source_size == (96, 64)
    levels = ref.frames[:, 1].float().mean(dim=(1, 2)).numpy()
    np.testing.assert_allclose(levels, 8 * np.arange(29), atol=3)  # the first frames, in order
    assert load_reference(path, size=32, max_frames=10).frames.shape[0] == 9


def test_usable_frame_count():
    assert [usable_frame_count(n) for n in (1, 2, 4, 5, 8, 9, 61, 62)] == [1, 1, 1, 5, 5, 9, 61, 61]


def test_reference_errors(tmp_path):
    (tmp_path / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (tmp_path / "empty.jpg").write_bytes(b"")
    audio_only = write_wav(tmp_path / "speech.wav", np.zeros(1600, np.float32))
    for name in ["nope.png", "corrupt.png", "empty.jpg", audio_only.name, "."]:
        path = tmp_path / name
        with pytest.raises(InputError, match="reference") as e:
            load_reference(path, size=SIZE, max_frames=5)
        assert str(path) in str(e.value)


# -- audio ---------------------------------------------------------------------------------------
AUDIO_CASES = [("wav", "pcm_s16le", 8000, 1), ("mp3", "mp3", 44100, 2), ("flac", "flac", 48000, 2),
               ("ogg", "libopus", 48000, 1), ("m4a", "aac", 44100, 2), ("wav", "pcm_s16le", 48000, 2)]


@pytest.mark.parametrize("ext,codec,rate,channels", AUDIO_CASES,
                         ids=[f"{c[0]}-{c[2]}-{c[3]}ch" for c in AUDIO_CASES])
def test_audio_reader_resamples_to_mono_16k(tmp_path, ext, codec, rate, channels):
    path = write_sine(tmp_path / f"sine.{ext}", codec, rate, channels)
    reader = AudioReader(path, sample_rate=SR)
    native, native_rate, frame_size = native_decode(path)
    pieces = [p.numpy() for p in reader]
    assert all(p.dtype == np.float32 and p.ndim == 1 for p in pieces)
    assert all(len(p) == 3200 for p in pieces[:-1]) and 0 < len(pieces[-1]) <= 3200  # 0.2 s
    x = np.concatenate(pieces)
    # The resampled length is the decoded length at the new rate (1 ms), and the container's
    # duration agrees with it up to the codec's priming/padding (one codec frame).
    assert abs(len(x) - native * SR / native_rate) <= SR / 1000
    assert reader.duration_s is not None
    codec_frame = max(frame_size, 1024) / native_rate  # opus reports no frame size (≤ 20 ms)
    assert abs(reader.duration_s - native / native_rate) <= codec_frame + 1e-3
    mid = x[len(x) // 4: 3 * len(x) // 4]
    spectrum = np.abs(np.fft.rfft(mid * np.hanning(len(mid))))
    assert abs(np.argmax(spectrum) * SR / len(mid) - 440) < 4  # the tone survives resampling
    assert abs(np.sqrt(np.mean(mid ** 2)) - 0.3 / np.sqrt(2)) < 0.02  # channels averaged, level kept
    np.testing.assert_array_equal(read_all(path, SR), x)  # reading again gives the same samples


def test_audio_reader_duration_cap(tmp_path):
    path = write_wav(tmp_path / "three.wav", np.zeros(3 * SR, np.float32) + 0.1)
    with pytest.raises(InputError, match="--max-audio-seconds"):
        AudioReader(path, max_seconds=2)
    assert AudioReader(path, max_seconds=3).duration_s == pytest.approx(3.0)


def test_audio_errors(tmp_path):
    (tmp_path / "corrupt.mp3").write_bytes(b"ID3" + bytes(range(256)) * 8)
    (tmp_path / "empty.wav").write_bytes(b"")
    write_wav(tmp_path / "silent0.wav", np.zeros(0, np.float32))
    write_image(tmp_path / "face.png", stripes(32, 32))
    for name in ["nope.wav", "empty.wav", "silent0.wav", "corrupt.mp3", "face.png", "."]:
        with pytest.raises(InputError, match="audio"):
            AudioReader(tmp_path / name)


# -- fragmented MP4 ------------------------------------------------------------------------------
