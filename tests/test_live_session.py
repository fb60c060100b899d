"""LiveSession and its audio source, without the server (tiny-random, one thread, seconds)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from avatarstream.serve.live_audio import LiveAudioSource
from avatarstream.serve.session import LiveSession, LiveSessionConfig, TimedFrame, pcm16_to_float

pytestmark = pytest.mark.usefixtures("one_thread")
SR = 16000


def test_source_feeds_paced_silence_when_no_speech():
    src = LiveAudioSource(packet_s=0.04, lead_s=0.1)
    t0 = time.monotonic()
    got = 0
    while time.monotonic() - t0 < 0.5:
        got += next(src).numel()
    media = got / SR
    assert 0.5 <= media <= 0.5 + 0.1 + 0.04 + 0.05  # real time + lead (+ one packet, scheduling)
    assert src.speech_emitted == 0


def test_source_speech_first_then_silence_and_clear():
    src = LiveAudioSource(packet_s=0.01, lead_s=0.0)
    assert src.push(np.ones(480, np.float32))
    x = torch.cat([next(src) for _ in range(3)])
    assert torch.all(x == 1) and x.numel() == 480
    assert src.push(np.ones(SR, np.float32))
    assert src.clear() == pytest.approx(1.0)
    assert torch.all(next(src) == 0)  # interrupted: silence right away


def test_source_back_pressure_bounds_the_buffer():
    src = LiveAudioSource(max_buffer_s=1.0)
    t0 = time.monotonic()
    assert not src.push(np.zeros(20 * SR, np.float32), timeout=0.05)  # "slow down"
    assert time.monotonic() - t0 < 1.0
    assert src.buffered_seconds == pytest.approx(1.0) and src.peak_buffered == SR
    # A blocking push completes as the pipeline side consumes.
    done = threading.Event()
    threading.Thread(target=lambda: (src.push(np.zeros(SR // 2, np.float32)), done.set()),
                     daemon=True).start()
    assert not done.wait(0.1)
    for _ in range(20):
        next(src)
    assert done.wait(1.0)
    assert src.peak_buffered <= SR


def test_source_close_and_idle_timeout():
    src = LiveAudioSource(idle_timeout_s=0.2, lead_s=0.0)
    t0 = time.monotonic()
    with pytest.raises(StopIteration):
        while True:
            next(src)
    assert src.idle_expired and 0.2 <= time.monotonic() - t0 < 1.0
    assert not src.push(np.zeros(10, np.float32))  # ended: nothing queued
    src2 = LiveAudioSource()
    src2.close()
    with pytest.raises(StopIteration):
        next(src2)


def test_pcm16_conversion():
    b = np.array([0, 16384, -32768], "<i2").tobytes()
    assert np.allclose(pcm16_to_float(b), [0.0, 0.5, -1.0])
    from avatarstream.errors import InputError
    with pytest.raises(InputError, match="even"):
        pcm16_to_float(b[:-1])


def _tone(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.5 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


def test_live_session_idles_speaks_and_interrupts():
    """One session: idle video at real time with silent audio -> speech -> interrupt -> idle."""
    from avatarstream.registry import load_model

    models = load_model("tiny-random")
    models.config.steps = 1
    c = models.config
    chunk_s = 4 * c.chunk / c.fps
    ref = torch.randint(0, 255, (1, 3, c.hr_size, c.hr_size), dtype=torch.uint8)
    cfg = LiveSessionConfig(lead_s=0.2, idle_timeout_s=5.0)
    session = LiveSession(models, ref, config=cfg)
    video: list[tuple[float, float]] = []  # (wall time received, pts)
    audio: list[TimedFrame] = []
    marks: dict[str, float] = {}

    async def consume() -> None:
        async for item in session.frames(poll_s=0.05):
            if item.kind == "video":
                video.append((time.monotonic(), item.pts))
            else:
                audio.append(item)

    def drive() -> None:
        while not video:
            time.sleep(0.01)
        time.sleep(1.0)  # idle
        marks["push_wall"] = time.monotonic()
        session.push_audio((_tone(3.0) * 32767).astype("<i2").tobytes())
        while not any(np.abs(a.data).max() > 0.1 for a in audio):
            time.sleep(0.01)
        marks["speech_wall"] = time.monotonic()
        time.sleep(0.6)
        marks["clear_pts"] = video[-1][1]  # what a viewer sees at the interrupt
        marks["dropped_s"] = session.clear_buffer()
        time.sleep(1.5)  # idle again
        session.stop()

    session.start()
    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    asyncio.run(asyncio.wait_for(consume(), timeout=30))
    driver.join(5)
    assert session.error is None and not session.running

    pts = np.array([p for _, p in video])
    assert np.allclose(np.diff(pts), 1 / c.fps)  # every frame, one clock, 25 fps
    # Real-time pacing: media time never runs ahead of the wall clock by more than the lead plus
    # one chunk, and never falls behind it by more than a chunk (the stream does not stall).
    w0, p0 = video[0]
    drift = np.array([(p - p0) - (w - w0) for w, p in video])
    assert drift.max() < cfg.lead_s + chunk_s + 0.15, drift.max()
    assert drift.min() > -(chunk_s + 0.3), drift.min()
    assert video[-1][0] - w0 > 3.0  # idle + speech + idle: the stream kept going
    # Audio track: silent before speech, loud during it, silent again after the interrupt.
    a_pts = np.concatenate([a.pts + np.arange(a.data.size) / SR for a in audio])
    a_val = np.concatenate([a.data for a in audio])
    assert np.allclose(np.diff(a_pts), 1 / SR, atol=1e-6)  # contiguous on the same clock
    loud = np.flatnonzero(np.abs(a_val) > 0.1)
    assert loud.size and a_pts[loud[0]] > 0.5  # idle silence first
    assert marks["dropped_s"] > 1.0
    interrupt_latency = a_pts[loud[-1]] - marks["clear_pts"]
    assert interrupt_latency <= chunk_s + cfg.lead_s + 0.1, interrupt_latency
    assert a_pts[-1] > a_pts[loud[-1]] + 0.5  # the stream went on in silence
    # Time from the first audio packet to the first frame showing it (wall, on this CPU).
    first_speech_pts = a_pts[loud[0]]
    shown = next(w for w, p in video if p >= first_speech_pts)
    assert shown - marks["push_wall"] < 3.0
    print(f"\nlive: drift {drift.min():+.2f}..{drift.max():+.2f} s, first speech frame "
          f"{shown - marks['push_wall']:.2f} s after push, interrupt latency "
          f"{interrupt_latency:.2f} s (chunk {chunk_s:.2f} s), dropped {session.dropped}")


def test_source_offer_is_all_or_nothing():
    src = LiveAudioSource(max_buffer_s=0.5)
    assert src.offer(np.zeros(SR // 4, np.float32))
    assert not src.offer(np.zeros(SR // 2, np.float32))  # would exceed: nothing queued
    assert src.buffered_seconds == pytest.approx(0.25)
