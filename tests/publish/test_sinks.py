"""The sinks: the fragmented MP4 is playable while it is written and survives SIGKILL, HLS grows
and decodes, the raw sink iterates in order; aborts leave nothing behind; unwritable paths are
one clear error."""

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

from avatarstream.errors import OutputError
from avatarstream.media.audio import read_all
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.publish.file import FragmentedMP4Sink, check_writable
from avatarstream.publish.hls import HLSSink
from avatarstream.publish.raw import RawFrameSink

FPS, SR, SIZE = 25, 16000, 64


# -- inputs made on the fly ----------------------------------------------------------------------
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
