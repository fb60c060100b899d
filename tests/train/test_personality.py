"""Personality fine-tuning (`avatarstream train personality`, train/personality.py) on tiny
configs: for our model (tiny-random), FlashHead (a tiny random folder in the official layout) and
LiveAvatar (the same), the flow-matching loss on fixed draws goes down, the adapter file loads
back (`load_model(..., lora=FILE)` / `--lora FILE`, and `liveavatar:DIR,lora=FILE`) and the
loaded model's DiT is the trained one: its weights equal the parametrized W + scale·B@A (and so
its outputs: checked on FlashHead's forward) within 1e-5 (fp32 merge vs fp32 parametrization:
two roundings of the same sum). A run stopped and resumed ends with the uninterrupted run's
adapter within 1e-6 (same device and threads: bit for bit in practice).

Footage is our renderer's, in curate's contract: string identities and scenes, pairs.json.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from avatarstream.errors import AvatarStreamError, ConfigError, InputError
from avatarstream.train.cli import _Parser
from avatarstream.train.personality import PersonalityRun, parser
from avatarstream.train.personality_data import Footage
from avatarstream.weights.lora_file import read_lora_file

MERGE_TOL = 1e-5
RESUME_TOL = 1e-6


@pytest.fixture(scope="module")
def footage(tmp_path_factory) -> Path:
    """2 people x 2 scenes x 1.6 s at 64 px, ids as strings, pairs.json of every cross-scene pair."""
    from avatarstream.data.generate import DatasetConfig, generate

    root = tmp_path_factory.mktemp("footage") / "foot"
    generate(DatasetConfig(identities=2, clips_per_identity=2, seconds=1.6, seed=3, size=64), root)
    idx = json.loads((root / "index.json").read_text())
    for c in idx["clips"]:
        c["identity"], c["scene"] = f"person-{c['identity']}", f"scene-{c['scene']}"
    (root / "index.json").write_text(json.dumps(idx))
    clips = idx["clips"]
    pairs = [{"reference": a["key"], "target": b["key"], "identity": a["identity"]}
             for a in clips for b in clips if a["identity"] == b["identity"] and a["scene"] != b["scene"]]
    (root / "pairs.json").write_text(json.dumps({"pairs": pairs}))
    return root


def _run(base: str, footage: Path, run_dir: Path, *args: str) -> tuple[PersonalityRun, dict]:
    ns = parser(_Parser).parse_args(["--base", base, "--footage", str(footage), "--run-dir", str(run_dir),
                                     "--threads", "1", *args])
    r = PersonalityRun(ns)
    return r, r.run()


def _adapted(r: PersonalityRun) -> dict[str, torch.Tensor]:
    """The trained net's effective weights W + scale·B@A of every adapted module."""
    net = r.family.net
    with torch.no_grad():
        return {m: net.get_submodule(m).weight.detach().clone() for m in r.deltas}


def _check_merged(r: PersonalityRun, merged: torch.nn.Module) -> None:
    """The loaded DiT holds exactly the trained adapted weights, and the adapter moved them."""
    moved = 0.0
    for m, w in _adapted(r).items():
        got = merged.get_submodule(m).weight.detach().float()
        assert (got - w).abs().max().item() <= MERGE_TOL * max(1.0, w.abs().max().item()), m
        base = r.family.net.get_submodule(m).parametrizations.weight.original
        moved = max(moved, (w - base).abs().max().item())
    assert moved > 1e-4  # the adapter changes the model


# -- footage ---------------------------------------------------------------------------------------
def test_footage_pairs(footage, tmp_path):
    f = Footage(footage)
    assert len(f.pairs) == 4 and all(f.scene(r) != f.scene(t) and f.identity(r) == f.identity(t) for r, t in f.pairs)
    derived = tmp_path / "derived"
    shutil.copytree(footage, derived)
    (derived / "pairs.json").unlink()
    assert sorted(Footage(derived).pairs) == sorted(f.pairs)  # without pairs.json: the same cross-scene pairs
    key = f.keys[0]
    (derived / "pairs.json").write_text(json.dumps({"pairs": [{"reference": key, "target": key}]}))
    with pytest.raises(InputError, match="not one person in two scenes"):
        Footage(derived)
    (derived / "pairs.json").unlink()
    idx = json.loads((derived / "index.json").read_text())
    for c in idx["clips"]:
        c["scene"] = "one-scene"
    (derived / "index.json").write_text(json.dumps(idx))
    with pytest.raises(InputError, match="no cross-scene pair"):
        Footage(derived)


def _with_entry(footage: Path, to: Path, **change: str) -> Path:
    """A copy of the footage whose first index entry has `change` (key/shard) applied."""
    shutil.copytree(footage, to, symlinks=True)
    idx = json.loads((to / "index.json").read_text())
    idx["clips"][0].update(change)
    (to / "index.json").write_text(json.dumps(idx))
    (to / "pairs.json").unlink()
    return to


def test_shard_keys_that_leave_the_footage_folder_are_refused(footage, tmp_path, capsys):
    """A key or shard with `..`, an absolute one, or a clip file / shard folder that is a symlink
    out of the folder: one clear InputError before anything is read (before: followed)."""
    from avatarstream.cli import main

    outside = tmp_path / "elsewhere"
    shutil.copytree(footage / "shard-00000", outside)
    key = json.loads((footage / "index.json").read_text())["clips"][0]["key"]
    cases = {"dotdot": {"key": f"../../elsewhere/{key}"}, "shard": {"shard": "../elsewhere"},
             "absolute": {"shard": str(outside)}}
    for name, change in cases.items():
        with pytest.raises(InputError, match="outside the footage folder"):
            Footage(_with_entry(footage, tmp_path / name, **change))
    linked = _with_entry(footage, tmp_path / "linked")
    (linked / "shard-00000" / f"{key}.mkv").unlink()
    (linked / "shard-00000" / f"{key}.mkv").symlink_to(outside / f"{key}.mkv")
    with pytest.raises(InputError, match=r"its \.mkv file leads outside its shard folder"):
        Footage(linked)
    folder = _with_entry(footage, tmp_path / "folder", shard="linked-shard")
    (folder / "linked-shard").symlink_to(outside)
    with pytest.raises(InputError, match="its shard folder leads outside"):
        Footage(folder)
    assert len(Footage(_with_entry(footage, tmp_path / "fine")).pairs) == 4  # a plain copy reads
    assert main(["train", "personality", "--base", "tiny-random", "--footage", str(tmp_path / "dotdot"),
                 "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # a progress line, then the error: one line
    assert err[-1].startswith("avatarstream: error: --footage") and "outside the footage folder" in err[-1], err
    assert len(err) == 2 and "Traceback" not in "\n".join(err), err


def test_the_command_shows_a_progress_bar_and_keeps_stdout_for_the_summary(footage, tmp_path):
    cmd = [sys.executable, "-m", "avatarstream.cli", "train", "personality", "--base", "tiny-random",
           "--footage", str(footage), "--run-dir", str(tmp_path / "run"), "--steps", "3", "--batch", "1",
           "--rank", "2", "--eval-draws", "0", "--threads", "1", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    err = p.stderr
    assert err.startswith("train personality: loading tiny-random and the footage of")
    assert "train personality: ours, 4 cross-scene pairs" in err
    assert "train personality: 100%" in err and "3/3 [" in err and "loss=" in err
    assert re.search(r"3/3 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+(step/s|s/step), loss=[\d.]+\]", err), err  # rate, ETA
    assert json.loads(p.stdout.strip().splitlines()[-1])["step"] == 3
    quiet = subprocess.run([*cmd[:-1], "--run-dir", str(tmp_path / "run2"), "--no-progress", "--json"],
                           capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "train personality" not in quiet.stderr


# -- our model ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ours(footage, tmp_path_factory):
    return _run("tiny-random", footage, tmp_path_factory.mktemp("ours") / "run", "--steps", "6", "--batch", "2",
                "--lr", "1e-2", "--rank", "4", "--alpha", "8")


def test_ours_loss_goes_down_and_file(ours):
    r, s = ours
    assert s["family"] == "ours" and s["step"] == 6 and s["adapted_linears"] == len(r.deltas) > 0
    assert s["eval_loss_after"] < s["eval_loss_before"]
    tensors, settings, meta = read_lora_file(s["out"])
    assert (settings.rank, settings.alpha, settings.scale) == (4, 8.0, 2.0)
    assert all(k.startswith("base_model.model.") and (".lora_A." in k or ".lora_B." in k) for k in tensors)
    assert len(tensors) == 2 * len(r.deltas) and meta["base"] == "tiny-random"


def test_ours_adapter_loads_back(ours):
    from avatarstream.registry import load_model

    r, s = ours
    models = load_model("tiny-random", bf16=False, lora=s["out"])
    _check_merged(r, models.dit.model)
    assert models.name.startswith("tiny-random+lora-")


def test_ours_resume_equals_uninterrupted(ours, footage, tmp_path):
    r_full, _ = ours
    args = ("--steps", "6", "--batch", "2", "--lr", "1e-2", "--rank", "4", "--alpha", "8", "--checkpoint-every", "2",
            "--eval-draws", "0")
    run_dir = tmp_path / "run"
    _, first = _run("tiny-random", footage, run_dir, *args, "--max-steps", "3")
    assert first["step"] == 3 and "out" not in first
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        _run("tiny-random", footage, run_dir, *args)
    with pytest.raises(ConfigError, match="other settings"):
        _run("tiny-random", footage, run_dir, *args[:-4], "--rank", "8", "--eval-draws", "0", "--resume")
    r, s = _run("tiny-random", footage, run_dir, *args, "--resume")
    assert s["resumed"] and s["start_step"] == 3 and s["step"] == 6
    full = read_lora_file(Path(r_full.run_dir) / "personality.safetensors")[0]
    resumed = read_lora_file(s["out"])[0]
    assert full.keys() == resumed.keys()
    assert max((full[k] - resumed[k]).abs().max().item() for k in full) <= RESUME_TOL


def test_generate_with_lora_cli(ours, tmp_path):
    """`generate --lora FILE` runs with the adapter; a file that is not an adapter is one clear error."""
    _, s = ours
    wav = tmp_path / "a.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((np.sin(np.arange(16000) / 8.0) * 8000).astype(np.int16).tobytes())
    ref = Path(__file__).parents[2] / "examples" / "reference.png"
    cmd = [sys.executable, "-m", "avatarstream.cli", "generate", "--model", "tiny-random", "--reference", str(ref),
           "--audio", str(wav), "--threads", "1"]
    ok = subprocess.run(cmd + ["--out", str(tmp_path / "o.mp4"), "--lora", s["out"], "--json"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (tmp_path / "o.mp4").stat().st_size > 0
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a tensor file")
    err = subprocess.run(cmd + ["--out", str(tmp_path / "p.mp4"), "--lora", str(bad)], capture_output=True,
                         text=True, timeout=300)
    assert err.returncode != 0 and "--lora" in err.stderr and "Traceback" not in err.stderr


# -- FlashHead ---------------------------------------------------------------------------------------
def test_flashhead_personality(footage, tmp_path):
    from avatarstream.registry import load_model
    from avatarstream.weights.flashhead_folder import write_official_folder

    root = write_official_folder(tmp_path / "SoulX-FlashHead-1_3B")
    base = f"flashhead-pro:{root}"
    r, s = _run(base, footage, tmp_path / "run", "--steps", "4", "--batch", "1", "--lr", "1e-2", "--rank", "4",
                "--eval-draws", "2")
    assert s["family"] == "flashhead" and s["eval_loss_after"] < s["eval_loss_before"]
    merged = load_model(base, bf16=False, lora=s["out"]).dit.model
    _check_merged(r, merged)
    # the outputs: the loaded DiT computes what the trained (parametrized) one does
    net, c = r.family.net, r.family.c
    g = torch.Generator().manual_seed(0)
    h = w = c.out_hw[0] // 8
    x = torch.randn(1, net.config.out_channels, c.chunk, h, w, generator=g)
    y = torch.randn(1, net.config.in_channels - net.config.out_channels, c.chunk, h, w, generator=g)
    audio = r.family._audio(np.random.default_rng(0).standard_normal(16000).astype(np.float32), r.family.frames)
    with torch.no_grad():
        want, got = net(x, torch.tensor([0.5]), audio, y), merged(x, torch.tensor([0.5]), audio, y)
        base = load_model(base, bf16=False).dit.model(x, torch.tensor([0.5]), audio, y)
    assert (got - want).abs().max().item() <= MERGE_TOL * max(1.0, want.abs().max().item())
    assert (want - base).abs().max().item() > 1e-4


# -- LiveAvatar --------------------------------------------------------------------------------------
def test_liveavatar_personality(footage, tmp_path):
    from avatarstream.registry import load_model
    from avatarstream.weights.liveavatar_folder import write_official_folder

    root = write_official_folder(tmp_path / "la")
    r, s = _run(f"liveavatar:{root}", footage, tmp_path / "run", "--steps", "4", "--batch", "1", "--lr", "1e-3",
                "--eval-draws", "2")
    assert s["family"] == "liveavatar" and s["eval_loss_after"] < s["eval_loss_before"]
    assert (s["rank"], s["alpha"]) == (128, 64.0)  # LiveAvatar's own adapter, continued
    assert s["load"] == f"--model liveavatar:{root},lora={s['out']}"
    merged = load_model(f"liveavatar:{root},lora={s['out']}", bf16=False).dit.model
    _check_merged(r, merged)
    with pytest.raises(AvatarStreamError, match="replaces"):  # not stacked on the release's adapter
        load_model(f"liveavatar:{root}", bf16=False, lora=s["out"])
    with pytest.raises(ConfigError, match="cannot change"):
        _run(f"liveavatar:{root}", footage, tmp_path / "run2", "--rank", "8")


def test_lora_file_needs_its_settings(tmp_path):
    """An adapter without the settings header (PEFT's own file, say) is refused, not merged with guesses."""
    from safetensors.torch import save_file

    p = tmp_path / "peft.safetensors"
    save_file({"base_model.model.blocks.0.self_attn.q.lora_A.weight": torch.zeros(4, 8)}, str(p))
    with pytest.raises(InputError, match="no LoRA settings"):
        read_lora_file(p)
    with pytest.raises(InputError, match="no such file"):
        read_lora_file(tmp_path / "missing.safetensors")
