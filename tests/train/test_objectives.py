"""The latent and VAE objectives (train/objectives/vae.py, a2v.py, cfg_distill.py) beyond "the loss
goes down" (test_trainer.py): what each draws and weighs, and what a trained student does."""

from __future__ import annotations

import json

import pytest
import torch

from avatarstream.train.checkpoints import load_init, net_weights
from avatarstream.train.objectives import make_task
from avatarstream.train.trainer import Trainer

from .helpers import FAST, losses, needs, recipe, run

pytestmark = pytest.mark.usefixtures("one_thread")


# -- vae ------------------------------------------------------------------------------------------
def test_vae_decoder_finetune_keeps_the_latent_space(trained, dataset, tmp_path):
    """`vae.train_encoder = false` from a trained VAE: the encoder (so every prepared latent and
    every DiT trained on them) is bit-identical afterwards, the decoder moved, its loss went
    down, and the frozen half has no optimizer state."""
    over = dict(FAST["vae-tiny"], train__steps=12, train__checkpoint_every=100, vae__train_encoder=False,
                init__vae=str(trained["vae-tiny"]))
    t = run("vae-tiny", dataset, tmp_path / "dec", **over)

    start = net_weights(str(trained["vae-tiny"]), "vae")
    now = t.task.nets["vae"].state_dict()
    enc = [k for k in start if k.startswith(("encoder.", "quant_conv."))]
    dec = [k for k in start if k.startswith(("decoder.", "post_quant_conv."))]
    assert enc and dec
    assert all(torch.equal(start[k], now[k]) for k in enc)
    assert any(not torch.equal(start[k], now[k]) for k in dec)
    assert not any(".encoder." in k or ".quant_conv." in k for k in t.opt.params)


def test_vae_latent_noise_reaches_the_decoder_and_is_drawn_from_the_step(trained, dataset):
    """vae `latent_noise`: the decoder of a trained tiny VAE reconstructs worse from perturbed
    latents (the term is live), and the draw comes from the step's generator (same loss twice)."""
    losses_ = {}
    for amount in (0.0, 1.0):
        r = recipe("vae-tiny", dataset, vae__crop=32, train__batch=2, vae__latent_noise=amount)
        task = make_task(r, torch.device("cpu"))
        load_init(task.nets["vae"], net_weights(str(trained["vae-tiny"]), "vae"), "vae")
        with torch.no_grad():
            got = [task.loss(torch.Generator().manual_seed(s))[1]["l1"] for s in (0, 0, 1, 2)]
        assert got[0] == got[1]
        losses_[amount] = sum(got)
    assert losses_[1.0] > 1.05 * losses_[0.0], losses_


def test_vae_mouth_crops_and_mouth_motion_term(dataset):
    """vae `p_mouth_crop = 1`: every crop holds the mouth (its Gaussian peaks inside, on every
    frame); `mouth_temporal` adds its weight times the logged squared mouth-motion error to the
    loss, from the same draw (same generator, same value either way)."""
    r = recipe("vae-tiny", dataset, vae__crop=32, vae__p_mouth_crop=1.0, train__batch=3)
    task = make_task(r, torch.device("cpu"))
    for seed in range(4):
        _, w, gm, _ = task.sample(torch.Generator().manual_seed(seed))
        assert gm.shape == w.shape
        assert (gm.flatten(2).amax(-1) > 0.5).all()  # the mouth is in every frame of every crop
    r0 = recipe("vae-tiny", dataset, vae__crop=32, vae__p_mouth_crop=1.0, train__batch=2, vae__mouth_temporal=0.0)
    r1 = recipe("vae-tiny", dataset, vae__crop=32, vae__p_mouth_crop=1.0, train__batch=2, vae__mouth_temporal=5.0)
    torch.manual_seed(0)
    t0 = make_task(r0, torch.device("cpu"))
    torch.manual_seed(0)
    t1 = make_task(r1, torch.device("cpu"))
    t1.nets["vae"].load_state_dict(t0.nets["vae"].state_dict())
    l0, m0 = t0.loss(torch.Generator().manual_seed(3))
    l1, m1 = t1.loss(torch.Generator().manual_seed(3))
    assert m0["mouth_temporal"] == pytest.approx(m1["mouth_temporal"]) and m1["mouth_temporal"] > 0
    assert float(l1.detach()) == pytest.approx(float(l0.detach()) + 5.0 * m1["mouth_temporal"], rel=1e-5)


# -- a2v ------------------------------------------------------------------------------------------
def test_ref2v_windows_are_given_the_scene_frame(dataset):
    """a2v ref2v mode with first_frame: frame 0 is given (the driving scene image the engine
    gives its first chunk), half of those windows from a clip's first latent; without it, none."""
    for first in (True, False):
        r = recipe("a2v-tiny", dataset, a2v__first_frame=first, a2v__p_ref2v=1.0, a2v__p_prefix=0.0,
                   a2v__p_interp=0.0, a2v__p_clip_start=1.0, train__batch=3)
        task = make_task(r, torch.device("cpu"))
        b = task.batch(torch.Generator().manual_seed(0))
        if first:
            assert b["given"][:, 0].all() and not b["given"][:, 1:].any()
            assert b["starts"] == [0, 0, 0]
        else:
            assert not b["given"].any()


def test_human_losses_reach_the_dit(dataset, tmp_path):
    """Expert losses on decoded x̂0: finite, bounded cosine distances; the gradient reaches the
    DiT; the ground truth itself scores better on identity than a random DiT's estimate."""
    t = Trainer(recipe("a2v-tiny", dataset, a2v__human_sync=0.1, a2v__human_identity=0.1, train__batch=2,
                       train__steps=4),
                tmp_path / "h", progress=False)
    task = t.task
    b = task.batch(torch.Generator().manual_seed(5))
    out, _ = task.predict(task.nets["dit"], b)
    sync, ident = task.human_losses(b, out.velocity)
    assert 0 <= float(sync.detach()) <= 2 and 0 <= float(ident.detach()) <= 2
    (sync + ident).backward()
    assert sum(float(p.grad.abs().sum()) for p in task.nets["dit"].parameters() if p.grad is not None) > 0
    i, p0 = b["clips"][0], b["starts"][0]
    k = min(4, p0)
    ctx = task.data.latents(i, p0 - k, k)[None] if k else None
    wave = task.data.wave_of(i)
    _, ident_gt = task.human(b["x0"][:1], b["x0"][:1], ctx, p0, wave)
    noise = torch.randn(b["x0"][:1].shape, generator=torch.Generator().manual_seed(1))
    _, ident_noise = task.human(noise, b["x0"][:1], ctx, p0, wave)
    assert float(ident_gt) < float(ident_noise)  # the truth is nearer its identity than noise
    t.run()
    logs = [json.loads(ln) for ln in (tmp_path / "h" / "log.jsonl").read_text().splitlines()]
    assert all("human_sync" in r and "human_identity" in r for r in logs)  # p_human = 1


def test_direct_dit_trains_exports_and_generates_without_a_refiner(trained, dataset, tmp_path, monkeypatch):
    """a2v `direct`: the DiT trains on the HR latents with 2x patches, starting from the LR a2v
    run lifted (`lift_patch_state`); its loss goes down; export writes no refiner and sets
    lr_size = hr_size; the registry model runs the whole chain (SR passes through) and publishes
    hr-size frames for the whole audio."""
    from conftest import stream_two_seconds

    from avatarstream import registry
    from avatarstream.train.export import export
    from avatarstream.weights import load_exported, model_spec

    a2v = str(trained["a2v-tiny"])
    rd = tmp_path / "direct"
    run("a2v-tiny", dataset, rd, train__steps=40, a2v__direct=True, init__dit=a2v, init__audio=a2v,
        init__text=a2v, **FAST["a2v-tiny"])
    ls = losses(rd)
    assert sum(ls[-10:]) < sum(ls[:10]), ls
    out = tmp_path / "weights" / "tiny-direct"
    export([rd], out, dtype="fp32", steps=2)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["pipeline"]["steps"] == 2
    assert not (out / "refiner.safetensors").exists() and "refiner" not in cfg["configs"]
    assert cfg["pipeline"]["lr_size"] == cfg["pipeline"]["hr_size"] == 64
    assert cfg["configs"]["dit"]["patch"] == [1, 4, 4]
    assert "refiner" not in load_exported(out)
    spec = model_spec(out)
    assert spec.refiner is None
    monkeypatch.setitem(registry.MODELS, "tiny-direct", spec)
    ms = registry.load_model("tiny-direct")
    assert ms.refiner is None and ms.config.lr_size == 64 and ms.config.steps == 2
    stream_two_seconds(ms)


# -- cfg-distill ----------------------------------------------------------------------------------
def test_cfg_distilled_student_takes_the_scales_as_inputs(trained, dataset, tmp_path):
    """CFG distillation with the scales as inputs: the student starts as the teacher whatever the
    scales (zero guidance embedding), and after 200 steps its change from low to high scales
    points the way the teacher's guided velocity changes (cosine > 0.15, measured 0.28-0.32; after
    30 steps it is -0.05 to -0.23 with a change 20x too small: the scales were not used yet) with
    a size within 3x (measured 0.83-0.92 of the teacher's change)."""
    init = needs("cfg-distill-tiny", trained)
    task = make_task(recipe("cfg-distill-tiny", dataset, **FAST["cfg-distill-tiny"], **init), torch.device("cpu"))
    task.nets["dit"].load_state_dict(net_weights(trained["a2v-tiny"], "dit"))
    task.after_init()  # teacher = student = the a2v DiT
    teacher, student = task.nets["teacher"].eval(), task.nets["dit"].eval()
    scales = {"low": (1.5, 1.2), "high": (3.5, 2.2)}
    with torch.no_grad():
        b = task.batch(torch.Generator().manual_seed(7))
        g = torch.tensor([scales["high"]] * b["xs"].shape[0])
        assert torch.equal(task.predict(student, b, guidance=g)[0].velocity, task.predict(teacher, b)[0].velocity)
    run("cfg-distill-tiny", dataset, tmp_path / "cfg", train__steps=200, train__checkpoint_every=200,
        **FAST["cfg-distill-tiny"], **init)
    student.load_state_dict(net_weights(tmp_path / "cfg", "dit"))
    cos, ratio = [], []
    for seed in (1, 2, 3):
        b = task.batch(torch.Generator().manual_seed(seed))
        with torch.no_grad():
            full = task.predict(teacher, b)[0].velocity
            no_a = task.predict(teacher, b, audio=False)[0].velocity
            none = task.predict(teacher, b, audio=False, ref=False)[0].velocity
            target = {k: none + r * (no_a - none) + a * (full - no_a) for k, (a, r) in scales.items()}
            guided = {k: task.predict(student, b, guidance=torch.tensor([v] * b["xs"].shape[0]))[0].velocity
                      for k, v in scales.items()}
        dg = (guided["high"] - guided["low"]).flatten()
        dt = (target["high"] - target["low"]).flatten()
        cos.append(float(torch.nn.functional.cosine_similarity(dg, dt, 0)))
        ratio.append(float(dg.norm() / dt.norm()))
    assert min(cos) > 0.15 and 1 / 3 < min(ratio) and max(ratio) < 3, (cos, ratio)


def test_cfg_distill_skips_the_unguided_teacher_pass_at_reference_scale_one(trained, dataset):
    """With every reference scale 1, v(∅, ∅) cancels out of the target (v(∅, r) + a·(v(a, r) −
    v(∅, r))), so the teacher runs two passes, not three."""
    init = needs("cfg-distill-tiny", trained)
    calls, losses_ = {}, {}
    for rmax in (1.0, 2.0):
        over = {**FAST["cfg-distill-tiny"], **init, "cfg-distill__ref_scale_min": 1.0,
                "cfg-distill__ref_scale_max": rmax}
        task = make_task(recipe("cfg-distill-tiny", dataset, **over), torch.device("cpu"))
        task.after_init()
        n = [0]
        predict = task.predict

        def counting(dit, b, **kw):  # type: ignore[no-untyped-def]
            n[0] += dit is task.nets["teacher"]
            return predict(dit, b, **kw)

        task.predict = counting  # type: ignore[method-assign]
        with torch.no_grad():
            losses_[rmax] = float(task.loss(torch.Generator().manual_seed(3))[0])
        calls[rmax] = n[0]
    assert calls == {1.0: 2, 2.0: 3}
    assert torch.isfinite(torch.tensor(losses_[1.0]))
