"""Training: every recipe on tiny configs and a tiny synthetic dataset made here — the loss goes
down, `--resume` continues bit for bit, export loads into the registry's model classes; Muon's
update is orthogonalised; user mistakes are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from avatarstream.train.data import FRAME_KEYS, PreparedData, clip_bytes, motion_descriptor, prepare
from avatarstream.train.optim import MuonAdamW, is_muon_param, newton_schulz
from avatarstream.train.recipe import load_recipe
from avatarstream.train.tasks import build_nets
from avatarstream.train.trainer import Trainer, list_checkpoints

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> dict[str, Path]:
    """2 identities x 2 scenes x 1 s at 64 px, and its prepared file (random tiny VAE)."""
    from avatarstream.data.generate import DatasetConfig, generate

    d = tmp_path_factory.mktemp("train-data")
    generate(DatasetConfig(identities=2, clips_per_identity=2, seconds=1.0, size=64), d / "synth")
    vae = build_nets("tiny")["vae"].init_random_(0)  # random features, not the pooling init
    summary = prepare(d / "synth", vae, d / "prep.safetensors", lr_size=32, hr_size=64)
    return {"shards": d / "synth", "prepared": d / "prep.safetensors", "summary": summary, "dir": d}


def recipe(name: str, dataset: dict, **over: object) -> dict:
    sets = [f'data.shards="{dataset["shards"]}"', f'data.prepared="{dataset["prepared"]}"']
    sets += [f"{k.replace('__', '.')}={json.dumps(v) if isinstance(v, (str, bool)) else v}" for k, v in over.items()]
    return load_recipe(RECIPES / f"{name}.toml", sets)


def run(name: str, dataset: dict, run_dir: Path, *, max_steps: int | None = None, resume: bool = False,
        **over: object) -> Trainer:
    t = Trainer(recipe(name, dataset, **over), run_dir, max_steps=max_steps, progress=False)
    t.run(resume=resume)
    return t


def losses(run_dir: Path) -> list[float]:
    return [json.loads(ln)["loss"] for ln in (run_dir / "log.jsonl").read_text().splitlines()]


FAST = {"vae-tiny": {"vae__crop": 32, "train__batch": 2},
        "a2v-tiny": {"train__batch": 2},
        "sr-tiny": {"train__batch": 2},
        "cfg-distill-tiny": {"train__batch": 2}}
STEPS = {"vae-tiny": 30, "a2v-tiny": 60, "sr-tiny": 60, "cfg-distill-tiny": 30}  # seconds each on one core
ALL = list(STEPS)


def needs(name: str, runs: dict[str, Path]) -> dict[str, str]:
    """[init] overrides: sr and cfg-distill start from the a2v run (audio/text; cfg: the DiT too)."""
    if name == "sr-tiny":
        return {"init__audio": str(runs["a2v-tiny"]), "init__text": str(runs["a2v-tiny"])}
    if name == "cfg-distill-tiny":
        return {f"init__{n}": str(runs["a2v-tiny"]) for n in ("dit", "audio", "text")}
    return {}


@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory) -> dict[str, Path]:
    """Each tiny recipe trained for STEPS steps (shared by the loss and export tests)."""
    out = {}
    root = tmp_path_factory.mktemp("runs")
    for name in ALL:
        extra = needs(name, out)
        run(name, dataset, root / name, train__steps=STEPS[name], train__checkpoint_every=10, **FAST[name],
            **extra)
        out[name] = root / name
    return out


def test_every_recipe_file_loads_and_its_init_runs_come_from_recipes():
    """Each recipes/*.toml resolves (unknown keys are errors), and every `[init]` path (and a DMD
    teacher or fake score) under runs/ names a run another recipe makes, so a chain can be
    replayed from the recipes alone."""
    names = {p.stem for p in RECIPES.glob("*.toml")}
    assert len(names) >= 10
    for p in RECIPES.glob("*.toml"):
        r = load_recipe(p)
        assert r["name"] == p.stem
        sources = list(r["init"].values()) + [r.get("dmd", {}).get(k, "") for k in ("teacher", "fake_init")]
        for src in sources:
            if src.startswith("runs/"):
                assert src.split("/")[1] in names, (p.name, src)


# -- optimiser ----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(64, 128), (128, 64), (48, 48)])
def test_newton_schulz_orthogonalises(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    if shape[0] == shape[1]:  # well-conditioned square matrix (a random square one has sigma_min ~ 0)
        q, _ = torch.linalg.qr(g)
        g = q @ torch.diag(torch.linspace(0.1, 3.0, shape[0])) @ q.T
    s = torch.linalg.svdvals(newton_schulz(g))
    assert s.min() > 0.6 and s.max() < 1.25, s
    assert abs(float(s.mean()) - 1.0) < 0.2  # the quintic settles in ~[0.68, 1.13], not at 1


def test_muon_update_is_orthogonal_and_groups_are_right():
    nets = build_nets("tiny")
    named = [(f"dit.{k}", p) for k, p in nets["dit"].named_parameters()]
    groups = {k for k, p in named if is_muon_param(k.split(".", 1)[1], p)}
    assert "dit.blocks.0.self_attn.q.weight" in groups and "dit.blocks.1.ffn.2.weight" in groups
    for k in ("dit.patch_embedding.weight", "dit.blocks.0.modulation", "dit.blocks.0.self_attn.q.bias",
              "dit.head.head.weight", "dit.text_embedding.0.weight", "dit.blocks.0.norm3.weight"):
        assert k not in groups, k
    w = torch.nn.Parameter(torch.randn(32, 64))
    opt = MuonAdamW([("net.blocks.0.w.weight", w)], weight_decay=0.0, momentum=0.0)
    assert opt.muon == {"net.blocks.0.w.weight"}
    before = w.detach().clone()
    w.grad = torch.randn(32, 64)
    opt.step(lr=0.01)
    delta = (before - w.detach()) / (0.01 * opt.muon_scale * 64 ** 0.5)
    s = torch.linalg.svdvals(delta)
    assert s.min() > 0.6 and s.max() < 1.25


# -- data ---------------------------------------------------------------------------------------
def test_prepared_file_layout(dataset):
    data = PreparedData(dataset["prepared"])
    s = dataset["summary"]
    # latents stored at unit scale per channel; the file's VAE (stats folded in) encodes to them
    both = torch.cat([data.lr.transpose(0, 1).flatten(1), data.hr.transpose(0, 1).flatten(1)], 1)
    assert both.mean(1).abs().max() < 0.02 and (both.std(1) - 1).abs().max() < 0.02
    from avatarstream.data.shards import ShardReader
    from avatarstream.train.data import encode_video

    vae = build_nets("tiny")["vae"]
    vae.load_state_dict(data.vae_state)
    reader = ShardReader(dataset["shards"])
    rec = reader.load(next(e for e in reader.entries() if e["key"] == data.clips[0]["key"]))
    n = data.clips[0]["frames"]
    video = torch.from_numpy(rec.frames[:n]).permute(3, 0, 1, 2).float().div(127.5).sub(1.0)[None]
    z = encode_video(vae.eval(), video)[0].permute(1, 0, 2, 3)
    stored = data.hr[: data.clips[0]["latents"]]
    assert (z - stored).abs().max() < 0.02  # float16 storage
    assert s["clips"] == 4 and s["identities"] == 2
    c = data.clips[0]
    assert data.lr.shape[1:] == (4, 4, 4) and data.hr.shape[1:] == (4, 8, 8)
    assert c["latents"] == 1 + (c["frames"] - 1) // 4 and data.table(0).shape == (c["frames"], len(FRAME_KEYS))
    # every clip's identity has another scene: cross-scene references exist
    j, cross = data.other_scene(0, torch.Generator().manual_seed(0))
    assert cross and data.clips[j]["identity"] == c["identity"] and data.clips[j]["scene"] != c["scene"]
    per_clip = clip_bytes(4, 4, 1.0)
    vae_bytes = sum(v.numel() * v.element_size() for v in data.vae_state.values())
    assert s["bytes_per_clip"] < 2 * per_clip + 4096 + vae_bytes / s["clips"]
    m = motion_descriptor(data.table(0), torch.arange(3), 16)
    assert m.shape == (3, 16) and torch.all(m[:, 12:] == 0) and m[:, :3].abs().max() < 5


# -- every recipe -------------------------------------------------------------------------------
def held_out_loss(t: Trainer) -> float:
    """Mean loss over 6 fixed batches (generators of steps the run never draws), no grad."""
    from avatarstream.train.trainer import step_generator

    with torch.no_grad(), t._autocast():
        return sum(float(t.task.loss(step_generator(99, 10_000 + i))[0]) for i in range(6)) / 6


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


def _state(t: Trainer) -> dict[str, torch.Tensor]:
    return t.state_tensors()


@pytest.mark.parametrize("name", ALL)
def test_resume_is_bit_for_bit(trained, dataset, tmp_path, name):
    over = dict(FAST[name], train__steps=6, train__checkpoint_every=100, **needs(name, trained))
    straight = run(name, dataset, tmp_path / "straight", **over)
    run(name, dataset, tmp_path / "split", max_steps=3, **over)  # "killed" after its step-3 checkpoint
    assert [c[0] for c in list_checkpoints(tmp_path / "split")] == [3]
    with open(tmp_path / "split" / "log.jsonl", "a") as f:  # a line logged after the checkpoint
        f.write(json.dumps({"step": 3, "loss": 123.0}) + "\n")
    resumed = run(name, dataset, tmp_path / "split", resume=True, **over)
    a, b = _state(straight), _state(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert losses(tmp_path / "straight") == losses(tmp_path / "split")


def test_damaged_checkpoint_falls_back_and_resume_needs_same_recipe(dataset, tmp_path):
    from avatarstream.errors import ConfigError

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
    import json as _json

    from avatarstream.errors import ConfigError
    from avatarstream.train.optim import lr_at

    over = dict(FAST["a2v-tiny"], train__checkpoint_every=2)
    first = run("a2v-tiny", dataset, tmp_path / "r", **dict(over, train__steps=4))
    w4 = {k: v.clone() for k, v in _state(first).items()}
    with pytest.raises(ConfigError, match="not past"):
        run("a2v-tiny", dataset, tmp_path / "r", resume=True, **dict(over, train__steps=3))
    t = run("a2v-tiny", dataset, tmp_path / "r", resume=True, **dict(over, train__steps=8))
    assert t.step == 8 and t.steps_changed == [[4, 4, 8]]
    assert any(not torch.equal(w4[k], v) for k, v in _state(t).items())
    rows = [_json.loads(ln) for ln in (tmp_path / "r" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(8))
    tr = t.recipe["train"]
    assert rows[5]["lr"] == pytest.approx(lr_at(5, lr=tr["lr"], warmup=tr["warmup"], total=8,
                                                min_ratio=tr["min_lr_ratio"]), rel=1e-4)
    summary = _json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["steps_changed"] == [[4, 4, 8]]
    # a further lengthening keeps the history; a change of anything else is refused
    t = run("a2v-tiny", dataset, tmp_path / "r", resume=True, **dict(over, train__steps=10))
    assert t.steps_changed == [[4, 4, 8], [8, 8, 10]]
    with pytest.raises(ConfigError, match="different recipe"):
        run("a2v-tiny", dataset, tmp_path / "r", resume=True, **dict(over, train__steps=12, a2v__motion=0.9))


# -- export ---------------------------------------------------------------------------------------
def test_export_loads_into_registry(trained, dataset, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from avatarstream import registry
    from avatarstream.train.export import export, load_exported, model_spec

    out = tmp_path / "weights" / "tiny-trained"
    runs = [trained["cfg-distill-tiny"], trained["a2v-tiny"], trained["sr-tiny"], trained["vae-tiny"]]
    s = export(runs, out, dtype="fp32")
    assert set(s["trained"]) == {"dit", "audio", "text", "refiner", "vae"} and not s["untrained"]
    # the VAE is the one the latent runs' prepared file was made with (latent statistics folded in)
    prep = load_file(str(dataset["prepared"]))
    assert s["trained"]["vae"] == str(dataset["prepared"])
    assert torch.equal(load_file(str(out / "vae.safetensors"))["quant_conv.bias"], prep["vae.quant_conv.bias"])
    assert s["trained"]["dit"] == str(trained["cfg-distill-tiny"]) and s["trained"]["audio"] == str(trained["a2v-tiny"])
    nets = load_exported(out)  # strict load into the model classes
    ck = load_file(str(sorted((trained["cfg-distill-tiny"]).glob("ckpt-*.safetensors"))[-1]))
    sd = nets["dit"].state_dict()
    assert torch.equal(sd["blocks.0.self_attn.q.weight"], ck["ema.dit.blocks.0.self_attn.q.weight"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"] == "tiny" and cfg["pipeline"]["hr_size"] == 64
    # the DiT takes the CFG scales as inputs: the distill run's scales are the model's defaults
    assert (cfg["pipeline"]["audio_scale"], cfg["pipeline"]["ref_scale"]) == (3.0, 1.5)
    monkeypatch.setitem(registry.MODELS, "tiny-trained", model_spec(out))
    ms = registry.load_model("tiny-trained")
    assert ms.config.guidance == (3.0, 1.5)
    assert torch.equal(ms.vae.model.state_dict()["quant_conv.weight"],
                       load_file(str(out / "vae.safetensors"))["quant_conv.weight"])
    # default storage: bf16, half the bytes, loads into the same classes
    s16 = export(runs, tmp_path / "w16")
    assert s16["bytes"] < 0.55 * s["bytes"]
    w16 = load_exported(tmp_path / "w16")["dit"].state_dict()["blocks.0.self_attn.q.weight"]
    assert torch.equal(w16, sd["blocks.0.self_attn.q.weight"].bfloat16().float())



def test_export_shares_identical_files_with_another_folder(trained, dataset, tmp_path, monkeypatch):
    """`export --share-with A`: networks byte-identical to A's are referred to (path + sha256),
    not copied; the model loads the same weights as a full copy through the registry, `export`'s
    own readers and `[init]`; a shared file that changed or is missing is one clear error."""
    from avatarstream import registry
    from avatarstream.errors import InputError
    from avatarstream.train.export import export, load_exported, model_spec
    from avatarstream.train.trainer import net_weights

    runs = [trained["cfg-distill-tiny"], trained["a2v-tiny"], trained["sr-tiny"], trained["vae-tiny"]]
    a = tmp_path / "w" / "a"
    export(runs, a)
    full = tmp_path / "w" / "full"
    export(runs[:1] + runs[2:], full)  # text/audio from the distill run's frozen copies
    b = tmp_path / "w" / "b"
    s = export(runs[:1] + runs[2:], b, share_with=a)
    cfg = json.loads((b / "config.json").read_text())
    same = {n for n in ("dit", "vae", "audio", "text", "refiner")
            if (a / f"{n}.safetensors").read_bytes() == (full / f"{n}.safetensors").read_bytes()}
    assert same and s["shared"] == sorted(same) == sorted(cfg["shared"])
    assert "dit" in same  # the same distill run's EMA DiT
    for n in same:
        assert not (b / f"{n}.safetensors").exists() and cfg["shared"][n]["file"] == f"../a/{n}.safetensors"
    want, got = load_exported(full), load_exported(b)
    for n in want:
        for k, v in want[n].state_dict().items():
            assert torch.equal(v, got[n].state_dict()[k]), (n, k)
    n = sorted(same)[0]
    assert all(torch.equal(v, net_weights(full, n)[k]) for k, v in net_weights(b, n).items())
    monkeypatch.setitem(registry.MODELS, "tiny-b", model_spec(b))
    ms = registry.load_model("tiny-b")
    assert torch.equal(ms.dit.model.state_dict()["blocks.0.self_attn.q.weight"],
                       want["dit"].state_dict()["blocks.0.self_attn.q.weight"])
    f = a / f"{n}.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(InputError, match="has changed since the export"):
        load_exported(b)
    f.unlink()
    with pytest.raises(InputError, match="which is missing"):
        registry.load_model("tiny-b")
    with pytest.raises(InputError, match="not a weights folder"):
        export(runs, tmp_path / "w" / "c", share_with=tmp_path)
    with pytest.raises(InputError, match="is the --out folder"):
        export(runs, full, share_with=full)



def test_prepare_keeps_an_exported_models_vae_as_it_is(trained, dataset, tmp_path):
    """`train prepare --vae WEIGHTS` (statistics already folded in): the file holds that VAE
    exactly and its latents as that VAE encodes them, so preparing again from the file changes
    nothing, and an export of a run on it shares the model's VAE file byte for byte. A VAE run
    folder's VAE is still folded (unit-scale latents)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from avatarstream.cli import main
    from avatarstream.train.export import export

    w = tmp_path / "w"
    export([trained["cfg-distill-tiny"], trained["sr-tiny"]], w)
    base = ["train", "prepare", "--shards", str(dataset["shards"]), "--model", "tiny", "--no-progress"]
    assert main([*base, "--vae", str(w), "--out", str(tmp_path / "a.safetensors")]) == 0
    assert main([*base, "--vae", str(tmp_path / "a.safetensors"), "--out", str(tmp_path / "b.safetensors")]) == 0
    assert main([*base, "--vae", str(trained["vae-tiny"]), "--out", str(tmp_path / "r.safetensors")]) == 0
    a, b = load_file(str(tmp_path / "a.safetensors")), load_file(str(tmp_path / "b.safetensors"))
    mine = load_file(str(w / "vae.safetensors"))
    for k, v in mine.items():
        assert torch.equal(a[f"vae.{k}"], v.float()) and torch.equal(b[f"vae.{k}"], a[f"vae.{k}"]), k
    assert torch.equal(a["hr"], b["hr"]) and torch.equal(a["lr"], b["lr"])
    meta = lambda f: json.loads(safe_open(str(tmp_path / f), "pt").metadata()["avatarstream"])["stats"]  # noqa: E731
    assert meta("a.safetensors")["folded"] is False and meta("r.safetensors")["folded"] is True
    r = load_file(str(tmp_path / "r.safetensors"))["hr"].float()
    assert abs(float(r.std()) - 1.0) < 0.05
    # a run on the file exports with the model's own VAE: shared, not copied
    rd = tmp_path / "run"
    run("a2v-tiny", dataset, rd, train__steps=2, data__prepared=str(tmp_path / "a.safetensors"),
        **FAST["a2v-tiny"])
    s = export([rd], tmp_path / "w2", share_with=w)
    assert "vae" in s["shared"]


def test_direct_dit_trains_exports_and_generates_without_a_refiner(trained, dataset, tmp_path, monkeypatch):
    """a2v `direct`: the DiT trains on the HR latents with 2x patches, starting from the LR a2v
    run lifted (`lift_patch_state`); its loss goes down; export writes no refiner and sets
    lr_size = hr_size; the registry model runs the whole chain (SR passes through) and publishes
    hr-size frames for the whole audio."""
    from conftest import stream_two_seconds

    from avatarstream import registry
    from avatarstream.train.export import export, load_exported, model_spec

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


def test_cfg_distilled_student_takes_the_scales_as_inputs(trained, dataset, tmp_path):
    """CFG distillation with the scales as inputs: the student starts as the teacher whatever the
    scales (zero guidance embedding), and after 200 steps its change from low to high scales
    points the way the teacher's guided velocity changes (cosine > 0.15, measured 0.28-0.32; after
    30 steps it is -0.05 to -0.23 with a change 20x too small: the scales were not used yet) with
    a size within 3x (measured 0.83-0.92 of the teacher's change)."""
    from avatarstream.train.tasks import make_task
    from avatarstream.train.trainer import net_weights

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
    from avatarstream.train.tasks import make_task

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


# -- command line ---------------------------------------------------------------------------------
def test_cli_user_errors(tmp_path, capsys, dataset):
    from avatarstream.cli import main

    assert main(["train", "no-such-recipe"]) == 2
    assert "no recipe 'no-such-recipe'" in capsys.readouterr().err
    bad = tmp_path / "bad.toml"
    bad.write_text('stage = "a2v"\nmodel = "tiny"\n[a2v]\nchunkk = 4\n')
    assert main(["train", str(bad)]) == 2
    assert "unknown key(s) in [a2v]: chunkk" in capsys.readouterr().err
    assert main(["train", "export", str(tmp_path), "--out", str(tmp_path / "w")]) == 2
    assert "no checkpoint" in capsys.readouterr().err
    assert main(["train", "a2v-tiny", "--device", "tpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device" in err


def test_cli_train_runs_a_recipe(tmp_path, capsys, dataset):
    from avatarstream.cli import main

    rd = tmp_path / "run"
    args = ["train", "sr-tiny", "--run-dir", str(rd), "--max-steps", "2", "--no-progress",
            "--set", f'data.prepared="{dataset["prepared"]}"', "--json"]
    assert main(args) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["step"] == 2 and s["stage"] == "sr"
    assert main(args[:-1] + ["--resume", "--max-steps", "3"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 3


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


def test_train_script_runs_the_whole_chain(tmp_path):
    """recipes/train.sh at the tiny size: synth -> VAE -> prepare -> A2V -> SFT -> CFG distill ->
    SR -> export, from a copy of the recipes (its data and runs stay in tmp_path)."""
    import os
    import shutil
    import subprocess
    import sys

    from avatarstream.train.export import load_exported

    shutil.copytree(RECIPES, tmp_path / "recipes")
    av = Path(sys.executable).with_name("avatarstream")
    env = dict(os.environ, AV=str(av), SIZE="tiny", OUT=str(tmp_path / "w"), OMP_NUM_THREADS="1")
    r = subprocess.run(["bash", str(tmp_path / "recipes" / "train.sh")], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((tmp_path / "w" / "config.json").read_text())
    assert set(cfg["trained"]) == {"dit", "refiner", "vae", "audio", "text"} and not cfg["untrained"]
    assert cfg["trained"]["dit"] == "runs/cfg-distill-tiny"
    assert (cfg["pipeline"]["audio_scale"], cfg["pipeline"]["ref_scale"]) == (3.0, 1.5)
    assert cfg["pipeline"]["adaptive_sink"] is False  # bidirectional: causal keeps the reference as sink
    load_exported(tmp_path / "w")


def test_vae_decoder_finetune_keeps_the_latent_space(trained, dataset, tmp_path):
    """`vae.train_encoder = false` from a trained VAE: the encoder (so every prepared latent and
    every DiT trained on them) is bit-identical afterwards, the decoder moved, its loss went
    down, and the frozen half has no optimizer state."""
    over = dict(FAST["vae-tiny"], train__steps=12, train__checkpoint_every=100, vae__train_encoder=False,
                init__vae=str(trained["vae-tiny"]))
    t = run("vae-tiny", dataset, tmp_path / "dec", **over)
    from avatarstream.train.trainer import net_weights

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
    from avatarstream.train.tasks import make_task
    from avatarstream.train.trainer import load_init, net_weights

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


def test_init_from_a_prepared_file_takes_its_vae(dataset):
    """`init.vae = <prepared file>`: the VAE inside it (statistics folded in), so a decoder
    fine-tune starts from exactly the encoder its DiT's latents came from."""
    from safetensors.torch import load_file

    from avatarstream.train.trainer import net_weights

    prep = load_file(str(dataset["prepared"]))
    sd = net_weights(str(dataset["prepared"]), "vae")
    assert set(sd) == {k[4:] for k in prep if k.startswith("vae.")} and sd
    assert all(torch.equal(sd[k], prep["vae." + k]) for k in sd)
    build_nets("tiny")["vae"].load_state_dict(sd)  # strict


def test_vae_mouth_crops_and_mouth_motion_term(dataset):
    """vae `p_mouth_crop = 1`: every crop holds the mouth (its Gaussian peaks inside, on every
    frame); `mouth_temporal` adds its weight times the logged squared mouth-motion error to the
    loss, from the same draw (same generator, same value either way)."""
    from avatarstream.train.tasks import make_task

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


def test_ref2v_windows_are_given_the_scene_frame(dataset):
    """a2v ref2v mode with first_frame: frame 0 is given (the driving scene image the engine
    gives its first chunk), half of those windows from a clip's first latent; without it, none."""
    from avatarstream.train.tasks import make_task

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


def test_export_takes_the_finetuned_decoder(trained, dataset, tmp_path):
    """export(a2v run, decoder fine-tune run started from the prepared file's VAE): the bundle's
    encoder is the prepared VAE's, its decoder the fine-tune's; a fine-tune of another VAE is
    refused (its latent space is not the DiT's)."""
    from safetensors.torch import save_file

    from avatarstream.errors import InputError
    from avatarstream.train.export import export, load_exported

    prepared_vae = PreparedData(dataset["prepared"]).vae_state
    save_file(prepared_vae, str(tmp_path / "prep-vae.safetensors"))
    over = dict(FAST["vae-tiny"], train__steps=4, train__checkpoint_every=100, vae__train_encoder=False)
    t = run("vae-tiny", dataset, tmp_path / "dec", init__vae=str(tmp_path / "prep-vae.safetensors"), **over)
    export([trained["a2v-tiny"], tmp_path / "dec"], tmp_path / "out", dtype="fp32")
    vae = load_exported(tmp_path / "out")["vae"].state_dict()
    tuned = t.ema
    for k, v in vae.items():
        if k.startswith(("encoder.", "quant_conv.")):
            assert torch.equal(v, prepared_vae[k].float()), k
        elif f"vae.{k}" in tuned:
            assert torch.equal(v, tuned[f"vae.{k}"]), k
    assert any(not torch.equal(vae[k], prepared_vae[k].float()) for k in vae if k.startswith("decoder."))
    run("vae-tiny", dataset, tmp_path / "other", init__vae=str(trained["vae-tiny"]), **over)
    with pytest.raises(InputError, match="frozen encoder"):
        export([trained["a2v-tiny"], tmp_path / "other"], tmp_path / "out2")


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


def test_predicted_latents_follow_the_engine_chunks_and_feed_a_decoder_finetune(trained, dataset, tmp_path):
    """`train predict`: a CFG-distilled model's teacher-forced predictions, one per latent frame
    of every clip (frames a chunk is given keep the encoded latents exactly, the rest are the
    DiT's), independent per variant, reproducible from the seed, nearer the encoded latents when
    the sampler starts from them less noised. `vae.predicted`: the decoder fine-tune decodes
    them (the encoder stays frozen), its windows aligned with the clip's frames: the VAE's own
    latents given as "predictions" reconstruct their window better than the same latents one
    latent frame late."""
    from safetensors.torch import save_file

    from avatarstream.train.export import export
    from avatarstream.train.predicted import PredictedLatents, _chunk_starts, predict_latents
    from avatarstream.errors import ConfigError
    from avatarstream.train.tasks import make_task, vae_for
    from avatarstream.train.trainer import load_init, net_weights

    assert _chunk_starts(20, 8, 2) == [0, 6, 12] and _chunk_starts(21, 8, 2) == [0, 6, 12, 13]
    assert _chunk_starts(5, 8, 2) == [0]
    w = tmp_path / "w"
    export([trained["cfg-distill-tiny"], trained["a2v-tiny"]], w, dtype="fp32", steps=2)
    out = {}
    for name, sig, seed in (("a", 1.0, 0), ("b", 1.0, 0), ("c", 1.0, 1), ("near", 0.1, 0)):
        predict_latents(dataset["prepared"], w, tmp_path / f"{name}.safetensors", variants=2,
                        sigma_start=sig, seed=seed)
        out[name] = PredictedLatents(tmp_path / f"{name}.safetensors")
    prep = PreparedData(dataset["prepared"])
    enc = prep.lr
    pa = out["a"].pred.float()
    assert pa.shape == (2, *enc.shape)
    assert torch.equal(pa, out["b"].pred.float()) and not torch.equal(pa, out["c"].pred.float())
    starts = [c["lat_offset"] for c in prep.clips]
    for v in range(2):
        assert torch.equal(pa[v, starts], enc[starts].half().float())  # the scene frame, given
    gen = torch.ones(enc.shape[0], dtype=torch.bool)
    gen[starts] = False
    err = lambda p: float((p[:, gen] - enc[gen]).square().mean())  # noqa: E731
    assert err(pa) > 1e-4 and not torch.equal(pa[0, gen], pa[1, gen])
    assert err(out["near"].pred.float()) < 0.5 * err(pa)

    # alignment (our indexing, on marked data): a frame's pixels hold its index and their latent
    # pixel's row and column; a latent frame holds the index of the last frame it covers
    clips = prep.clips
    lat = torch.zeros(enc.shape[0], enc.shape[1], 8, 8)  # HR latents of the 64 px clips
    for c in clips:
        n = c["latents"]
        last = torch.tensor([0] + [4 * j for j in range(1, n)], dtype=torch.float32)
        lat[c["lat_offset"]:c["lat_offset"] + n, 0] = last[:, None, None]
    lat[:, 1] = torch.arange(8, dtype=torch.float32)[:, None]
    lat[:, 2] = torch.arange(8, dtype=torch.float32)[None, :]
    meta = dict(out["a"].meta, direct=True)
    save_file({"pred": lat[None].half().contiguous()}, str(tmp_path / "marked.safetensors"),
              metadata={"avatarstream": json.dumps(meta)})
    for warm in (0, 2):
        r = recipe("vae-tiny", dataset, vae__crop=32, train__batch=3, vae__train_encoder=False, vae__p_lr=0.0,
                   vae__predicted=str(tmp_path / "marked.safetensors"), vae__p_predicted=1.0,
                   vae__warm_latents=warm, vae__p_stream_start=0.5, vae__latent_frames=2)
        task = make_task(r, torch.device("cpu"))
        for clip in task.pred_clips:
            f, size = clip.frames.shape[:2]
            m = torch.zeros(f, size, size, 3, dtype=torch.uint8)
            m[..., 0] = torch.arange(f, dtype=torch.uint8)[:, None, None]
            m[..., 1] = (torch.arange(size) // 8).to(torch.uint8)[:, None]
            m[..., 2] = (torch.arange(size) // 8).to(torch.uint8)[None, :]
            clip.frames = m.numpy()
        seen = set()
        for seed in range(8):
            x, _, _, w_lat, z = task.sample_predicted(torch.Generator().manual_seed(seed))
            px = ((x + 1) * 127.5).round()  # [B, 3, F, c, c]
            seen.add(w_lat)
            assert z.shape[2] == w_lat + 2 and px.shape[2] == (8 if w_lat else 5)
            for j in range(2):
                pos = (4 * j + 3) if w_lat else 4 * j  # the last frame of the window's latent j
                assert torch.equal(px[:, 0, pos], z[:, 0, w_lat + j].repeat_interleave(8, -1)
                                   .repeat_interleave(8, -2)), (seed, j)
            up = z[:, 1:3, :1].repeat_interleave(8, -1).repeat_interleave(8, -2)
            assert torch.equal(px[:, 1:, :1], up), seed
        assert seen == ({0, 2} if warm else {0})
        assert task.loss(torch.Generator().manual_seed(0))[1]["kl"] == 0.0
    r = recipe("vae-tiny", dataset, vae__crop=32, train__batch=2, vae__predicted=str(tmp_path / "marked.safetensors"))
    with pytest.raises(ConfigError, match="train_encoder"):
        make_task(r, torch.device("cpu"))
