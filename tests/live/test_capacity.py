"""Capacity calibration on a machine measured slower than real time (a slow machine, or a busy one
at start-up): the measurement is scripted here (our own `measure_steps` and `encode_load`), the
rest is the real code. Before issue 37 such a server calibrated to `max_sessions: 0` and refused
every session for its whole life, with no word at start."""

from __future__ import annotations

import logging

import pytest

from avatarstream.live import capacity


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    from avatarstream.registry import load_model

    return load_model("tiny-random", bf16=False)


def _scripted(monkeypatch, one: float, two: float, media: float = 0.8, encode: float = 0.05) -> None:
    """measure_steps answers `one` / `two` seconds a round for one / two sessions."""
    monkeypatch.setattr(capacity, "measure_steps", lambda models, prepared, n, **kw: (one if n == 1 else two, media))
    monkeypatch.setattr(capacity, "encode_load", lambda size: encode)


def test_a_machine_slower_than_real_time_admits_one_session_and_says_why(tiny, monkeypatch, caplog):
    from avatarstream.live.scheduler import ChunkScheduler

    _scripted(monkeypatch, one=2.0, two=3.0)  # a 0.8 s chunk takes 2 s: 2.55x too slow with the encode
    with caplog.at_level(logging.WARNING, logger="avatarstream.live.capacity"):
        cap = capacity.calibrate(tiny, None)  # type: ignore[arg-type]
    assert cap.load(1) == pytest.approx(2.0 / 0.8 + 0.05)
    assert cap.max_sessions == 1 and not cap.real_time and cap.as_dict()["real_time"] is False
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1
    fps = tiny.config.fps / cap.load(1)
    assert f"measured {fps:.1f} fps for one live session" in warning[0]
    assert f"{tiny.config.fps} fps are needed" in warning[0] and "--max-sessions" in warning[0]
    assert f"one session runs at {fps:.1f} fps of the {tiny.config.fps} needed" in cap.describe(tiny.config.fps)
    sched = ChunkScheduler(tiny, capacity=cap)
    assert sched.admit() is None  # the first session is served, not refused forever


def test_a_machine_in_real_time_is_measured_without_a_warning(tiny, monkeypatch, caplog):
    _scripted(monkeypatch, one=0.2, two=0.3)
    with caplog.at_level(logging.WARNING, logger="avatarstream.live.capacity"):
        cap = capacity.calibrate(tiny, None)  # type: ignore[arg-type]
    assert cap.real_time and cap.max_sessions >= 2 and not caplog.records
    assert capacity.Capacity(3).describe(25) == "capacity: 3 live sessions at once (set by --max-sessions)"
