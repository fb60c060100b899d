"""DMD of a bidirectional few-step student rolled out in prefix chunks (train/prefix_dmd.py), on
tiny configs: the rollout is the engine's prefix computation (tolerance 1e-4 absolute: the same
forwards, the Euler step written through x̂0), chunk k is given chunk k − 1's own output, DMD with
an exact real score pulls the samples the right way, and export makes a
model that streams with the prefix strategy at the run's steps and chunks (resume bit for bit:
test_causal_train.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from test_causal_train import ZeroDataScore, dataset, recipe, run  # noqa: F401  (fixture)

from avatarstream.train.trainer import Trainer, step_generator

pytestmark = pytest.mark.usefixtures("one_thread")

NAME = "dmd-prefix-tiny"


def _task(dataset: dict, **over: object):  # type: ignore[no-untyped-def]
    from avatarstream.train.tasks import make_task

    task = make_task(recipe(NAME, dataset, **over), torch.device("cpu"))
    task.after_init()
    for n, net in task.nets.items():
        net.train(n in task.trainable)
        net.requires_grad_(n in task.trainable)
    return task


@pytest.mark.parametrize("guidance", [None, (6.0, 1.0)])
def test_prefix_rollout_is_the_engine_prefix_computation(dataset, guidance):
    """Exit at the last step: each chunk's samples are what `AudioToVideoStage` (the engine's
    prefix chunk) makes from the same noise and given frames; chunk k > 0 is given the last
    `overlap` frames chunk k − 1 produced, chunk 0 the ground truth's."""
    from avatarstream.engine.module import Module
    from avatarstream.engine.stages.audio_to_video import AudioToVideoStage
    from avatarstream.train.prefix_dmd import PrefixDMDTask

    over: dict[str, object] = {"train__batch": 1}
    if guidance is not None:
        over["dmd__guidance"] = list(guidance)
    task = _task(dataset, **over)
    assert isinstance(task, PrefixDMDTask) and task.chunks == 3
    gen = task.nets["dit"]
    gen.eval()
    if guidance is not None:  # a trained guidance embedding (init_net starts it at zero)
        torch.nn.init.normal_(gen.guidance_embedding[2].weight, std=0.5)
    g = step_generator(1, 1)
    b = task.conditions(g)
    B, C, T, h, w = b["x0"].shape
    noise = [(torch.randn(B, C, 4, h, w, generator=g), torch.randn(B, 4, task.motion_dim, generator=g))
             for _ in range(3)]
    with torch.no_grad():
        roll = task.prefix_rollout(b, task.cfg["steps"] - 1, g, noise=noise)
    x_all, m_all = roll["x0_all"], roll["m0_all"]
    assert x_all.shape == b["x0"].shape and m_all.shape == b["m0"].shape
    assert torch.equal(x_all[:, :, :2], b["x0"][:, :, :2])  # chunk 0's given frames: ground truth

    stage = AudioToVideoStage(Module("dit", gen), steps=task.cfg["steps"], guidance=guidance,
                              guidance_input=guidance is not None)
    ref = gen.encode_reference(b["ref_lat"], b["ref_valid"], torch.full((b["ref_lat"].shape[2],), -8.0))
    given_x, given_m = b["x0"][:, :, :2], b["m0"][:, :2]
    for k, sl in enumerate(task.chunk_slices()):
        store = SimpleNamespace(given=lambda plan, gx=given_x, gm=given_m: [(i, gx[:, :, i], gm[:, i]) for i in range(2)],
                                scene=lambda: (b["anchor"],))
        state = SimpleNamespace(store=store, text=b["text"], text_mask=b["text_mask"], dit_reference=ref)
        rec = SimpleNamespace(plan=SimpleNamespace(length=4, id=k), sigma_noise=noise[k][0], motion_noise=noise[k][1],
                              given=torch.tensor([[True, True, False, False]]), audio=b["audio"][:, sl])
        with torch.inference_mode():  # as the engine runs its stages
            stage.run(rec, state)  # type: ignore[arg-type]
        assert float((rec.lr_latents - x_all[:, :, sl]).abs().max()) < 1e-4, k
        assert float((rec.motion - m_all[:, sl]).abs().max()) < 1e-4, k
        given_x, given_m = rec.lr_latents[:, :, 2:], rec.motion[:, 2:]


def test_prefix_dmd_gradient_reaches_the_generator_through_every_chunk_and_pulls_to_the_data(dataset, tmp_path):
    """With an exact real score of all-zero data, the generator's fully denoised samples shrink
    (measured 1.02 -> 0.86 over 20 steps); the DMD gradient reaches the generator; the ground-truth
    given frames of chunk 0 are never scored."""
    t = Trainer(recipe(NAME, dataset, train__steps=20, train__checkpoint_every=100, train__lr=3e-3),
                tmp_path / "zero", progress=False)
    t.task.nets["teacher"] = ZeroDataScore()
    keep = t.task.scored_frames()
    assert keep.tolist() == [0, 0, 1, 1, 1, 1, 1, 1]

    def rms() -> float:
        vals = []
        for i in range(3):
            g = step_generator(99, 20_000 + i)
            b = t.task.conditions(g)
            with torch.no_grad():
                roll = t.task.prefix_rollout(b, t.task.cfg["steps"] - 1, g)
            vals.append(float(roll["x0_all"][:, :, 2:].square().mean().sqrt()))
        return sum(vals) / len(vals)

    before = rms()
    t.run()
    after = rms()
    assert after < 0.9 * before, (before, after)
    rows = [json.loads(ln) for ln in (tmp_path / "zero" / "log.jsonl").read_text().splitlines()]
    assert {r["exit_step"] for r in rows} == {0, 1} and all(r["gen_update"] == 1 for r in rows)


def test_prefix_student_exports_as_a_prefix_model_and_streams(dataset, tmp_path):
    from conftest import stream_two_seconds

    from avatarstream import registry
    from avatarstream.train.export import export

    run(NAME, dataset, tmp_path / "dmd", train__steps=2, train__checkpoint_every=2)
    out = tmp_path / "weights" / "tiny-prefix-dmd"
    export([tmp_path / "dmd"], out, dtype="fp32")
    pipe = json.loads((out / "config.json").read_text())["pipeline"]
    assert (pipe["strategy"], pipe["steps"], pipe["chunk"], pipe["overlap"]) == ("prefix", 2, 4, 2)
    ms = registry.load_model(str(out))
    assert ms.config.strategy == "prefix"
    stream_two_seconds(ms)


def test_prefix_recipe_errors_are_user_errors(dataset):
    from avatarstream.errors import ConfigError
    from avatarstream.train.tasks import make_task

    with pytest.raises(ConfigError, match="prefix_chunk"):
        make_task(recipe(NAME, dataset, dmd__chunk=7), torch.device("cpu"))
    with pytest.raises(ConfigError, match="causal strategy"):
        make_task(recipe(NAME, dataset, dmd__adaptive_sink=True), torch.device("cpu"))
    with pytest.raises(ConfigError, match="strategy must be"):
        make_task(recipe(NAME, dataset, dmd__strategy="interp"), torch.device("cpu"))
