"""Continuity schedules: exact frame counts and timestamps for any audio length.

Generation is simulated: a generated frame carries its timeline position as its value, a given
frame copies its source. Published values must be exactly 0..T-1 once each, in order, and every
given frame must come from a frame at the same timeline position (otherwise continuity would
condition on the wrong moment). Then the clock maps them to video frames and pts.
"""

from __future__ import annotations

import pytest

from avatarstream.engine.clock import MediaClock
from avatarstream.engine.loop import make_schedule
from avatarstream.engine.schedule import SCENE_CHUNK, InterpSchedule, PrefixSchedule
from avatarstream.errors import ConfigError


def simulate(schedule, total_known_at: int | None, total: int) -> tuple[list[int], list[str], int]:
    """Run a schedule; the total becomes known once the horizon passes `total_known_at`."""
    store: dict[int, dict[int, int]] = {}
    emitted: dict[int, list[int]] = {}
    published: list[int] = []
    kinds: list[str] = []
    max_store = 0
    while True:
        known = total if (total_known_at is None or schedule.horizon() >= total_known_at) else None
        plan = schedule.next_chunk(known)
        if plan is None:
            break
        kinds.append(plan.kind)
        values = list(plan.positions)
        for g in plan.given:
            if g.source_chunk == SCENE_CHUNK:  # the scene image, placed at this position
                assert g.index == 0 and plan.kind in ("ref2v", "N"), plan
                continue
            src = store[g.source_chunk][g.source_index]
            assert src == plan.positions[g.index], "given frame from a different timeline position"
            values[g.index] = src
        emitted[plan.id] = values[plan.emit[0]:plan.emit[1]]
        store[plan.id] = {i: values[i] for i in plan.keep}
        for cid in plan.publish:
            published.extend(emitted.pop(cid))
        for cid in plan.release:
            store.pop(cid, None)
        max_store = max(max_store, sum(len(v) for v in store.values()) + sum(map(len, emitted.values())))
        assert len(kinds) < 10_000
    return published, kinds, max_store


@pytest.mark.parametrize("strategy,kw", [("prefix", {"overlap": 2}), ("prefix", {"overlap": 1}),
                                         ("interp", {"gap": 1, "anchor": 1}),
                                         ("interp", {"gap": 0, "anchor": 2}),
                                         ("interp", {"gap": 2, "anchor": 0})])
@pytest.mark.parametrize("chunk", [4, 5, 8])
@pytest.mark.parametrize("scene", [False, True])
def test_timeline_exact_for_any_length(strategy, kw, chunk, scene):
    clock = MediaClock()
    for n_frames in list(range(1, 160)) + [997, 1501]:
        total = clock.latents_for_frames(n_frames)
        for known_at in (None, total):  # known up front, or only when the audio runs out
            sched = make_schedule(strategy, chunk, scene=scene, **kw)
            published, kinds, max_store = simulate(sched, known_at, total)
            # Past the end the last chunk is full-size and trimmed: the pipeline drops positions >= total.
            kept = [p for p in published if p < total]
            assert kept == list(range(total)), (strategy, chunk, n_frames, known_at)
            assert published == list(range(len(published))), "no duplicated or dropped latents"
            # Rolling state (kept latents + refined frames awaiting publication) is bounded by a
            # few chunks, whatever the length.
            assert max_store <= 3 * chunk + 4
            # Video frames and their pts.
            frames = []
            for p in kept:
                a, b = clock.video_span(p)
                frames.extend(range(a, b))
            frames = frames[:n_frames]
            assert frames == list(range(n_frames))
            assert [clock.frame_pts(i) for i in frames] == [i / 25 for i in range(n_frames)]


def test_interp_order():
    sched = InterpSchedule(chunk=6, gap=1, anchor=1)
    _, kinds, _ = simulate(sched, None, 60)
    assert kinds[:7] == ["N", "N", "I", "N", "I", "N", "I"]


def test_prefix_kinds_and_overlap():
    sched = PrefixSchedule(chunk=8, overlap=2)
    first = sched.next_chunk(None)
    second = sched.next_chunk(None)
    assert first.kind == "ref2v" and first.given == ()
    assert second.kind == "prefix2v" and second.given_mask() == [True, True] + [False] * 6
    assert second.positions[:2] == first.positions[-2:]


def test_bad_schedule_config():
    with pytest.raises(ConfigError):
        make_schedule("prefix", 4, overlap=4)
    with pytest.raises(ConfigError):
        make_schedule("nope", 4)
    with pytest.raises(ConfigError):
        make_schedule("interp", 2, anchor=1)


def test_scene_frame_only_in_chunks_made_from_the_reference():
    for strategy in ("prefix", "interp", "causal"):
        sched = make_schedule(strategy, 6, scene=True)
        for _ in range(8):
            plan = sched.next_chunk(None)
            scene = [g for g in plan.given if g.source_chunk == SCENE_CHUNK]
            if strategy != "causal" and plan.kind in ("ref2v", "N"):
                assert scene == [scene[0]] and scene[0].index == 0 and scene[0].source_index == 0
            else:
                assert not scene, plan
