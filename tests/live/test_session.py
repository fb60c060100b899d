"""LiveSession, its speech queue, utterance audio and idle animation, without the server
(tiny-random, one thread, seconds)."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from avatarstream.engine.pipeline import Pipeline
from avatarstream.errors import InputError
from avatarstream.publish.raw import RawFrameSink
from avatarstream.live.idle import IdleAnimator
from avatarstream.live.speech import SpeechQueue
from avatarstream.live.segment import NotReady, UtteranceAudio
from avatarstream.live.session import LiveSession, LiveSessionConfig, TimedFrame, pcm16_to_float

pytestmark = pytest.mark.usefixtures("one_thread")
SR = 16000


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _tone(seconds: float) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (0.5 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    from avatarstream.registry import load_model

    models = load_model("tiny-random")
    models.config.steps = 1
    return models


def test_queue_offer_push_back_pressure_and_clear():
    q = SpeechQueue(max_buffer_s=1.0)
    assert q.offer(np.zeros(SR // 4, np.float32))
    assert not q.offer(np.zeros(SR, np.float32))  # would exceed: nothing queued
    assert q.buffered_seconds == pytest.approx(0.25)
    t0 = time.monotonic()
    assert not q.push(np.zeros(20 * SR, np.float32), timeout=0.05)  # "slow down"
    assert time.monotonic() - t0 < 1.0 and q.buffered == SR and q.peak_buffered == SR
    done = threading.Event()
    threading.Thread(target=lambda: (q.push(np.zeros(SR // 2, np.float32)), done.set()),
                     daemon=True).start()
    assert not done.wait(0.1)  # blocked while full
    assert q.take(SR // 2).size == SR // 2
    assert done.wait(1.0) and q.peak_buffered <= SR
    epoch = q.epoch
    assert q.clear() == pytest.approx(1.0) and q.buffered == 0 and q.epoch == epoch + 1
    assert q.ended  # a cleared utterance is over


def test_queue_script_take_order_idle_timeout_and_close():
    clock = Clock()
    q = SpeechQueue(max_buffer_s=1.0, max_script_s=2.0, idle_timeout_s=5.0, now=clock)
    assert q.say(np.full(SR, 2.0, np.float32))
    assert not q.say(np.zeros(2 * SR, np.float32))  # over the script bound
    q.offer(np.ones(100, np.float32))
    x = q.take(300)
    assert x.size == 300 and np.all(x[:100] == 1) and np.all(x[100:] == 2)  # streamed first
    clock.t += 6.0
    assert not q.check_idle()  # speech still queued: not idle
    q.take(SR)
    clock.t += 6.0
    assert q.check_idle() and q.closed and q.idle_expired
    assert not q.offer(np.zeros(10, np.float32)) and not q.push(np.zeros(10, np.float32))


def test_pcm16_conversion():
    b = np.array([0, 16384, -32768], "<i2").tobytes()
    assert np.allclose(pcm16_to_float(b), [0.0, 0.5, -1.0])
    with pytest.raises(InputError, match="even"):
        pcm16_to_float(b[:-1])


def test_utterance_audio_bridges_pauses_then_ends_on_frame_boundary():
    clock = Clock()
    q = SpeechQueue(now=clock)
    u = UtteranceAudio(q, start_sample=6400, origin=clock.t, lead_s=0.2, packet_s=0.04,
                       hangover_s=0.12, now=clock)
    q.offer(np.ones(1000, np.float32))
    assert next(u).numel() == 640 and next(u).numel() == 360  # speech at once, unpaced
    with pytest.raises(NotReady) as e:  # a pause: silence only when due (media 0.4625 s)
        next(u)
    assert e.value.due == pytest.approx(clock.t + (6400 + 1000) / SR - 0.2)
    clock.t = e.value.due
    pause = 0
    while True:  # hangover 0.12 s of silence, then the end, padded to whole frames
        try:
            x = next(u)
        except NotReady as e2:
            clock.t = e2.due
            continue
        except StopIteration:
            break
        assert torch.all(x == 0)
        pause += x.numel()
    assert u.finished and u.samples % 640 == 0 and u.speech == 1000
    assert 0.12 * SR <= pause <= 0.12 * SR + 640 + 640


def test_utterance_audio_ends_at_interrupt_and_at_end_of_speech():
    clock = Clock()
    q = SpeechQueue(now=clock)
    q.offer(np.ones(SR, np.float32))
    u = UtteranceAudio(q, start_sample=0, origin=clock.t, lead_s=0.2, now=clock)
    next(u)
    q.clear()
    q.offer(np.ones(SR, np.float32))  # a new utterance: not this one's
    tail = [x.numel() for x in u]
    assert u.interrupted and sum(tail) == 0 and u.samples == 640
    q2 = SpeechQueue(now=clock)
    q2.offer(np.ones(700, np.float32))
    q2.end_of_speech()
    u2 = UtteranceAudio(q2, start_sample=0, origin=clock.t, lead_s=0.2, now=clock)
    assert sum(x.numel() for x in u2) == 1280 and not u2.interrupted


def test_idle_animation_is_small_smooth_and_deterministic():
    from avatarstream.bench.inputs import face_image

    img = torch.from_numpy(face_image(64)).permute(2, 0, 1)[None]  # [1, 3, 64, 64]
    anim = IdleAnimator(img)
    f = anim.frames(0, 50).astype(np.float32)
    assert f.shape == (50, 64, 64, 3)
    assert np.array_equal(anim.frames(10, 5), f[10:15].astype(np.uint8))  # any frame, any time
    ref = img[0].permute(1, 2, 0).numpy().astype(np.float32)
    assert np.abs(f - ref).mean() < 8  # the reference, moving a little
    step = np.abs(np.diff(f, axis=0)).mean()
    assert 0 < step < 1.5  # alive, and smooth from frame to frame


def test_live_session_idles_speaks_and_interrupts(tiny):
    """One session: idle video at real time with silence -> speech -> interrupt -> idle."""
    c = tiny.config
    chunk_s = 4 * c.chunk / c.fps
    ref = torch.randint(0, 255, (1, 3, c.hr_size, c.hr_size), dtype=torch.uint8)
    cfg = LiveSessionConfig(lead_s=0.2, idle_timeout_s=5.0)
    session = LiveSession(tiny, ref, config=cfg)
    video: list[tuple[float, TimedFrame]] = []
    audio: list[TimedFrame] = []
    marks: dict[str, float] = {}

    async def consume() -> None:
        async for item in session.frames(poll_s=0.05):
            if item.kind == "video":
                video.append((time.monotonic(), item))
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
        time.sleep(0.6)
        marks["clear_pts"] = video[-1][1].pts  # what has been published at the interrupt
        marks["dropped_s"] = session.clear_buffer()
        time.sleep(1.5)  # idle again
        session.stop()

    session.start()
    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    asyncio.run(asyncio.wait_for(consume(), timeout=30))
    driver.join(5)
    assert session.error is None and not session.running

    pts = np.array([f.pts for _, f in video])
    assert np.allclose(np.diff(pts), 1 / c.fps)  # every frame, one clock, 25 fps
    # Real-time pacing: the timeline never runs ahead of the wall clock by more than the lead
    # plus one chunk, and never falls behind it by more than a chunk (the stream does not stall).
    w0, p0 = video[0][0], video[0][1].pts
    drift = np.array([(f.pts - p0) - (w - w0) for w, f in video])
    assert drift.max() < cfg.lead_s + chunk_s + 0.15, drift.max()
    assert drift.min() > -(chunk_s + 0.3), drift.min()
    assert video[-1][0] - w0 > 3.0
    # Audio: contiguous on the same clock; silent, then the speech, then silent after the cut.
    a_pts = np.concatenate([a.pts + np.arange(a.data.size) / SR for a in audio])
    a_val = np.concatenate([a.data for a in audio])
    assert np.allclose(np.diff(a_pts), 1 / SR, atol=1e-6)
    loud = np.flatnonzero(np.abs(a_val) > 0.1)
    assert loud.size and a_pts[loud[0]] > 0.5
    assert marks["dropped_s"] > 1.0
    interrupt_latency = a_pts[loud[-1]] - marks["clear_pts"]
    assert interrupt_latency <= chunk_s + cfg.lead_s + 0.1, interrupt_latency
    assert a_pts[-1] > a_pts[loud[-1]] + 0.5
    # The video talks (the model's frames) only while there is speech; idle frames are the
    # animated reference: small, smooth change (apart from the dissolves into and out of the
    # model's frames: `ease_s` before speech, the animator's blend after it).
    ev = {e["type"]: e for e in session.events}
    start, end = ev["speech_started"]["media_s"], ev["speech_ended"]["media_s"]
    assert ev["speech_ended"]["interrupted"] and start <= a_pts[loud[0]] + 1e-3
    frames = np.stack([f.data for _, f in video]).astype(np.float32)
    change = np.abs(np.diff(frames, axis=0)).mean(axis=(1, 2, 3))  # [N-1]
    t = pts[1:]
    talk = change[(t > start + 0.1) & (t < end - 0.05)]
    idle = change[(t < start - cfg.ease_s - 0.05) | (t > end + 0.45)]
    assert talk.size and idle.size and idle.max() < talk.mean() / 10
    shown = next(w for w, f in video if f.pts >= a_pts[loud[0]])
    print(f"\nlive: drift {drift.min():+.2f}..{drift.max():+.2f} s, first speech frame "
          f"{shown - marks['push_wall']:.2f} s after push, interrupt latency "
          f"{interrupt_latency:.2f} s (chunk {chunk_s:.2f} s)")


@pytest.mark.parametrize("strategy", ["prefix", "causal"])
def test_talk_segment_equals_the_pipeline_on_the_same_speech(tiny, strategy):
    """Prepared reference + stepped, scheduled chunk loop == Pipeline.run (frames and audio), for
    a prefix model (batchable stages) and a causal one (its block stage, run unbatched)."""
    import dataclasses

    tiny = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, strategy=strategy))
    c = tiny.config
    ref = torch.randint(0, 255, (1, 3, c.hr_size, c.hr_size), dtype=torch.uint8)
    speech = _tone(1.3)
    cap = Capture()
    session = LiveSession(tiny, ref, config=LiveSessionConfig(lead_s=5.0, idle_timeout_s=None),
                          sinks=[cap])
    session.start()
    while session.frame < 5:  # idle a little first: the utterance starts mid-timeline
        time.sleep(0.01)
    session.say(speech)
    deadline = time.monotonic() + 20
    while not any(e["type"] == "speech_ended" for e in session.events):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    session.stop()
    ev = {e["type"]: e for e in session.events}
    f0, f1 = ev["speech_started"]["frame"], ev["speech_ended"]["frame"]
    assert f1 - f0 == -(-speech.size // 640)  # the utterance, rounded up to whole frames
    # The same speech through the engine's own loop.
    sink = RawFrameSink(max_frames=10_000, with_audio=True)
    sink.open(c.hr_size, c.hr_size, c.fps, c.sample_rate)
    padded = np.concatenate([speech, np.zeros((-speech.size) % 640, np.float32)])
    Pipeline(tiny).run(ref, iter(torch.from_numpy(padded).split(640)), [sink])
    sink.close()
    want = np.stack([f for _, f in sink.frames()])
    assert want.shape[0] == f1 - f0
    got = np.stack([cap.frames[i] for i in range(f0, f1)])
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1  # fp32: equal up to rounding
    heard = np.concatenate([x for _, x in sorted(cap.audio.items())])
    assert np.allclose(heard[f0 * 640 : f0 * 640 + speech.size], speech)
    assert not heard[: f0 * 640].any() and not heard[f0 * 640 + speech.size :].any()


class Capture:
    """A sink keeping every frame by index and every audio chunk by start sample."""

    durable_frames = 0

    def __init__(self) -> None:
        self.frames: dict[int, np.ndarray] = {}
        self.audio: dict[int, np.ndarray] = {}

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        pass

    def write_video(self, chunk) -> None:  # type: ignore[no-untyped-def]
        for i, f in enumerate(chunk.frames):
            self.frames[chunk.start_frame + i] = f

    def write_audio(self, chunk) -> None:  # type: ignore[no-untyped-def]
        self.audio[chunk.start_sample] = chunk.samples

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def test_streamed_silence_is_a_pause_not_speech(tiny):
    """A microphone sends silence between utterances: the avatar idles through it, and a long
    silent stretch inside streamed speech ends the utterance."""
    c = tiny.config
    ref = torch.randint(0, 255, (1, 3, c.hr_size, c.hr_size), dtype=torch.uint8)
    session = LiveSession(tiny, ref, config=LiveSessionConfig(idle_timeout_s=None, hangover_s=0.3))
    session.start()
    try:
        session.push_audio(np.zeros(SR // 2, np.float32))  # silence only: stays idle
        time.sleep(0.4)
        assert session.segments == 0 and session.queue.buffered < SR // 4
        # speech, 1 s of (near) silence, speech: two utterances, idle in between
        quiet = 0.001 * np.random.default_rng(0).standard_normal(SR).astype(np.float32)
        session.push_audio(np.concatenate([_tone(0.5), quiet, _tone(0.5)]))
        deadline = time.monotonic() + 15
        while sum(e["type"] == "speech_ended" for e in session.events) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        session.stop()
    ends = [e for e in session.events if e["type"] == "speech_ended"]
    starts = [e for e in session.events if e["type"] == "speech_started"]
    assert len(starts) == 2 and starts[1]["frame"] >= ends[0]["frame"]
    assert all(0.45 <= e["speech_s"] <= 0.6 for e in ends), ends
