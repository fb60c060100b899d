"""The training loop (train/trainer.py): every tiny recipe's loss goes down, `--resume` continues
bit for bit, a damaged checkpoint falls back to the one before, a run may be lengthened, and the
loss plots cover every logged value."""

from __future__ import annotations

import json

import pytest
import torch

from avatarstream.errors import ConfigError
from avatarstream.train.checkpoints import list_checkpoints
from avatarstream.train.optim import lr_at
from avatarstream.train.trainer import Trainer

from .helpers import ALL, FAST, STEPS, held_out_loss, losses, needs, recipe, run, state_of

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ALL)
def test_loss_goes_down(trained, dataset, name):
    ls = losses(trained[name])
    assert len(ls) == STEPS[name]
    assert sum(ls[-10:]) < sum(ls[:10])  # training loss (noisy: random sigma, batch 2)
    extra = needs(name, trained)
    t = Trainer(recipe(name, dataset, train__steps=STEPS[name], train__checkpoint_every=10, **FAST[name],
                       **extra),
                trained[name], progress=False)
    before = held_out_loss(t)  # initial weights
    t.restore()
    after = held_out_loss(t)
    assert after < 0.85 * before, (before, after)
    assert len(list_checkpoints(trained[name])) == 2  # keep = 2
    assert (trained[name] / "plots" / "loss.png").stat().st_size > 1000


@pytest.mark.parametrize("name", ALL)
def test_resume_is_bit_for_bit(trained, dataset, tmp_path, name):
    over = dict(FAST[name], train__steps=6, train__checkpoint_every=100, **needs(name, trained))
    straight = run(name, dataset, tmp_path / "straight", **over)
    run(name, dataset, tmp_path / "split", max_steps=3, **over)  # "killed" after its step-3 checkpoint
    assert [c[0] for c in list_checkpoints(tmp_path / "split")] == [3]
    with open(tmp_path / "split" / "log.jsonl", "a") as f:  # a line logged after the checkpoint
        f.write(json.dumps({"step": 3, "loss": 123.0}) + "\n")
    resumed = run(name, dataset, tmp_path / "split", resume=True, **over)
    a, b = state_of(straight), state_of(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert losses(tmp_path / "straight") == losses(tmp_path / "split")


def test_damaged_checkpoint_falls_back_and_resume_needs_same_recipe(dataset, tmp_path):
    over = dict(FAST["a2v-tiny"], train__steps=4, train__checkpoint_every=2)
    run("a2v-tiny", dataset, tmp_path / "r", **over)
    (tmp_path / "r" / "ckpt-00000004.safetensors").write_bytes(b"\0" * 10)  # torn write
    t = Trainer(recipe("a2v-tiny", dataset, **over), tmp_path / "r", progress=False)
    assert t.restore() and t.step == 2
    with pytest.raises(ConfigError):
        run("a2v-tiny", dataset, tmp_path / "r")  # checkpoints present, no --resume
    with pytest.raises(ConfigError):
        run("a2v-tiny", dataset, tmp_path / "r", resume=True, **dict(over, a2v__motion=0.9))


def test_resume_may_lengthen_a_run_and_records_it(dataset, tmp_path):
    """`--resume --set train.steps=N`: a finished run continues to N; the lr schedule from the
    checkpoint on follows N; the change is recorded; any other change is still refused."""
    over = dict(FAST["a2v-tiny"], train__checkpoint_every=2)
    first = run("a2v-tiny", dataset, tmp_path / "r", **dict(over, train__steps=4))
    w4 = {k: v.clone() for k, v in state_of(first).items()}
    with pytest.raises(ConfigError, match="not past"):
        run("a2v-tiny", dataset, tmp_path / "r", resume=True, **dict(over, train__steps=3))
    t = run("a2v-tiny", dataset, tmp_path / "r", resume=True, **dict(over, train__steps=8))
    assert t.step == 8 and t.steps_changed == [[4, 4, 8]]
    assert any(not torch.equal(w4[k], v) for k, v in state_of(t).items())
    rows = [json.loads(ln) for ln in (tmp_path / "r" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(8))
    tr = t.recipe["train"]
    assert rows[5]["lr"] == pytest.approx(lr_at(5, lr=tr["lr"], warmup=tr["warmup"], total=8,
                                                min_ratio=tr["min_lr_ratio"]), rel=1e-4)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["steps_changed"] == [[4, 4, 8]]
    # a further lengthening keeps the history; a change of anything else is refused
    t = run("a2v-tiny", dataset, tmp_path / "r", resume=True, **dict(over, train__steps=10))
    assert t.steps_changed == [[4, 4, 8], [8, 8, 10]]
    with pytest.raises(ConfigError, match="different recipe"):
        run("a2v-tiny", dataset, tmp_path / "r", resume=True, **dict(over, train__steps=12, a2v__motion=0.9))


# -- export ---------------------------------------------------------------------------------------


def test_loss_plots_cover_values_logged_on_some_steps_only(tmp_path):
    """A value a run logs on some steps only (DMD's generator values, with fake_updates > 1) gets
    its plot even when the last row lacks it; flags and timings do not."""
    from avatarstream.train.plot import plot_losses

    rows = [{"step": i, "loss": 1.0 / (i + 1), "time_s": float(i), **({"dmd": 0.1 * i} if i % 3 == 0 else {})}
            for i in range(10)]
    (tmp_path / "log.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    names = sorted(p.name for p in plot_losses(tmp_path))
    assert names == ["dmd.png", "loss.png"]
    assert (tmp_path / "plots" / "dmd.png").read_bytes()[:4] == b"\x89PNG"
