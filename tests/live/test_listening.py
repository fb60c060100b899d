"""Attentive listening: the idle animator's listening motion, its blends, and the session's ease
into and out of speech (the still reference on both sides of every model frame)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from avatarstream.bench.inputs import face_image
from avatarstream.live.idle import IdleAnimator
from avatarstream.live.session import LiveSession, LiveSessionConfig

pytestmark = pytest.mark.usefixtures("one_thread")
FPS = 25


@pytest.fixture(scope="module")
def img() -> torch.Tensor:
    return torch.from_numpy(face_image(96)).permute(2, 0, 1)[None]  # [1, 3, 96, 96]


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    from avatarstream.registry import load_model

    models = load_model("tiny-random", bf16=False)
    models.config.steps = 2
    return models


class Capture:
    """A sink keeping every frame by index."""

    durable_frames = 0

    def __init__(self) -> None:
        self.frames: dict[int, np.ndarray] = {}

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        pass

    def write_video(self, chunk) -> None:  # type: ignore[no-untyped-def]
        for i, f in enumerate(chunk.frames):
            self.frames[chunk.start_frame + i] = f

    def write_audio(self, chunk) -> None:  # type: ignore[no-untyped-def]
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _change(frames: np.ndarray) -> np.ndarray:
    """Mean absolute change into each frame [N - 1] (0-255)."""
    return np.abs(np.diff(frames.astype(np.float32), axis=0)).mean((1, 2, 3))


def test_listening_shows_attentive_motion_and_switches_continuously(img):
    idle = IdleAnimator(img).frames(0, 400)
    anim = IdleAnimator(img)
    on, off = 60, 300
    anim.set_mode("listening", on)
    anim.set_mode("idle", off)
    seq = np.concatenate([anim.frames(i, 25) for i in range(0, 400, 25)])  # rendered in pieces
    assert np.array_equal(seq[:on], idle[:on])  # before the switch: the idle frames themselves
    blend = anim.blend
    steady = slice(on + blend, off)
    # attentive motion is there: the head lowers (nods), leans in and turns to the viewer
    apart = np.abs(seq[steady].astype(np.float32) - idle[steady]).mean((1, 2, 3))
    assert apart.min() > 0.4, apart.min()  # every listening frame (measured: 0.68 .. 1.2)
    ref = img[0].permute(1, 2, 0).numpy().astype(np.float32)
    dev_idle = np.abs(idle[steady] - ref).mean()
    dev_listen = np.abs(seq[steady] - ref).mean()
    assert dev_listen > 1.3 * dev_idle, (dev_listen, dev_idle)  # measured: 1.6x
    # continuous: the change at and after each switch is no larger than steady listening's
    change = _change(seq)  # change[i]: frame i -> i + 1
    steady_max = change[on + blend:off - 1].max()
    for at in (on, off):
        around = change[at - 2:at + blend + 2].max()
        assert around <= steady_max * 1.1 + 0.05, (at, around, steady_max)
    assert np.array_equal(seq[off + blend + 5:], idle[off + blend + 5:])  # idle again, exactly
    print(f"\nlistening: deviation {dev_listen:.2f} vs idle {dev_idle:.2f}; max change steady "
          f"{steady_max:.3f}, at on {change[on - 2:on + blend + 2].max():.3f}, "
          f"at off {change[off - 2:off + blend + 2].max():.3f}")


def test_animator_is_deterministic_and_rest_is_the_still_reference(img):
    def run() -> IdleAnimator:
        a = IdleAnimator(img)
        a.set_mode("listening", 10)
        a.set_mode("rest", 40, frames=8)
        a.set_mode("listening", 60)
        return a

    a, b = run(), run()
    fa = a.frames(0, 100)
    assert np.array_equal(fa, b.frames(0, 100))
    assert np.array_equal(fa[70:90], b.frames(70, 20))  # any frame, any time, any order
    still = img[0].permute(1, 2, 0).numpy()
    assert np.array_equal(fa[48], still) and np.array_equal(fa[59], still)  # rest: no warp
    assert not np.array_equal(fa[47], still)  # the ease reaches it at its last frame
    assert a.mode == "listening"
    with pytest.raises(ValueError, match="unknown mode"):
        a.set_mode("sleeping", 100)


def test_speech_is_entered_and_left_through_dissolves(tiny):
    """Before the first model frame the idle motion eases to the reference and dissolves into
    that frame (`ease_s`); after the last one the idle frames dissolve out of it: the model's
    jump away from the reference is spread over the dissolve instead of one frame."""
    c = tiny.config
    ref = torch.from_numpy(face_image(c.hr_size)).permute(2, 0, 1)[None]
    cap = Capture()
    cfg = LiveSessionConfig(lead_s=0.2, idle_timeout_s=None)
    session = LiveSession(tiny, ref, config=cfg, sinks=[cap])
    session.start()
    try:
        while session.frame < 20:
            time.sleep(0.01)
        session.listen(True)
        time.sleep(0.8)
        session.listen(False)
        said = session.frame
        t = np.arange(round(0.8 * c.sample_rate)) / c.sample_rate
        session.say((0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32))
        deadline = time.monotonic() + 20
        while not any(e["type"] == "speech_ended" for e in session.events):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        end = next(e["frame"] for e in session.events if e["type"] == "speech_ended")
        while session.frame < end + 15:
            time.sleep(0.01)
    finally:
        session.stop()
    assert session.error is None
    start = next(e["frame"] for e in session.events if e["type"] == "speech_started")
    ease = round(cfg.ease_s * c.fps)
    assert ease <= start - said <= ease + round(cfg.lead_s * c.fps) + 4  # the ease, no more
    f = {i: x.astype(np.float32) for i, x in cap.frames.items()}
    still = ref[0].permute(1, 2, 0).numpy().astype(np.float32)
    jump_in = np.abs(f[start] - still).mean()  # what a cut from the reference would show
    jump_out = np.abs(f[end - 1] - still).mean()
    assert jump_in > 10 and jump_out > 10  # the random model's frames are far from the face
    assert np.abs(f[start - 1] - f[start]).mean() < 0.1 * jump_in  # into its first frame
    assert np.abs(f[end] - f[end - 1]).mean() < 0.1 * jump_out  # out of its last frame
    steps_in = _change(np.stack([f[i] for i in range(start - ease - 1, start + 1)]))
    steps_out = _change(np.stack([f[i] for i in range(end - 1, end + 12)]))
    assert steps_in.max() < 0.35 * jump_in and steps_out.max() < 0.35 * jump_out
    print(f"\ndissolves: largest step in {steps_in.max():.1f} (cut {jump_in:.1f}), "
          f"out {steps_out.max():.1f} (cut {jump_out:.1f})")
