"""The live scheduler runs the engine's stages on a batch of sessions: batched chunk work equals
each session alone (a batch of one, the file render's path); prepared references round-trip
through disk; the scheduler runs on any executor (a scripted fake here). tiny-random, fp32, one
thread."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from avatarstream.bench.inputs import speechlike
from avatarstream.models.transformer import DiTCondition
from avatarstream.cache.reference import ReferenceCache
from avatarstream.engine.executor import LocalExecutor
from avatarstream.engine.pipeline import default_stages
from avatarstream.live.prepared import load_prepared, prepare_reference, save_prepared
from avatarstream.live.scheduler import ChunkScheduler
from avatarstream.live.segment import TalkSegment

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    """fp32 whatever the CPU (as `tiny_direct`): these tests prove the scheduler's batching is
    the solo computation. Under bf16 autocast (CPUs with AVX512-bf16) a batch's matmuls round
    differently from a single session's, and through the random tiny direct DiT that reached 38/255
    in a few pixels, a precision matter, not the scheduler's."""
    from avatarstream.registry import load_model

    models = load_model("tiny-random", bf16=False)
    models.config.steps = 2
    return models


def _refs(tiny):  # type: ignore[no-untyped-def]
    c = tiny.config
    g = torch.Generator().manual_seed(3)
    image = torch.randint(0, 255, (1, 3, c.hr_size, c.hr_size), dtype=torch.uint8, generator=g)
    video = torch.randint(0, 255, (c.ref_pixel_frames, 3, c.hr_size, c.hr_size), dtype=torch.uint8,
                          generator=g)
    video[1:5] = 0  # a blank stretch: the reference keeps fewer frames
    return prepare_reference(tiny, image), prepare_reference(tiny, video)


class Outlet:
    def __init__(self) -> None:
        self.frames: dict[int, np.ndarray] = {}

    def put_video(self, frames: np.ndarray, start_frame: int, fps: int) -> None:
        for i, f in enumerate(frames):
            self.frames[start_frame + i] = f

    def put_audio(self, samples: np.ndarray, start_sample: int, sample_rate: int) -> None:
        pass


def _segments(tiny, prepared, seconds):  # type: ignore[no-untyped-def]
    text, mask = tiny.text.call("encode", [""])
    out = []
    for i, (p, s) in enumerate(zip(prepared, seconds)):
        audio = torch.from_numpy(speechlike(s, seed=i))
        outlet = Outlet()
        out.append((TalkSegment(tiny, p, text, mask, iter(audio.split(640)), outlet,
                                start_frame=0), outlet))
    return out


def test_stacked_references_are_exact_with_masked_padding(tiny):
    image, video = _refs(tiny)
    assert image.dit.num_frames < video.dit.num_frames  # blank frames were dropped, not masked
    stacked = ReferenceCache.stack([image.dit, video.dit])
    assert stacked.batch == 2 and stacked.num_frames == video.dit.num_frames
    assert stacked.key_valid is not None and not bool(stacked.key_valid[0].all())
    c, dit = tiny.config, tiny.dit.model
    h, t = c.lr_size // 8, c.chunk
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, c.latent_channels, t, h, h, generator=g)
    text, mask = tiny.text.call("encode", ["", ""])
    cond = DiTCondition(motion=torch.randn(2, t, c.motion_dim, generator=g),
                        audio=torch.randn(2, t, dit.config.audio_tokens, dit.config.audio_dim,
                                          generator=g),
                        text=text, text_mask=mask, t_pos=torch.arange(t, dtype=torch.float32))
    sigma = torch.rand(2, t, generator=g)
    with torch.inference_mode():
        both = dit(x, sigma, cond, stacked)
        for i, ref in enumerate([image.dit, video.dit]):
            one = dit(x[i : i + 1], sigma[i : i + 1], DiTCondition(
                motion=cond.motion[i : i + 1], audio=cond.audio[i : i + 1], text=text[i : i + 1],
                text_mask=None if mask is None else mask[i : i + 1], t_pos=cond.t_pos), ref)
            torch.testing.assert_close(both.velocity[i : i + 1], one.velocity, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def tiny_direct():  # type: ignore[no-untyped-def]
    """tiny-random as a direct model: the DiT at the output latents (4x4 patches, x0 skip), no
    refiner."""
    import dataclasses

    from avatarstream import registry
    from avatarstream.models.dit import DiTConfig

    base = registry.MODELS["tiny-random"]
    spec = dataclasses.replace(
        base, name="tiny-direct-test", refiner=None,
        dit=lambda: dataclasses.replace(DiTConfig.tiny(), patch=(1, 4, 4), x0_skip=True),
        pipeline=lambda: dataclasses.replace(base.pipeline(), lr_size=base.pipeline().hr_size, steps=2))
    registry.MODELS[spec.name] = spec
    try:
        return registry.load_model(spec.name, bf16=False)
    finally:
        del registry.MODELS[spec.name]


@pytest.mark.parametrize("kind,overlap", [("plain", False), ("plain", True), ("direct", True),
                                          ("guided", True), ("stochastic", True), ("interp", True),
                                          ("split", True)])
def test_batched_sessions_equal_sessions_run_alone(tiny, tiny_direct, kind, overlap):
    """Three segments (image and video references, different speech and lengths, one joining
    late) batched by the scheduler produce the frames each produces alone; with the decode on
    the scheduler's decode thread (overlap) as well; for a direct model (no refiner), with
    classifier-free guidance of a model not distilled (two DiT passes a step), the stochastic
    sampler and the interp schedule too; and with the decode in two parts on two threads
    (split: each part stacks and splits its own layers of the sessions' caches)."""
    import dataclasses

    if kind == "direct":
        tiny = tiny_direct
    elif kind == "guided":
        tiny = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, audio_scale=2.5))
    elif kind == "stochastic":  # per-row generators: each session draws what it draws alone
        tiny = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, sampler="stochastic"))
    elif kind == "interp":  # chunks that publish other chunks: decode groups kept in order
        tiny = dataclasses.replace(tiny, config=dataclasses.replace(tiny.config, strategy="interp"))
    image, video = _refs(tiny)
    refs, secs = [image, video, image], [1.7, 2.3, 1.1]
    alone = _segments(tiny, refs, secs)
    solo = LocalExecutor(default_stages(tiny, tiny.config))
    for seg, _ in alone:
        while (rec := seg.plan()) is not None:
            solo.run([(rec, seg.state)])  # a batch of one: a file render's path
            seg.finish(rec)
    together = _segments(tiny, refs, secs)
    sched = ChunkScheduler(tiny, decode_overlap=overlap, executor=None if kind != "split" else LocalExecutor(
        default_stages(tiny, tiny.config), decode_overlap=True, decode_split=True))
    batches = []
    step = 0
    while not all(seg.done for seg, _ in together):
        items = []
        for i, (seg, _) in enumerate(together):
            if seg.done or (i == 2 and step < 2):  # the third one starts two steps later
                continue
            rec = seg.plan()
            if rec is not None:
                items.append((rec, seg))
        batches.append(len(items))
        sched.run_items(items)
        step += 1
    sched.stop()  # waits for the decode thread
    assert max(batches) == 3  # shapes differed (reference lengths, first vs later chunks)
    for (_, a), (_, b) in zip(alone, together):
        assert sorted(a.frames) == sorted(b.frames) and len(a.frames) > 20
        fa = np.stack([a.frames[k] for k in sorted(a.frames)]).astype(int)
        fb = np.stack([b.frames[k] for k in sorted(b.frames)]).astype(int)
        assert np.abs(fa - fb).max() <= 1, np.abs(fa - fb).max()


def test_prepared_reference_round_trips_through_disk(tiny, tmp_path):
    _, video = _refs(tiny)
    save_prepared(video, tmp_path / "ref.safetensors")
    back = load_prepared(tmp_path / "ref.safetensors")
    assert back.model == tiny.name
    for a, b in [(video.dit, back.dit), (video.refiner, back.refiner)]:
        assert a.tokens_per_frame == b.tokens_per_frame and len(a.k) == len(b.k)
        for x, y in zip([*a.k, *a.v, a.motion, a.t_pos], [*b.k, *b.v, b.motion, b.t_pos]):
            assert torch.equal(x, y)
        assert (a.key_valid is None) == (b.key_valid is None)
    assert torch.equal(video.scene_lr, back.scene_lr) and torch.equal(video.scene_motion, back.scene_motion)
    assert not list(tmp_path.glob("*.tmp"))


def test_capacity_admits_the_first_session_in_real_time_and_more_within_the_margin():
    from avatarstream.live.capacity import Capacity

    # load(n) = (base + n * per) / chunk + n * encode
    cap = Capacity(0, step_base_s=0.1, step_per_session_s=0.7, chunk_media_s=1.0, encode_load=0.1,
                   target_load=0.8)
    assert cap.load(1) == pytest.approx(0.9)
    assert cap.admissible() == 1  # over the margin, but real time: nobody else to slow down
    cap.step_per_session_s = 0.85
    assert cap.load(1) > 1.0 and cap.admissible() == 0  # cannot keep even one in real time
    cap.step_per_session_s = 0.2
    assert [round(cap.load(n), 2) for n in (1, 2, 3)] == [0.4, 0.7, 1.0]
    assert cap.admissible() == 2 and cap.admissible(limit=1) == 1


def test_measure_steps_counts_the_overlapped_decode(tiny, monkeypatch):
    """The server's calibration times whole rounds: a decode slower than the denoising, running
    on the decode thread, sets the step time (timing the scheduler's calls alone missed it)."""
    import time

    from avatarstream.engine.stages import decode_publish as batch
    from avatarstream.live.capacity import measure_steps

    prepared = _refs(tiny)[0]
    fast, media = measure_steps(tiny, prepared, 1)
    run = batch.DecodeJob.run

    def slow(self):  # type: ignore[no-untyped-def]
        time.sleep(0.4)
        return run(self)

    monkeypatch.setattr(batch.DecodeJob, "run", slow)
    step, media2 = measure_steps(tiny, prepared, 1)
    assert media2 == media > 0
    assert step >= 0.4 > fast, (fast, step)


class ScriptedExecutor:
    """A fake executor: records the batches it is given, writes nothing but what the loop needs
    (every chunk "publishes" its frames at once), and fails the session it is told to."""

    stages: list = []

    def __init__(self, fail_at: int | None = None) -> None:
        self.batches: list[int] = []
        self.fail_at = fail_at
        self.pending: list = []

    def run(self, items):  # type: ignore[no-untyped-def]
        self.batches.append(len(items))
        for rec, state in items:
            n = 4 * len(rec.plan.publish) * (rec.plan.emit[1] - rec.plan.emit[0])
            end = state.frames_emitted + n
            state.frames_emitted = end if state.total_frames is None else min(end, state.total_frames)
            state.frames_published = state.frames_emitted
        if self.fail_at is not None and len(self.batches) == self.fail_at:
            self.pending.append((RuntimeError("decode failed"), [items[0][1]]))

    def wait(self) -> None:
        pass

    def failures(self):  # type: ignore[no-untyped-def]
        out, self.pending = self.pending, []
        return out

    def close(self) -> None:
        pass


def test_scheduler_runs_any_executor_and_drops_only_the_failed_session(tiny):
    """The executor seam: the scheduler plans, a scripted executor runs; a background failure
    reported for one session's state ends that session only."""
    from avatarstream.live.scheduler import ChunkScheduler

    image, video = _refs(tiny)
    segs = _segments(tiny, [image, video], [1.5, 1.5])
    fake = ScriptedExecutor(fail_at=2)
    sched = ChunkScheduler(tiny, executor=fake)
    dropped = []

    class Owner:  # what the scheduler asks of a LiveSession when it drops one
        def __init__(self, seg):  # type: ignore[no-untyped-def]
            self.segment, self.finished, self.queue = seg, False, None

        def finalize(self, error):  # type: ignore[no-untyped-def]
            dropped.append((self.segment, error))

    owners = [Owner(seg) for seg, _ in segs]
    sched._sessions.extend(owners)  # noqa: SLF001 - the sessions a server would have added
    while not all(seg.done for seg, _ in segs):
        items = [(rec, seg) for seg, _ in segs if not seg.done and (rec := seg.plan()) is not None]
        if items:
            sched.run_items(items)
    assert fake.batches[:2] == [2, 2]  # both sessions planned into each batch
    assert [d[0] for d in dropped] == [segs[0][0]] and str(dropped[0][1]) == "decode failed"
