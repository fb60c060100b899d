"""Media in and out: reference loading, audio reading/resampling, and the file/HLS/raw sinks.

Every input file is made on the fly with PyAV; outputs are decoded back with PyAV.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from avatarstream.bench.inputs import write_wav
from avatarstream.errors import InputError, OutputError
from avatarstream.media.audio import AudioReader, read_all
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.media.reference import load_reference, usable_frame_count
from avatarstream.publish.file import FragmentedMP4Sink, check_writable
from avatarstream.publish.hls import HLSSink
from avatarstream.publish.raw import RawFrameSink

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


def write_image(path: Path, img: np.ndarray) -> Path:
    codec, pix = {".png": ("png", "rgb24"), ".jpg": ("mjpeg", "yuvj444p"),
                  ".webp": ("libwebp", "yuv420p")}[path.suffix]
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=1)
        s.width, s.height, s.pix_fmt = img.shape[1], img.shape[0], pix
        for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


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
def moving_frames(start: int, n: int) -> np.ndarray:
    """[n, SIZE, SIZE, 3] uint8: a bright bar that moves one pixel per timeline frame."""
    f = np.full((n, SIZE, SIZE, 3), 40, np.uint8)
    for i in range(n):
        f[i, :, (start + i) % SIZE] = 230
    return f


def tone(start: int, n: int) -> np.ndarray:
    t = (start + np.arange(n)) / SR
    return (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)


def decode_frames(path: Path) -> int:
    with av.open(str(path)) as c:
        return sum(1 for _ in c.decode(video=0))


def test_check_writable(tmp_path):
    check_writable(tmp_path / "out.mp4")
    assert not (tmp_path / "out.mp4").exists()
    for bad in [tmp_path / "no" / "out.mp4", tmp_path, Path("/proc/avatarstream/out.mp4")]:
        with pytest.raises(OutputError, match="out"):
            check_writable(bad)


def test_fragmented_mp4_is_playable_while_written(tmp_path):
    out = tmp_path / "live.mp4"
    sink = FragmentedMP4Sink(out)
    sink.open(SIZE, SIZE, FPS, SR)
    durable = []
    for k in range(3):  # audio runs ahead of the video, as in the engine
        sink.write_audio(AudioChunk(tone(k * SR, SR), k * SR, SR))
        sink.write_video(VideoChunk(moving_frames(k * FPS, FPS), k * FPS, FPS))
        copy = tmp_path / f"copy{k}.mp4"
        shutil.copyfile(out, copy)
        durable.append(sink.durable_frames)
        if sink.durable_frames:
            assert decode_frames(copy) >= sink.durable_frames
    assert durable == [0, 25, 50]  # a chunk's fragment lands when the next chunk's keyframe comes
    sink.close()
    assert sink.durable_frames == 75

    with av.open(str(out)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        assert (v.codec_context.name, a.codec_context.name) == ("h264", "aac")
        assert (v.codec_context.width, v.codec_context.height, a.rate) == (SIZE, SIZE, SR)
        pts, samples, first_audio = [], 0, None
        for packet in c.demux(v, a):
            for f in packet.decode():
                if isinstance(f, av.VideoFrame):
                    pts.append(f.pts * f.time_base)
                else:
                    first_audio = f.pts * f.time_base if first_audio is None else first_audio
                    samples += f.samples
    assert pts == [Fraction(i, FPS) for i in range(75)]
    assert first_audio == 0  # the AAC priming is hidden by the edit list
    assert 0 <= samples / SR - 3.0 < 1024 / SR  # the last AAC frame is padded, nothing else


def test_fragmented_mp4_audio_gap_and_overlap(tmp_path):
    out = tmp_path / "gaps.mp4"
    sink = FragmentedMP4Sink(out)
    sink.open(SIZE, SIZE, FPS, SR)
    sink.write_audio(AudioChunk(tone(0, 8000), 0, SR))
    sink.write_audio(AudioChunk(tone(4000, 8000), 4000, SR))  # overlaps: first half dropped
    sink.write_audio(AudioChunk(tone(16000, 16000), 16000, SR))  # gap of 4000: silence
    sink.write_video(VideoChunk(moving_frames(0, 50), 0, FPS))
    sink.close()
    x = read_all(out, SR)
    assert 0 <= len(x) - 2 * SR < 1024
    assert np.abs(x[12400:15600]).max() < 0.02 and np.abs(x[4000:11000]).max() > 0.2


def test_fragmented_mp4_survives_sigkill(tmp_path):
    """A process killed right after reporting `durable_frames` leaves at least those frames."""
    out = tmp_path / "killed.mp4"
    code = f"""
import json, os, signal, sys
import numpy as np
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.publish.file import FragmentedMP4Sink
sink = FragmentedMP4Sink({str(out)!r})
sink.open({SIZE}, {SIZE}, {FPS}, {SR})
for k in range(4):
    sink.write_audio(AudioChunk(np.zeros({SR}, np.float32), k * {SR}, {SR}))
    sink.write_video(VideoChunk(np.full(({FPS}, {SIZE}, {SIZE}, 3), 9 * k, np.uint8), k * {FPS}, {FPS}))
print(json.dumps({{"durable": sink.durable_frames}}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr
    durable = json.loads(r.stdout.strip().splitlines()[-1])["durable"]
    assert durable == 75
    assert decode_frames(out) >= durable


def test_fragmented_mp4_abort_removes_the_file(tmp_path):
    out = tmp_path / "failed.mp4"
    sink = FragmentedMP4Sink(out)
    sink.open(SIZE, SIZE, FPS, SR)
    sink.write_audio(AudioChunk(tone(0, SR), 0, SR))
    assert out.exists()
    sink.abort()
    assert not out.exists() and sink.durable_frames == 0


# -- HLS -----------------------------------------------------------------------------------------
def test_hls_playlist_grows_and_decodes(tmp_path):
    d = tmp_path / "hls"
    sink = HLSSink(d, segment_seconds=1)
    sink.open(SIZE, SIZE, FPS, SR)
    for k in range(3):
        sink.write_audio(AudioChunk(tone(k * SR, SR), k * SR, SR))
        sink.write_video(VideoChunk(moving_frames(k * FPS, FPS), k * FPS, FPS))
    assert sink.durable_frames == 50 and (d / "index.m3u8").exists()  # 2 segments live already
    sink.close()
    text = (d / "index.m3u8").read_text()
    assert "#EXT-X-ENDLIST" in text and text.count("segment_") == 3
    assert sink.durable_frames == 75
    with av.open(str(d / "index.m3u8")) as c:
        assert c.streams.video[0].codec_context.name == "h264"
        assert c.streams.audio[0].codec_context.name == "aac"
        assert sum(1 for _ in c.decode(video=0)) == 75
    for seg in sorted(d.glob("segment_*.ts")):
        assert decode_frames(seg) == 25  # each segment decodes on its own


def test_hls_abort_cleans_up(tmp_path):
    d = tmp_path / "hls"
    sink = HLSSink(d, segment_seconds=1)
    sink.open(SIZE, SIZE, FPS, SR)
    for k in range(2):
        sink.write_video(VideoChunk(moving_frames(k * FPS, FPS), k * FPS, FPS))
    sink.abort()
    assert not d.exists()


# -- raw -----------------------------------------------------------------------------------------
def test_raw_sink_iterates_in_order_across_threads():
    sink = RawFrameSink(max_frames=4, with_audio=True)  # smaller than a chunk: back-pressure
    sink.open(SIZE, SIZE, FPS, SR)
    got: list[tuple[float, int]] = []
    audio: list[float] = []

    def consume() -> None:
        for pts, frame in sink.frames():
            assert frame.shape == (SIZE, SIZE, 3) and frame.dtype == np.uint8
            got.append((pts, int(np.argmax(frame[0, :, 0]))))

    def consume_audio() -> None:
        audio.extend(pts for pts, _ in sink.audio())

    threads = [threading.Thread(target=consume), threading.Thread(target=consume_audio)]
    for t in threads:
        t.start()
    for k in range(3):
        sink.write_audio(AudioChunk(tone(k * SR, SR), k * SR, SR))
        sink.write_video(VideoChunk(moving_frames(k * 10, 10), k * 10, FPS))
    sink.close()
    for t in threads:
        t.join(timeout=10)
    assert [g[0] for g in got] == [i / FPS for i in range(30)]
    assert [g[1] for g in got] == list(range(30))  # the bar position = the frame index
    assert audio == [0.0, 1.0, 2.0] and sink.durable_frames == 30
    assert list(sink.frames()) == []  # ended for later readers too


def test_raw_sink_abort_ends_iteration():
    sink = RawFrameSink(max_frames=8)
    sink.open(SIZE, SIZE, FPS, SR)
    sink.write_video(VideoChunk(moving_frames(0, 5), 0, FPS))
    sink.abort()
    assert list(sink.frames()) == [] and sink.aborted
