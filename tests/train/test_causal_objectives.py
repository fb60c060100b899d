"""Training the causal student (train/objectives/diffusion_forcing.py, self_forcing_dmd.py):
diffusion forcing and Self-Forcing DMD on tiny configs and a tiny synthetic dataset made here —
losses go down, `--resume` continues bit for bit, the DMD rollout is the engine's streaming
computation, block-wise gradient accumulation equals the one-graph gradient (tolerance 1e-5
relative: the two sum the same terms in another order)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from avatarstream.train.objectives import make_task
from avatarstream.train.objectives.causal import sink_positions
from avatarstream.train.objectives.latent import latent_points
from avatarstream.train.objectives.self_forcing_dmd import history_corrupt
from avatarstream.train.trainer import Trainer, step_generator

from .helpers import recipe, run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def causal_data(tmp_path_factory) -> dict[str, Path]:
    """2 identities x 2 scenes x 1.5 s at 64 px (10 latent frames per clip), prepared with a
    random tiny VAE."""
    from avatarstream.data.generate import DatasetConfig, generate
    from avatarstream.train.data import prepare
    from avatarstream.train.nets import build_nets, init_net

    d = tmp_path_factory.mktemp("causal-data")
    generate(DatasetConfig(identities=2, clips_per_identity=2, seconds=1.5, size=64), d / "synth")
    vae = build_nets("tiny")["vae"]
    init_net("vae", vae, 0)
    prepare(d / "synth", vae, d / "prep.safetensors", lr_size=32, hr_size=64)
    return {"prepared": d / "prep.safetensors", "from_scratch": True}


def logged(run_dir: Path, key: str = "loss") -> list[float]:
    return [json.loads(ln)[key] for ln in (run_dir / "log.jsonl").read_text().splitlines()]


def held_out(t: Trainer, key: str = "loss", n: int = 4) -> float:
    """Mean of a logged value over fixed batches the run never draws (no optimiser step)."""
    vals = []
    for i in range(n):
        with t._autocast():
            _, logs = t.task.loss(step_generator(99, 10_000 + i))
        vals.append(logs[key])
        for p in t.task.nets["dit"].parameters():
            p.grad = None
    return sum(vals) / n


def test_diffusion_forcing_loss_goes_down(causal_data, tmp_path):
    t = run("df-tiny", causal_data, tmp_path / "df", train__steps=30, train__checkpoint_every=30)
    ls = logged(tmp_path / "df")
    assert len(ls) == 30 and sum(ls[-8:]) < sum(ls[:8])
    fresh = Trainer(recipe("df-tiny", causal_data, train__steps=30), tmp_path / "df", progress=False)
    before = held_out(fresh)
    fresh.restore()
    assert held_out(fresh) < 0.85 * before
    assert t.task.sink_index() == ([-8.0, -5.0], [0, 0, 1])  # block 2's window starts at block 1


class ZeroDataScore(torch.nn.Module):
    """An exact real score for data that is all zeros (latents and motion): v = x_t / sigma, so
    its x0 prediction is 0 at every noise level. DMD must pull the generator's samples to 0."""
    def encode_reference(self, lat, valid, t_pos):  # noqa: ANN001
        return None

    def forward(self, x, sigma, cond, ref):  # noqa: ANN001
        from avatarstream.models.transformer import DiTOutput

        s = sigma[:, None, :, None, None]
        return DiTOutput(velocity=x / s, motion_velocity=cond.motion / sigma[..., None])


def sample_rms(t: Trainer, n: int = 3) -> float:
    """RMS of the generator's fully denoised samples (exit at the last step) on fixed batches."""
    vals = []
    for i in range(n):
        g = step_generator(99, 20_000 + i)
        b = t.task.conditions(g)
        with torch.no_grad():
            roll = t.task.self_forcing_rollout(b, t.task.cfg["steps"] - 1, g)
        vals.append(float(roll["x0_all"].square().mean().sqrt()))
    return sum(vals) / n


def test_dmd_trains_generator_and_fake_score(causal_data, tmp_path):
    over = dict(train__steps=12, train__checkpoint_every=12)
    t = run("dmd-tiny", causal_data, tmp_path / "dmd", **over)
    rows = [json.loads(ln) for ln in (tmp_path / "dmd" / "log.jsonl").read_text().splitlines()]
    assert {"dmd", "score_gap", "fake", "exit_step"} <= rows[0].keys()
    assert len({r["exit_step"] for r in rows}) > 1
    assert rows[0]["score_gap"] == 0.0 < rows[-1]["score_gap"]  # fake starts as the teacher, then learns
    assert all(r["gen_update"] == 1 for r in rows)
    fresh = Trainer(recipe("dmd-tiny", causal_data, **over), tmp_path / "dmd", progress=False)
    gen0 = {k: v.clone() for k, v in fresh.task.nets["dit"].state_dict().items()}
    fresh.restore()
    moved = max(float((v - gen0[k]).abs().max()) for k, v in fresh.task.nets["dit"].state_dict().items())
    assert moved > 1e-3
    assert all(torch.equal(a, b) for a, b in zip(t.task.nets["teacher"].state_dict().values(),
                                                 fresh.task.nets["teacher"].state_dict().values()))


def test_dmd_pulls_samples_to_the_real_distribution(causal_data, tmp_path):
    """With an exact real score of an all-zero data distribution, DMD moves the generator the way
    it should: its fully denoised samples shrink towards 0 (the distance to the real distribution
    goes down; the logged `dmd` value is normalised by the sample scale, so it does not)."""
    t = Trainer(recipe("dmd-tiny", causal_data, train__steps=20, train__checkpoint_every=100, train__lr=3e-3),
                tmp_path / "zero", progress=False)
    t.task.nets["teacher"] = ZeroDataScore()
    before = sample_rms(t)
    t.run()
    after = sample_rms(t)
    assert after < 0.9 * before, (before, after)  # measured: 0.997 -> 0.847


@pytest.mark.parametrize("name", ["df-tiny", "dmd-tiny"])
def test_resume_is_bit_for_bit(causal_data, tmp_path, name):
    over = dict(train__steps=4, train__checkpoint_every=100)
    straight = run(name, causal_data, tmp_path / "straight", **over)
    run(name, causal_data, tmp_path / "split", max_steps=2, **over)
    resumed = run(name, causal_data, tmp_path / "split", resume=True, **over)
    a, b = straight.state_tensors(), resumed.state_tensors()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert logged(tmp_path / "straight") == logged(tmp_path / "split")


def _dmd_task(causal_data: dict, **over: object):  # type: ignore[no-untyped-def]

    task = make_task(recipe("dmd-tiny", causal_data, **over), torch.device("cpu"))
    task.after_init()
    for n, net in task.nets.items():
        net.train(n in task.trainable)
        net.requires_grad_(n in task.trainable)
    return task


def test_blockwise_gradient_accumulation_equals_one_graph(causal_data):
    grads = {}
    for blockwise in (True, False):
        task = _dmd_task(causal_data, dmd__blockwise_grad=blockwise)
        task.nets["teacher"] = ZeroDataScore()  # fake == teacher at the start: a zero DMD gradient
        _, logs = task.loss(step_generator(5, 3))
        assert logs["exit_step"] == 3  # every step runs: 4 timestep-forcing caches
        grads[blockwise] = {k: p.grad.clone() for k, p in task.nets["dit"].named_parameters()
                            if p.grad is not None}
    a, b = grads[True], grads[False]
    assert a.keys() == b.keys() and len(a) > 10
    num = sum(float((a[k] - b[k]).square().sum()) for k in a) ** 0.5
    den = sum(float(b[k].square().sum()) for k in a) ** 0.5
    assert den > 0 and num / den < 1e-5


@pytest.mark.parametrize("guidance,level", [(None, "same"), ((6.0, 1.0), "same"), ((6.0, 1.0), "next")])
def test_rollout_is_the_engine_streaming_computation(causal_data, guidance, level):
    """With History Corrupt off and the last exit step, the training rollout's clean estimates
    are what the engine's CausalDenoiser (Algorithm 3) produces from the same noise, with and
    without guidance scales as the (CFG-distilled) student's inputs, and with either history
    level (the K/V a block leaves: its input's or its output's)."""
    from avatarstream.engine.causal import CausalDenoiser, CausalSettings
    from avatarstream.engine.module import Module

    over = {} if guidance is None else {"dmd__guidance": list(guidance)}
    task = _dmd_task(causal_data, dmd__history_corrupt=0.0, dmd__history_level=level, **over)
    if guidance is not None:  # a trained guidance embedding (init_net starts it at zero: no effect)
        torch.nn.init.normal_(task.nets["dit"].guidance_embedding[2].weight, std=0.5)
    g = step_generator(1, 1)
    b = task.conditions(g)
    gen = task.nets["dit"]
    B, C, T, h, w = b["x0"].shape
    noise = [(torch.randn(B, C, 3, h, w, generator=g), torch.randn(B, 3, 4, generator=g)) for _ in range(3)]
    with torch.no_grad():
        roll = task.self_forcing_rollout(b, 3, g, noise=noise)
    outs = {}
    for scales in {None, guidance}:
        den = CausalDenoiser(Module("dit", gen), task.sigmas,
                             CausalSettings(kv_blocks=1, guidance=scales, history_level=level))
        den.start(gen.encode_reference(b["ref_lat"], b["ref_valid"], torch.full((3,), -8.0)),
                  b["anchor"])  # the scene anchor, as the engine passes it (scene_anchor)
        outs[scales] = []
        for i in range(3):
            x, m = den.denoise(*noise[i], audio=b["audio"][:, 3 * i:3 * i + 3], text=b["text"],
                               text_mask=b["text_mask"], positions=[3 * i, 3 * i + 1, 3 * i + 2], block=i)
            if i == 0:
                den.adaptive_attention_sink(x[:, :, :1])
            outs[scales].append(x)
            if scales == guidance:
                assert float((x - roll["x0"][i]).abs().max()) < 1e-4
                assert float((m - roll["m0"][i]).abs().max()) < 1e-4
    if guidance is not None:  # the scales change what the student makes
        assert float((outs[guidance][0] - outs[None][0]).abs().max()) > 1e-3
    task.nets["dit"].train(True)


def test_history_corrupt_and_sink_positions():
    from avatarstream.cache.kv import BlockKV

    kv = BlockKV([torch.ones(1, 2, 30, 8)], [2 * torch.ones(1, 2, 30, 8)])
    g = torch.Generator().manual_seed(0)
    out = history_corrupt(kv, 0.1, g)
    assert abs(float((out.k[0] - 1).std()) - 0.1) < 0.02 and abs(float((out.v[0] - 2).std()) - 0.2) < 0.04
    assert history_corrupt(kv, 0.0, g) is kv
    assert sink_positions(5, 3, 2, -8.0, True) == [-8.0, -8.0, -8.0, -5.0, -2.0]
    assert sink_positions(5, 3, 2, -8.0, False) == [-8.0] * 5


def test_recipe_errors_are_user_errors(causal_data):
    from avatarstream.errors import ConfigError

    with pytest.raises(ConfigError, match="whole number of blocks"):
        make_task(recipe("df-tiny", causal_data, df__chunk=8), torch.device("cpu"))
    with pytest.raises(ConfigError, match="unknown key"):
        recipe("dmd-tiny", causal_data, dmd__histroy=1)
    with pytest.raises(ConfigError, match="df.guidance must be"):
        make_task(recipe("df-tiny", causal_data, df__guidance=[6.0]), torch.device("cpu"))
    with pytest.raises(ConfigError, match="dmd.teacher_guidance must be"):
        make_task(recipe("dmd-tiny", causal_data, dmd__teacher_guidance=[6.0, -1.0]), torch.device("cpu"))


def test_direct_causal_student_trains_exports_and_streams(causal_data, tmp_path):
    """The bundled model's causal chain at tiny size: diffusion forcing of a direct (output-
    resolution, x0) DiT at guidance (1, 1) lowers its held-out loss; Self-Forcing DMD with the
    student and the scores at (6, 1) trains; export makes a model whose default strategy is
    causal, with the DMD run's steps and guidance; the exported folder, named by its path, streams
    every frame."""
    from conftest import stream_two_seconds

    from avatarstream import registry
    from avatarstream.train.export import export

    df_dir, dmd_dir = tmp_path / "df", tmp_path / "dmd"
    t = run("df-tiny", causal_data, df_dir, train__steps=30, train__checkpoint_every=30, df__direct=True,
            df__guidance=[1.0, 1.0])
    assert t.task.nets["dit"].config.x0_skip and t.task.nets["dit"].config.patch == (1, 4, 4)
    fresh = Trainer(recipe("df-tiny", causal_data, train__steps=30, df__direct=True, df__guidance=[1.0, 1.0]),
                    df_dir, progress=False)
    before = held_out(fresh, "flow")
    fresh.restore()
    assert held_out(fresh, "flow") < 0.9 * before
    run("dmd-tiny", causal_data, dmd_dir, train__steps=3, train__checkpoint_every=3, dmd__direct=True,
        dmd__guidance=[6.0, 1.0], dmd__teacher_guidance=[6.0, 1.0], init__dit=str(df_dir))
    out = tmp_path / "weights" / "tiny-causal"
    export([dmd_dir], out, dtype="fp32")
    pipe = json.loads((out / "config.json").read_text())["pipeline"]
    assert (pipe["strategy"], pipe["steps"], pipe["block"], pipe["kv_blocks"]) == ("causal", 4, 3, 1)
    assert (pipe["audio_scale"], pipe["ref_scale"], pipe["guidance_input"]) == (6.0, 1.0, True)
    assert pipe["adaptive_sink"] is True  # the DMD student trained with AAS streams with it
    assert registry.resolve_model(str(out)) == str(out)  # a weights folder is a model name
    ms = registry.load_model(str(out))
    assert ms.refiner is None and ms.config.strategy == "causal" and ms.config.causal_settings().guidance == (6.0, 1.0)
    stream_two_seconds(ms)


def test_dmd_two_time_scales_update_the_generator_on_some_steps_only(causal_data, tmp_path):
    """fake_updates = 3: the generator gets a DMD gradient on about 1 step in 3 (and its weights
    move only on those), the fake score on every step."""
    task = _dmd_task(causal_data, dmd__fake_updates=3)
    gen = dict(task.nets["dit"].named_parameters())
    fake = dict(task.nets["fake"].named_parameters())
    task.nets["teacher"] = ZeroDataScore()  # a non-zero DMD gradient from the start
    flags = []
    for step in range(9):
        loss, logs = task.loss(step_generator(0, step))
        loss.backward()
        flags.append(logs["gen_update"])
        assert ("dmd" in logs) == bool(logs["gen_update"])
        assert any(p.grad is not None for p in fake.values())
        assert any(p.grad is not None for p in gen.values()) == bool(logs["gen_update"])
        for p in (*gen.values(), *fake.values()):
            p.grad = None
    assert 0 < sum(flags) < 9, flags
    with pytest.raises(Exception, match="fake_updates"):
        make_task(recipe("dmd-tiny", causal_data, dmd__fake_updates=0), torch.device("cpu"))


def test_scores_see_the_window_in_pieces(causal_data):
    """score_window = 3 on a 9-frame window: the real score's prediction for the first piece does
    not depend on the frames of the last piece (each piece is scored on its own, at timeline
    0..2), while the whole-window score (score_window = 0) does."""
    changed = {}
    for window in (0, 3):
        task = _dmd_task(causal_data, dmd__score_window=window)
        b = task.conditions(step_generator(2, 0))
        g = torch.Generator().manual_seed(0)
        xt, mt = torch.randn(b["x0"].shape, generator=g), torch.randn(b["m0"].shape, generator=g)
        sigma = torch.full((xt.shape[0],), 0.7)
        with torch.no_grad():
            x0a, _ = task._score(task.nets["teacher"], b, xt, mt, sigma)
            xt2 = xt.clone()
            xt2[:, :, 6:] += 1.0
            x0b, _ = task._score(task.nets["teacher"], b, xt2, mt, sigma)
        changed[window] = float((x0a[:, :, :3] - x0b[:, :, :3]).abs().max())
    assert changed[3] == 0.0 and changed[0] > 1e-4, changed


def test_dmd_gradient_mouth_emphasis_reweights_without_moving_the_fixed_point(causal_data):
    """dmd.mouth / dmd.eyes multiply the DMD gradient by the flow stages' mouth/eye weight map:
    the same draws give the uniform gradient times that map (largest at the data's mouth), and a
    fake score equal to the real one still gives exactly zero."""
    grads = {}
    for mouth in (0.0, 4.0):
        task = _dmd_task(causal_data, dmd__mouth=mouth, dmd__eyes=mouth / 2)
        b = task.conditions(step_generator(3, 0))
        x0 = torch.randn(b["x0"].shape, generator=torch.Generator().manual_seed(1))
        m0 = torch.randn(b["m0"].shape, generator=torch.Generator().manual_seed(2))
        gx0, _, _ = task.dmd_gradient(b, x0, m0, torch.Generator().manual_seed(4))
        assert float(gx0.abs().max()) == 0.0  # fake == real (both the teacher's weights)
        with torch.no_grad():
            for p in task.nets["fake"].parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        grads[mouth], _, _ = task.dmd_gradient(b, x0, m0, torch.Generator().manual_seed(4))
    flat, weighted = grads[0.0], grads[4.0]
    assert float(flat.abs().mean()) > 0
    w = task.latent_weight(b["clips"], b["starts"], x0.shape[-1])  # [B, 1, T, h, w]
    assert torch.allclose(weighted, flat * w, rtol=1e-5, atol=1e-12)
    pts = latent_points(task.data.table(b["clips"][0]), [b["starts"][0]], x0.shape[-1] / task.data.hr_size)
    mx, my = (int(v) for v in pts[0, :2].clamp(0, x0.shape[-1] - 1))
    assert float(w[0, 0, 0, my, mx]) > float(w[0, 0, 0].min()) * 2


def test_dmd_gradient_block_start_emphasis_and_fake_init(causal_data, tmp_path):
    """dmd.block_start multiplies the DMD gradient at the first frame of every block after the
    first by 1 + block_start (the same draws otherwise give the uniform gradient; fake == real
    still gives zero); dmd.fake_init starts the fake score from given weights instead of the
    teacher's."""
    from safetensors.torch import save_file

    grads = {}
    for weight in (0.0, 2.0):
        task = _dmd_task(causal_data, dmd__block_start=weight)
        b = task.conditions(step_generator(3, 0))
        x0 = torch.randn(b["x0"].shape, generator=torch.Generator().manual_seed(1))
        m0 = torch.randn(b["m0"].shape, generator=torch.Generator().manual_seed(2))
        gx0, _, _ = task.dmd_gradient(b, x0, m0, torch.Generator().manual_seed(4))
        assert float(gx0.abs().max()) == 0.0
        with torch.no_grad():
            for p in task.nets["fake"].parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        grads[weight], _, _ = task.dmd_gradient(b, x0, m0, torch.Generator().manual_seed(4))
    blk, T = task.cfg["block"], task.T
    w = task.block_start_weight()
    assert T > blk and [i for i in range(T) if w[i] != 1.0] == list(range(blk, T, blk)) and float(w[blk]) == 3.0
    assert torch.allclose(grads[2.0], grads[0.0] * w[None, None, :, None, None], rtol=1e-5, atol=1e-12)
    fake = {k: v.clone() for k, v in task.nets["fake"].state_dict().items()}
    save_file(fake, str(tmp_path / "fake.safetensors"))
    started = _dmd_task(causal_data, dmd__fake_init=str(tmp_path / "fake.safetensors"))
    assert all(torch.equal(v, fake[k]) for k, v in started.nets["fake"].state_dict().items())
    assert not all(torch.equal(v, started.nets["teacher"].state_dict()[k])
                   for k, v in started.nets["fake"].state_dict().items())


def test_scores_lead_each_piece_with_the_samples_clean_frame(causal_data):
    """score_given: each piece of score_window − 1 frames is scored after the sample's clean frame
    before it, at σ = 0 (the bidirectional model's training regime: a clean given frame), exactly
    as one call of the DiT on [clean frame, noisy piece] at timeline 0..; the window's frame 0
    leads the first piece, gets velocity 0 and no weight, and a different clean lead frame
    changes the piece's score."""
    from avatarstream.engine.denoiser import guidance_tensor
    from avatarstream.models.transformer import DiTCondition

    task = _dmd_task(causal_data, dmd__score_window=4, dmd__score_given=True)
    b = task.conditions(step_generator(2, 0))
    g = torch.Generator().manual_seed(0)
    xt, mt = torch.randn(b["x0"].shape, generator=g), torch.randn(b["m0"].shape, generator=g)
    x0, m0 = torch.randn(b["x0"].shape, generator=g), torch.randn(b["m0"].shape, generator=g)
    sigma = torch.full((xt.shape[0],), 0.7)
    net = task.nets["teacher"]
    with torch.no_grad():
        v, mv = task._score_velocity(net, b, xt, mt, sigma, (x0, m0))
        # the second piece: frames 4..6, led by the clean frame 3
        ref = net.encode_reference(b["ref_lat"], b["ref_valid"], torch.full((b["ref_lat"].shape[2],), -8.0))
        x_in = torch.cat([x0[:, :, 3:4], xt[:, :, 4:7]], dim=2)
        m_in = torch.cat([m0[:, 3:4], mt[:, 4:7]], dim=1)
        sig = torch.tensor([[0.0, 0.7, 0.7, 0.7]]).expand(xt.shape[0], -1)
        cond = DiTCondition(motion=m_in, audio=b["audio"][:, 3:7], text=b["text"], text_mask=b["text_mask"],
                            t_pos=torch.arange(4, dtype=torch.float32), anchor=b["anchor"],
                            guidance=guidance_tensor(task.teacher_guidance, xt.shape[0], torch.device("cpu")))
        want = net(x_in, sig, cond, ref)
        x0b = x0.clone()
        x0b[:, :, 3] += 1.0
        v2, _ = task._score_velocity(net, b, xt, mt, sigma, (x0b, m0))
    assert torch.allclose(v[:, :, 4:7], want.velocity.float()[:, :, 1:], atol=1e-5)
    assert torch.allclose(mv[:, 4:7], want.motion_velocity.float()[:, 1:], atol=1e-5)
    assert float(v[:, :, 0].abs().max()) == 0.0 and float(mv[:, 0].abs().max()) == 0.0
    assert float(v[:, :, 1:].abs().min(dim=1).values.mean()) > 0  # every other frame scored
    assert task.scored_frames().tolist() == [0.0] + [1.0] * (task.T - 1)
    assert float((v2[:, :, 4:7] - v[:, :, 4:7]).abs().max()) > 1e-4  # the lead frame matters
    assert float((v2[:, :, 1:3] - v[:, :, 1:3]).abs().max()) == 0.0  # only to its own piece
