"""Stages and modules with mock models: the stage contract, module offload, guidance reaching
the DiT, the scene frame."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from avatarstream.engine.module import Module
from avatarstream.engine.pipeline import Pipeline
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.engine.schedule import PrefixSchedule
from avatarstream.engine.session import SessionState

from .mock_models import ListSink, audio_chunks, expected_pixels, mock_models, reference


def test_stage_contract_is_checked():
    class Broken(Stage):
        name = "broken"
        reads = ("lr_latents",)

        def run_one(self, rec, state):  # noqa: ANN001
            pass

    plan = PrefixSchedule(chunk=4).next_chunk(None)
    with pytest.raises(RuntimeError, match="broken.*lr_latents"):
        Broken()([(ChunkRecord(plan), SessionState())])

    class Liar(Stage):
        name = "liar"
        writes = ("audio",)

        def run_one(self, rec, state):  # noqa: ANN001
            pass

    with pytest.raises(RuntimeError, match="liar.*audio"):
        Liar()([(ChunkRecord(plan), SessionState())])


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

    from avatarstream.engine.denoiser import guided_velocity
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
