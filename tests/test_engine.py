"""The chunk loop with mock models (our own logic only; real models are tested elsewhere).

The mock DiT's clean prediction for a latent frame is the mean of its audio tokens; the mock
refiner upsamples, the mock VAE repeats each latent into its video frames. So every published
pixel tells which audio the engine paired it with: a frame shifted, duplicated or dropped at a
chunk boundary changes the picture, and the test sees it.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from avatarstream.engine.clock import MediaClock
from avatarstream.engine.module import Module
from avatarstream.engine.pipeline import ModelSet, Pipeline, PipelineConfig
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.engine.schedule import PrefixSchedule
from avatarstream.engine.session import SessionState

FPS, SR, W = 25, 16000, 1


def feature(frame: np.ndarray | int) -> np.ndarray:
    return 0.9 * np.sin(0.05 * np.asarray(frame, dtype=np.float64))


class MockRef:
    def __init__(self, frames: int) -> None:
        self.frames = frames
        self.motion = torch.zeros(1, frames, 2)

    def concat(self, other: "MockRef") -> "MockRef":
        return MockRef(self.frames + other.frames)

    def nbytes(self) -> int:
        return 0


class MockDiT(nn.Module):
    def __init__(self, latency: float = 0.0) -> None:
        super().__init__()
        self.latency = latency
        self.ref_frames_seen: list[int] = []

    def encode_reference(self, lat, valid, t_pos):  # noqa: ANN001
        return MockRef(lat.shape[2])

    def forward(self, x, sigma, cond, ref):  # noqa: ANN001
        if self.latency:
            time.sleep(self.latency)
        self.ref_frames_seen.append(ref.frames)
        x0 = cond.audio.mean(dim=(2, 3))[:, None, :, None, None].expand_as(x)  # [B, C, T, h, w]
        s = sigma[:, None, :, None, None]
        eps = (x - (1 - s) * x0) / s.clamp_min(1e-6)
        return SimpleNamespace(velocity=eps - x0, motion_velocity=torch.zeros_like(cond.motion))


class MockRefiner(nn.Module):
    def encode_reference(self, lat, valid, t_pos):  # noqa: ANN001
        return MockRef(lat.shape[2])

    def refine(self, lr, noise, cond, ref, sigma):  # noqa: ANN001
        return lr.repeat_interleave(2, dim=3).repeat_interleave(2, dim=4)


class MockConvCache:
    def __init__(self) -> None:
        self.first = True

    def nbytes(self) -> int:
        return 8


class MockVAE(nn.Module):
    def encode(self, video):  # noqa: ANN001
        b, c, f, h, w = video.shape
        t = 1 + (f - 1) // 4
        z = torch.zeros(b, 1, t, h // 8, w // 8)
        return z, z

    def new_cache(self) -> MockConvCache:
        return MockConvCache()

    def decode_step(self, z, cache):  # noqa: ANN001
        reps = [1 if (cache.first and i == 0) else 4 for i in range(z.shape[2])]
        cache.first = False
        v = z.mean(dim=(1, 3, 4))  # [B, T]
        frames = torch.cat([v[:, i : i + 1].repeat(1, r) for i, r in enumerate(reps)], dim=1)
        return frames[:, None, :, None, None].expand(-1, 3, -1, 8, 8)  # [B, 3, F, 8, 8]


class MockStream:
    """Streaming features with a 2-frame look-ahead: feature(f) for video frame f."""

    def __init__(self) -> None:
        self.samples, self.ended = 0, False

    def push(self, x: torch.Tensor) -> None:
        self.samples += x.numel()

    def end(self) -> None:
        self.ended = True

    def available_frames(self) -> int:
        return 1 << 30 if self.ended else self.samples * FPS // SR - 2

    def features(self, start: int, stop: int) -> torch.Tensor:
        return torch.tensor(feature(np.arange(start, stop)), dtype=torch.float32)[None, :, None]


class MockText(nn.Module):
    def encode(self, prompts):  # noqa: ANN001
        return torch.zeros(len(prompts), 1, 4), torch.ones(len(prompts), 1, dtype=torch.bool)


class ListSink:
    def __init__(self, delay: float = 0.0) -> None:
        self.video: list = []
        self.audio_samples = 0
        self.delay = delay
        self.durable_frames = 0

    def write_video(self, chunk) -> None:  # noqa: ANN001
        if self.delay:
            time.sleep(self.delay)
        self.video.append(chunk)
        self.durable_frames += chunk.frames.shape[0]

    def write_audio(self, chunk) -> None:  # noqa: ANN001
        self.audio_samples += chunk.samples.shape[0]


def mock_models(strategy: str = "prefix", latency: float = 0.0, chunk: int = 5,
                scene: bool = False) -> ModelSet:
    """scene False: every frame follows the audio (the mock DiT's x0), the frame-0 scene frame
    of ref2v / N chunks is tested on its own."""
    cfg = PipelineConfig(lr_size=32, hr_size=64, latent_channels=1, motion_dim=2, chunk=chunk,
                         ref_frames=2, steps=3, strategy=strategy, audio_window=W, scene_frame=scene)
    return ModelSet(
        name="mock", dit=Module("dit", MockDiT(latency)), refiner=Module("refiner", MockRefiner()),
        vae=Module("vae", MockVAE()), audio=Module("audio", nn.Identity()),
        text=Module("text", MockText()), config=cfg, make_audio_stream=MockStream)


def reference() -> torch.Tensor:
    return torch.randint(0, 255, (1, 3, 64, 64), dtype=torch.uint8)


def audio_chunks(seconds: float, piece: int = 3200):
    return iter(torch.zeros(int(round(seconds * SR))).split(piece))


def expected_pixels(n_frames: int) -> np.ndarray:
    """What the mock chain must show at every video frame: its latent's audio-token mean."""
    clock = MediaClock()
    out = []
    p = 0
    while len(out) < n_frames:
        a, b = clock.video_span(p)
        _, e = a, b
        window = np.arange(e - 4 - W, e + W)
        out.extend([feature(window).mean()] * (b - a))
        p += 1
    v = np.asarray(out[:n_frames])
    return np.round((np.clip(v, -1, 1) + 1) * 127.5)


@pytest.mark.parametrize("strategy", ["prefix", "interp"])
@pytest.mark.parametrize("seconds", [0.05, 1.0, 3.37, 7.0])
def test_frames_follow_audio_across_chunk_boundaries(strategy, seconds):
    sink = ListSink()
    summary = Pipeline(mock_models(strategy)).run(reference(), audio_chunks(seconds), [sink])
    n = MediaClock().frames_for_samples(int(round(seconds * SR)))
    starts = [c.start_frame for c in sink.video]
    frames = np.concatenate([c.frames for c in sink.video])
    assert summary.frames == n == frames.shape[0]
    assert starts == list(np.cumsum([0] + [c.frames.shape[0] for c in sink.video[:-1]]))
    got = frames[:, 0, 0, 0].astype(np.float64)
    assert np.abs(got - expected_pixels(n)).max() <= 1.0  # uint8 rounding only
    assert sink.audio_samples == int(round(seconds * SR))


def test_prefix_appearance_anchor_joins_reference_after_first_chunk():
    models = mock_models("prefix")
    Pipeline(models).run(reference(), audio_chunks(3.0), [ListSink()])
    seen = models.dit.model.ref_frames_seen
    steps = models.config.steps
    assert set(seen[:steps]) == {1} and set(seen[steps:]) == {2}


def test_rolling_state_does_not_grow_with_duration():
    sizes = {}
    for seconds in (12.0, 40.0):
        summary = Pipeline(mock_models("interp")).run(reference(), audio_chunks(seconds), [ListSink()])
        sizes[seconds] = summary.rolling_state_bytes
    assert sizes[12.0] == sizes[40.0] > 0


def test_back_pressure_bounds_frames_in_flight():
    generated = []
    sink = ListSink(delay=0.03)
    lags = []
    orig = sink.write_video

    def write(chunk):  # noqa: ANN001
        lags.append(generated[-1] - chunk.start_frame if generated else 0)
        orig(chunk)

    sink.write_video = write
    Pipeline(mock_models(chunk=3)).run(reference(), audio_chunks(6.0), [sink],
                                       progress=lambda done, total, t: generated.append(done))
    # The publisher queue holds at most 4 items (video or audio): generation may run ahead of the
    # slow sink by a handful of chunks, never by the whole video.
    assert max(lags) <= 6 * 12


def test_pacing_against_media_clock():
    t0 = time.perf_counter()
    Pipeline(mock_models()).run(reference(), audio_chunks(1.6), [ListSink()], max_lead_s=0.2)
    assert time.perf_counter() - t0 >= 1.6 - 0.2 - 0.5  # the first chunk arrives ahead of pacing


def test_live_source_publishes_before_audio_ends():
    """Audio arriving in real time: frames are published while speech is still coming in."""
    first_frame_at, audio_done_at = [], []
    sink = ListSink()
    orig = sink.write_video
    sink.write_video = lambda c: (first_frame_at.append(time.perf_counter()), orig(c))

    def live():
        for piece in torch.zeros(int(2.0 * SR)).split(1600):  # 0.1 s pieces every 0.05 s
            time.sleep(0.05)
            yield piece
        audio_done_at.append(time.perf_counter())

    Pipeline(mock_models(chunk=3)).run(reference(), live(), [sink])
    assert first_frame_at[0] < audio_done_at[0] - 0.3


def test_stage_contract_is_checked():
    class Broken(Stage):
        name = "broken"
        reads = ("lr_latents",)

        def run(self, rec, state):  # noqa: ANN001
            pass

    plan = PrefixSchedule(chunk=4).next_chunk(None)
    with pytest.raises(RuntimeError, match="broken.*lr_latents"):
        Broken()(ChunkRecord(plan), SessionState())

    class Liar(Stage):
        name = "liar"
        writes = ("audio",)

        def run(self, rec, state):  # noqa: ANN001
            pass

    with pytest.raises(RuntimeError, match="liar.*audio"):
        Liar()(ChunkRecord(plan), SessionState())


def test_empty_audio_is_a_user_error():
    from avatarstream.errors import InputError

    with pytest.raises(InputError, match="empty"):
        Pipeline(mock_models()).run(reference(), iter([]), [ListSink()])


def test_module_offload_roundtrip():
    lin = nn.Linear(4, 4)
    mod = Module("lin", lin)
    x = torch.randn(2, 4)
    y0 = mod.call("forward", x)
    mod.offload()
    assert not mod.on_device
    y1 = mod.call("forward", x)  # onloads on demand
    assert mod.on_device and torch.equal(y0, y1)
    assert mod.calls == 2 and mod.forward_seconds > 0


def test_threads_do_not_leak():
    before = threading.active_count()
    Pipeline(mock_models()).run(reference(), audio_chunks(1.0), [ListSink()])
    assert threading.active_count() == before


@pytest.mark.parametrize("strategy", ["prefix", "interp", "causal"])
def test_overlapped_decode_is_bit_identical(strategy, one_thread):
    """Decode on its own thread (`decode_overlap`, the default) vs inline: the same frames, bit for
    bit (tolerance 0: the same ops on the same data in the same order), the same frame count."""
    import dataclasses

    from avatarstream.registry import load_model

    models = load_model("tiny-random")
    ref = reference()
    got = {}
    for overlap in (False, True):
        cfg = dataclasses.replace(models.config, strategy=strategy, decode_overlap=overlap)
        sink = ListSink()
        summary = Pipeline(models, cfg).run(ref, audio_chunks(3.3), [sink])
        got[overlap] = (summary.frames, [c.start_frame for c in sink.video],
                        np.concatenate([c.frames for c in sink.video]))
    assert got[True][0] == got[False][0] == got[True][2].shape[0]
    assert got[True][1] == got[False][1]
    assert np.array_equal(got[True][2], got[False][2])


def test_overlapped_decode_error_reaches_the_caller():
    models = mock_models()

    def broken(z, cache):  # noqa: ANN001
        raise RuntimeError("decoder exploded")

    models.vae.model.decode_step = broken
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="decoder exploded"):
        Pipeline(models).run(reference(), audio_chunks(3.0), [ListSink()])
    assert threading.active_count() == before


def test_guidance_scales_reach_the_dit(one_thread):
    """PipelineConfig's (audio, reference) scales go to every DiT call as `cond.guidance`; none
    set: no guidance input at all (the plain conditional prediction)."""
    import dataclasses

    from avatarstream.registry import load_model

    models = load_model("tiny-random")
    seen = []
    forward = models.dit.model.forward

    def spy(x, sigma, cond, ref):  # noqa: ANN001
        seen.append(None if cond.guidance is None else cond.guidance.tolist())
        return forward(x, sigma, cond, ref)

    models.dit.model.forward = spy
    for scales in ((None, None), (2.5, 1.5)):
        cfg = dataclasses.replace(models.config, audio_scale=scales[0], ref_scale=scales[1],
                                  guidance_input=True)
        seen.clear()
        Pipeline(models, cfg).run(reference(), audio_chunks(1.0), [ListSink()])
        want = None if scales[0] is None else [[2.5, 1.5]]
        assert seen and all(g == want for g in seen), seen[:3]


def test_guidance_of_a_model_not_distilled_runs_the_cfg_streams():
    """`guided_velocity`: v(∅,∅) + s_r (v(∅,r) − v(∅,∅)) + s_a (v(a,r) − v(∅,r)) from the
    dropout streams (zero audio tokens, no reference); reference scale 1 skips v(∅,∅); in the
    pipeline a model without guidance input runs 2 DiT passes a step (3 with a reference scale),
    never passing the scales as an input."""
    import dataclasses

    from avatarstream.engine.stages.audio_to_video import guided_velocity
    from avatarstream.registry import load_model

    calls = []

    def velocity(tokens, reference):  # noqa: ANN001
        calls.append((bool(tokens.abs().sum() > 0), reference is not None))
        a = float(tokens.abs().sum() > 0)
        r = float(reference is not None)
        return torch.tensor([1.0 + 2.0 * a + 4.0 * r]), torch.tensor([a - r])

    audio = torch.ones(1, 2, 3, 4)
    full = velocity(audio, "ref")
    calls.clear()
    assert guided_velocity(velocity, audio, "ref", None) == full and calls == [(True, True)]
    v, m = guided_velocity(velocity, audio, "ref", (3.0, 1.0))  # v(∅,r)=5, v(a,r)=7
    assert float(v) == 5.0 + 3.0 * 2.0 and float(m) == -1.0 + 3.0 * 1.0
    calls.clear()
    v, _ = guided_velocity(velocity, audio, "ref", (3.0, 2.0))  # v(∅,∅)=1
    assert float(v) == 1.0 + 2.0 * 4.0 + 3.0 * 2.0
    assert calls == [(True, True), (False, True), (False, False)]

    models = load_model("tiny-random")
    seen = []
    forward = models.dit.model.forward

    def spy(x, sigma, cond, ref):  # noqa: ANN001
        seen.append((cond.guidance is None, bool(cond.audio.abs().sum() > 0), ref is not None))
        return forward(x, sigma, cond, ref)

    models.dit.model.forward = spy
    runs = {}
    for scales in ((None, None), (2.5, None), (2.5, 1.5)):
        seen.clear()
        sink = ListSink()
        cfg = dataclasses.replace(models.config, audio_scale=scales[0], ref_scale=scales[1])
        Pipeline(models, cfg).run(reference(), audio_chunks(1.0), [sink])
        runs[scales] = (list(seen), np.concatenate([c.frames for c in sink.video]))
    plain, guided, both = (runs[k][0] for k in runs)
    assert all(g for g, _, _ in plain + guided + both)  # the scales are never a DiT input here
    assert len(guided) == 2 * len(plain) and len(both) == 3 * len(plain)
    assert {s for s in guided} == {(True, True, True), (True, False, True)}
    assert (True, False, False) in both
    assert not np.array_equal(runs[(None, None)][1], runs[(2.5, None)][1])


@pytest.mark.parametrize("strategy", ["prefix", "interp"])
def test_scene_frame_is_given_to_chunks_made_from_the_reference(strategy):
    """With scene_frame the reference's first usable latent (the mock VAE encodes zeros: pixel
    128) is frame 0 of the first chunk, published as the first video frame, and the DiT sees it
    clean (sigma 0) in every ref2v / N chunk; later frames still follow the audio."""
    models = mock_models(strategy, scene=True)
    sigmas0 = []
    forward = models.dit.model.forward

    def spy(x, sigma, cond, ref):  # noqa: ANN001
        sigmas0.append(float(sigma[0, 0]))
        return forward(x, sigma, cond, ref)

    models.dit.model.forward = spy
    sink = ListSink()
    Pipeline(models).run(reference(), audio_chunks(3.0), [sink])
    pixels = np.concatenate([c.frames[:, 0, 0, 0] for c in sink.video]).astype(np.float64)
    want = expected_pixels(len(pixels))
    assert pixels[0] == 128 and want[0] != 128
    np.testing.assert_allclose(pixels[1:], want[1:], atol=1)
    steps = models.config.steps
    n_from_ref = 1 if strategy == "prefix" else len(sink.video) // 2  # N chunks: about half
    assert sigmas0[:steps] == [0.0] * steps  # chunk 0: frame 0 given at every step
    if strategy == "interp":
        assert sigmas0.count(0.0) >= steps * n_from_ref


def test_scene_image_replaces_the_reference_first_frame(one_thread):
    """`scene`: the first chunk's frame 0 is the VAE latent of the scene image (area-resized to
    the DiT's resolution), not the reference's; without it, the reference's first frame."""
    import torch.nn.functional as F

    from avatarstream.registry import load_model

    models = load_model("tiny-random")
    c = models.config
    first = []
    forward = models.dit.model.forward

    def spy(x, sigma, cond, ref):  # noqa: ANN001
        if not first:
            first.append(x[:, :, 0].clone())
        return forward(x, sigma, cond, ref)

    models.dit.model.forward = spy
    g = torch.Generator().manual_seed(3)
    ref = torch.randint(0, 255, (1, 3, c.hr_size, c.hr_size), dtype=torch.uint8, generator=g)
    scene = torch.randint(0, 255, (1, 3, c.hr_size, c.hr_size), dtype=torch.uint8, generator=g)

    def lat0(img: torch.Tensor) -> torch.Tensor:
        v = img.permute(1, 0, 2, 3).float().unsqueeze(0) / 127.5 - 1.0
        v = F.interpolate(v, size=(1, c.lr_size, c.lr_size), mode="area")
        with torch.inference_mode():
            return models.vae.call("encode", v)[0][:, :, 0].float()

    for given, want in ((None, ref), (scene, scene)):
        first.clear()
        Pipeline(models).run(ref, audio_chunks(0.5), [ListSink()], scene=given)
        torch.testing.assert_close(first[0].float(), lat0(want), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(lat0(ref), lat0(scene))
