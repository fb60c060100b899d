"""Feedback alignment (`grpo`, `dpo`) on the tiny-random model: rollouts are the engine's own
run, the policy gradient has the right sign and climbs a toy reward, the KL term pulls a
perturbed policy back, DPO widens the chosen/rejected margin, and the aligned model exports.

Toy rewards (mean brightness of the frames) stand in for the expert terms where a test needs a
reward the tiny random model can move in a few steps; tests/train/test_rewards.py covers the
terms themselves and one test runs the whole command with them."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from avatarstream.cli import main
from avatarstream.eval.benchmark import generate
from avatarstream.train.objectives.grpo import (GRPOTask, clipped_surrogate, gaussian_logp, group_advantages,
                                                step_mean)
from avatarstream.train.recipe import load_recipe
from avatarstream.train.rollout import denoiser_for, load_rollout, rollout, save_rollout
from avatarstream.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")
RECIPE = "recipes/grpo-tiny.toml"


def brightness(vids, cond):  # noqa: ANN001 - the toy reward: mean grey level of each video
    return [{"total": float(v.astype(np.float32).mean() / 255)} for v in vids]


@pytest.fixture(scope="module")
def task():
    t = GRPOTask(load_recipe(RECIPE), torch.device("cpu"))
    t.after_init()
    t.conditions()
    return t


def test_group_advantages():
    r = torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0], [0.0, 0.0, 100.0]])
    a = group_advantages(r, clip=1.2)
    assert torch.allclose(a[0], torch.tensor([-1.2247, 0.0, 1.2247]).clamp(-1.2, 1.2), atol=1e-4)
    assert torch.equal(a[1], torch.zeros(3))  # equal rewards teach nothing
    assert a[2, 2] == 1.2 and torch.allclose(a[2, :2], torch.full((2,), -0.7071), atol=1e-4)
    assert torch.allclose(a.sum(1)[:2], torch.zeros(2), atol=1e-6)


def test_clipped_surrogate_stops_outside_the_trust_region():
    for logp_v, adv, moves in ((0.0, 1.0, True), (0.5, 1.0, False), (0.5, -1.0, True), (-0.5, -1.0, False)):
        logp = torch.tensor(logp_v, requires_grad=True)
        loss, ratio = clipped_surrogate(logp, torch.tensor(0.0), adv, clip=0.2)
        loss.backward()
        assert (logp.grad.abs() > 0) == moves, (logp_v, adv, float(ratio))
        if moves:  # inside (or pulling back into) the region: −A·ρ·∇logp
            assert logp.grad == pytest.approx(-adv * float(ratio))


def test_rollout_is_what_generate_renders(task):
    cond = task.conditions()[0]
    task.sync_rollout_policy()
    r = rollout(task.models, cond, seed=0)
    ref = generate(task.models, cond.reference, cond.audio, len(r.frames))
    assert np.array_equal(r.frames, ref.frames) and r.chunk_starts == ref.chunk_starts
    assert len(r.chunks) >= 2 and r.chunks[1].given.any()  # the prefix hand-off is in the record
    # the record replays: the ODE from each recorded state with the policy gives the next one
    ch = r.chunks[1]
    den = denoiser_for(task.nets["dit"], ch)
    for j in range(len(ch.states) - 1):
        s, s_next = float(ch.sigmas[j]), float(ch.sigmas[j + 1])
        with torch.no_grad():
            nxt = ch.states[j] + (s_next - s) * den(ch.states[j], torch.tensor(s))
        assert torch.allclose(nxt, ch.states[j + 1], atol=1e-5)


def test_record_file_round_trip(task, tmp_path):
    r = rollout(task.models, task.conditions()[1], seed=4, sampler="stochastic", overshoot=0.5)
    save_rollout(tmp_path / "r.safetensors", r, {"condition": "x"})
    chunks, header = load_rollout(tmp_path / "r.safetensors")
    assert header["condition"] == "x" and header["seed"] == 4 and len(chunks) == len(r.chunks)
    for a, b in zip(chunks, r.chunks):
        assert all(torch.equal(x, y) for x, y in zip(a.states, b.states))
        assert torch.equal(a.reference.k[0], b.reference.k[0]) and a.overshoot == 0.5
        assert torch.equal(denoiser_for(task.nets["anchor"], a)(a.states[0], a.sigmas[0]),
                           denoiser_for(task.nets["anchor"], b)(b.states[0], b.sigmas[0]))
    (tmp_path / "bad.safetensors").write_bytes(b"not a record")
    with pytest.raises(Exception, match="not a rollout record"):
        load_rollout(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_flow_grpo_gradient_moves_the_sample_probability(task, adv):
    """One SGD step on the surrogate raises log p of the recorded transition for A > 0 and
    lowers it for A < 0 (the sign and target of the policy gradient)."""
    r = rollout(task.models, task.conditions()[0], seed=7, sampler="stochastic", overshoot=0.5)
    ch = r.chunks[1]
    net = task.nets["dit"]
    net.requires_grad_(True)
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    try:
        def logp() -> torch.Tensor:
            mean, std = step_mean(net, ch, 0)
            return gaussian_logp(ch.states[1], mean, std, ch.free_mask())

        before = logp()
        loss, _ = clipped_surrogate(before, before.detach(), adv, clip=0.2)
        loss.backward()
        with torch.no_grad():
            for p in net.parameters():
                if p.grad is not None:  # the reference encoder's own layers are held fixed
                    p -= 1e-3 * p.grad
                    p.grad = None
            after = logp()
        assert (float(after) - float(before.detach())) * adv > 0
    finally:
        net.load_state_dict(saved)
        net.requires_grad_(False)


@pytest.mark.parametrize("method", ["flow-grpo", "nft"])
def test_kl_term_pulls_a_perturbed_policy_back(task, method):
    """With every advantage 0 the loss is the KL term alone: a few steps on it bring a perturbed
    policy's weights back toward the anchor."""
    task.cfg = {**task.cfg, "method": method, "kl": 1.0}
    net, anchor = task.nets["dit"], task.nets["anchor"]
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    r = rollout(task.models, task.conditions()[0], seed=3, sampler="stochastic", overshoot=0.5)
    try:
        torch.manual_seed(0)
        with torch.no_grad():
            for p in net.parameters():
                p += 0.02 * torch.randn_like(p)
        dist = lambda: sum(float((p - q).square().sum()) for p, q in zip(net.parameters(), anchor.parameters()))  # noqa: E731
        net.requires_grad_(True)
        opt = torch.optim.SGD(net.parameters(), lr=0.05 if method == "flow-grpo" else 0.01)
        d0, kls = dist(), []
        for i in range(4):
            task.sync_rollout_policy()  # the round's old policy is the current one (the flow terms cancel)
            g = torch.Generator().manual_seed(0)  # the same σ and noise: the same KL measured each time
            part, logs = (task._flow_grpo(r.chunks[1], 0.0) if method == "flow-grpo" else task._nft(r.chunks[1], 0.0, g))
            opt.zero_grad()
            part.backward()
            opt.step()
            kls.append(logs["kl"])
        assert kls[-1] < 0.5 * kls[0], kls
        if method == "flow-grpo":  # its KL reads every weight the mean uses: the weights come back too
            assert dist() < d0, (d0, dist())
    finally:
        net.load_state_dict(saved)
        net.requires_grad_(False)
        task.cfg = dict(load_recipe(RECIPE)["grpo"])
        task.sync_rollout_policy()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_policy_climbs_a_toy_reward(tmp_path, monkeypatch, sign):
    """Six GRPO steps on the toy reward (±brightness): held-out rollouts (other seeds, the ODE
    sampler `generate` uses) move the way the reward asks."""
    monkeypatch.setattr(GRPOTask, "rewards",
                        lambda self, v, c: [{"total": sign * d["total"]} for d in brightness(v, c)])
    rec = load_recipe(RECIPE, ["train.lr=5e-3", "train.steps=6", "train.ema=0.0", "train.warmup=0"])
    tr = Trainer(rec, tmp_path / "run", progress=False)

    def bright() -> float:
        tr.task.sync_rollout_policy()
        return float(np.mean([rollout(tr.task.models, c, s).frames.mean() / 255
                              for c in tr.task.conditions() for s in (101, 102)]))

    b0 = bright()
    summary = tr.run()
    b1 = bright()
    assert summary["step"] == 6
    assert sign * (b1 - b0) > 0.004, (b0, b1)  # measured +0.014 for the + sign on this CPU
    rows = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert all(0 < r["kl"] < 5 for r in rows[1:]) and rows[0]["ratio_dev"] < 1e-4


def test_dpo_widens_the_preference_margin(task, tmp_path):
    """Two renders of one condition, the brighter preferred: DPO steps raise the policy's implicit
    margin (anchor error − policy error, chosen minus rejected)."""
    cond = task.conditions()[0]
    task.sync_rollout_policy()
    rs = [rollout(task.models, cond, seed=s) for s in (1, 2)]
    order = sorted(range(2), key=lambda i: -rs[i].frames.mean())
    for i, r in enumerate(rs):
        save_rollout(tmp_path / f"r{i}.safetensors", r)
    (tmp_path / "prefs.jsonl").write_text(json.dumps({"chosen": f"r{order[0]}.safetensors",
                                                      "rejected": f"r{order[1]}.safetensors"}) + "\n")
    rec = load_recipe("recipes/dpo-tiny.toml", [f"dpo.prefs=\"{tmp_path / 'prefs.jsonl'}\"", "train.steps=5",
                                                "train.ema=0.0"])
    summary = Trainer(rec, tmp_path / "run", progress=False).run()
    rows = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert summary["step"] == 5
    assert abs(rows[0]["margin"]) < 1e-6  # the policy starts as the anchor
    assert np.mean([r["margin"] for r in rows[-2:]]) > 0 and rows[-1]["loss"] < rows[0]["loss"]


def test_train_grpo_command_runs_with_the_reward_terms_and_exports(tmp_path, capsys):
    """`train grpo RECIPE` end to end with the real reward terms (1 step), then export: the
    aligned model loads, runs, and has the run's DiT."""
    run = tmp_path / "run"
    assert main(["train", "grpo", RECIPE, "--run-dir", str(run), "--max-steps", "1", "--no-progress",
                 "--set", "train.steps=1", "--set", "grpo.group=2", "--set", "train.batch=1"]) == 0
    row = json.loads((run / "log.jsonl").read_text().splitlines()[0])
    assert {"reward", "sync", "identity", "kl"} <= set(row)
    capsys.readouterr()
    assert main(["train", "export", str(run), "--out", str(tmp_path / "w")]) == 0
    cfg = json.loads((tmp_path / "w" / "config.json").read_text())
    assert cfg["aligned"]["stage"] == "grpo" and cfg["aligned"]["base"] == "tiny-random"
    from avatarstream.registry import load_model
    from avatarstream.train.checkpoints import load_checkpoint

    m = load_model(str(tmp_path / "w"), bf16=False)
    _, t = load_checkpoint(run)
    k = next(iter(m.dit.model.state_dict()))
    assert torch.equal(m.dit.model.state_dict()[k].float(), t[f"ema.dit.{k}"].float())
    assert main(["train", "dpo", RECIPE, "--run-dir", str(tmp_path / "x")]) == 2  # a grpo recipe
    assert "is a 'grpo' recipe" in capsys.readouterr().err


def test_train_pairs_writes_a_resumable_pairs_folder(tmp_path):
    out = tmp_path / "pairs"
    args = ["train", "pairs", "--model", "tiny-random", "--out", str(out), "--conditions", "1", "--seconds", "1",
            "--no-progress"]
    assert main(args) == 0
    line = json.loads((out / "pairs.jsonl").read_text())
    assert line["left"] != line["right"] and set(line["auto"]) == {"left", "right"}
    for side in ("left", "right"):
        assert (out / line[side]).stat().st_size > 1000
        assert len(load_rollout(out / line[f"{side}_record"])[0]) >= 2
    (out / "pairs.jsonl").unlink()
    assert main(args) == 0 and (out / "pairs.jsonl").is_file()  # the renders are kept, not redone
    # people or the reward decide, DPO trains on the decision (the file written outside the folder)
    prefs = tmp_path / "elsewhere" / "prefs.jsonl"
    prefs.parent.mkdir()
    assert main(["annotate", "auto", str(out), "--out", str(prefs), "--margin", "0"]) == 0
    assert main(["train", "dpo", "recipes/dpo-tiny.toml", "--run-dir", str(tmp_path / "dpo"), "--no-progress",
                 "--set", f"dpo.prefs=\"{prefs}\"", "--set", "train.steps=1"]) == 0
    assert json.loads((tmp_path / "dpo" / "log.jsonl").read_text())["accuracy"] in (0.0, 1.0)
    shutil.rmtree(out)


def test_grpo_resumes_onto_the_uninterrupted_trajectory(tmp_path, monkeypatch):
    """Killed after step 1 and resumed, a GRPO run ends with the uninterrupted run's weights: the
    conditions, rollout seeds and sampler noise of a step come from its generator."""
    monkeypatch.setattr(GRPOTask, "rewards", lambda self, v, c: brightness(v, c))
    sets = ["train.steps=2", "train.checkpoint_every=1", "grpo.group=2"]
    whole = Trainer(load_recipe(RECIPE, sets), tmp_path / "a", progress=False)
    whole.run()
    Trainer(load_recipe(RECIPE, sets), tmp_path / "b", progress=False, max_steps=1).run()
    resumed = Trainer(load_recipe(RECIPE, sets), tmp_path / "b", progress=False)
    resumed.run(resume=True)
    for (k, p), (_, q) in zip(whole.named, resumed.named):
        assert torch.equal(p, q), k


@pytest.mark.slow
def test_grpo_under_torchrun_ddp(tmp_path):
    """`--nproc 2`: two ranks, one condition each (DDP; FSDP2 is refused for this stage)."""
    assert main(["train", "grpo", RECIPE, "--run-dir", str(tmp_path / "r"), "--nproc", "2", "--no-progress",
                 "--set", "train.steps=1", "--set", "grpo.group=2"]) == 0
    row = json.loads((tmp_path / "r" / "log.jsonl").read_text().splitlines()[0])
    assert row["step"] == 0 and "reward" in row and "sync" in row
    assert main(["train", "grpo", RECIPE, "--run-dir", str(tmp_path / "f"), "--nproc", "2",
                 "--shard", "fsdp"]) == 2
