"""Hostile weights folders and adapters, made in the test: a tiny FlashHead folder in the official
layout (`models tiny`'s writer) with one thing broken each, given to the real commands
(`models check DIR`, `generate --model flashhead-pro:DIR`, `--lora`). Each must end in one clear
line naming the file, a non-zero exit, no traceback, and (in a subprocess under an address-space
limit) bounded memory and time. `models check` and the loader must agree: a folder one refuses,
the other refuses too, except for what only reading the tensors can show (NaN/Inf values: the
loader's per-tensor check)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from avatarstream.cli import main
from avatarstream.errors import InputError
from avatarstream.weights.flashhead_folder import write_official_folder

DIT = Path("Model_Pro") / "diffusion_pytorch_model.safetensors"
CONFIG = Path("Model_Pro") / "config.json"
VAE = Path("VAE_Wan") / "Wan2.1_VAE.pth"
REFERENCE = Path(__file__).resolve().parents[2] / "examples" / "reference.png"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_official_folder(tmp_path_factory.mktemp("tiny") / "fh", "pro")


def _config(d: Path, **kw: object) -> None:
    raw = json.loads((d / CONFIG).read_text())
    (d / CONFIG).write_text(json.dumps({**raw, **kw}))  # json writes NaN as NaN: Python's reader takes it


def _retype(d: Path, dtype: torch.dtype) -> None:
    state = load_file(str(d / DIT))
    key = next(k for k in state if k.endswith("self_attn.q.weight"))
    state[key] = state[key].to(dtype)
    save_file(state, str(d / DIT))


def _poison(d: Path, value: float) -> None:
    state = load_file(str(d / DIT))
    key = next(k for k in state if k.endswith("ffn.0.weight"))
    state[key][0, 0] = value
    save_file(state, str(d / DIT))


def _big_header(d: Path) -> None:
    """A header that claims 99 MB (under safetensors' own 100 MB cap, over ours), in a sparse file."""
    n = 99 << 20
    with (d / DIT).open("wb") as f:
        f.write(n.to_bytes(8, "little") + b"{")
        f.seek(8 + n + 64)
        f.write(b"\0")


def _link_out(d: Path) -> None:
    outside = d.parent / f"{d.name}-elsewhere.safetensors"
    shutil.move(str(d / DIT), outside)
    (d / DIT).symlink_to(outside)


BREAK: dict[str, tuple[Callable[[Path], None], str]] = {  # name -> (how, what the line must name)
    "partial download": (lambda d: os.truncate(d / DIT, (d / DIT).stat().st_size // 2), "partial download"),
    "truncated header": (lambda d: (d / DIT).write_bytes(b"\x10\x00"), "partial download"),
    "header not JSON": (lambda d: (d / DIT).write_bytes((8).to_bytes(8, "little") + b"\xff" * 8), "header is not JSON"),
    "header over the cap": (_big_header, "header"),
    "int64 weights": (lambda d: _retype(d, torch.int64), "stored as I64"),
    "bool weights": (lambda d: _retype(d, torch.bool), "stored as BOOL"),
    "pickle in the .pth": (lambda d: torch.save({"w": argparse.Namespace(a=1)}, d / VAE), "pickle payload"),
    "config not JSON": (lambda d: (d / CONFIG).write_bytes(b"\x00garbage"), "not JSON"),
    "config a list": (lambda d: (d / CONFIG).write_text("[1, 2]"), "not a config object"),
    "config nested 100k deep": (lambda d: (d / CONFIG).write_text("[" * 100_000), "nested too deeply"),
    "dim 0": (lambda d: _config(d, dim=0), "dim is 0"),
    "num_layers 1e6": (lambda d: _config(d, num_layers=1e6), "num_layers is 1000000.0"),
    "num_heads a string": (lambda d: _config(d, num_heads="12"), 'num_heads is "12"'),
    "eps NaN": (lambda d: _config(d, eps=float("nan")), "not a finite number"),
    "sidecar size 8192": (lambda d: (d / "avatarstream.json").write_text(json.dumps({"size": 8192})), "size is 8192"),
    "sidecar not JSON": (lambda d: (d / "avatarstream.json").write_text("{"), "avatarstream.json: not JSON"),
    "a link out of the folder": (_link_out, "outside"),
}


def _broken(tiny: Path, tmp_path: Path, name: str) -> tuple[Path, str]:
    d = shutil.copytree(tiny, tmp_path / "fh")
    how, words = BREAK[name]
    how(d)
    return d, words


def _one_line(rc: int, err: str, *words: str) -> str:
    lines = err.strip().splitlines()
    assert rc != 0 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("avatarstream: error: "), err
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("name", list(BREAK))
def test_check_and_loader_both_refuse(name: str, tiny: Path, tmp_path: Path, speech: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    d, words = _broken(tiny, tmp_path, name)
    rc = main(["models", "check", str(d), "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and not report["ok"] and any(words in p for p in report["problems"]), report["problems"]
    rc = main(["generate", "--model", f"flashhead-pro:{d}", "--reference", str(REFERENCE), "--audio", str(speech),
               "--out", str(tmp_path / "o.mp4"), "--no-progress", "--no-watermark"])
    _one_line(rc, capsys.readouterr().err, words)
    assert not (tmp_path / "o.mp4").exists()


def test_links_are_followed_when_asked(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    d, _ = _broken(tiny, tmp_path, "a link out of the folder")
    monkeypatch.setenv("AVATARSTREAM_FOLLOW_LINKS", "1")
    assert main(["models", "check", str(d), "--json"]) == 0
    capsys.readouterr()


def test_a_hugging_face_cache_snapshot_may_link_into_its_blobs(tiny: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`models--ORG--NAME/snapshots/REV/` links each file to `../../blobs/HASH`: that is the download."""
    repo = tmp_path / "models--org--tiny"
    snap = shutil.copytree(tiny, repo / "snapshots" / "abc123")
    (repo / "blobs").mkdir()
    shutil.move(str(snap / DIT), repo / "blobs" / "0f0f")
    (snap / DIT).symlink_to(Path("..", "..", "..", "blobs", "0f0f"))
    assert main(["models", "check", str(snap), "--json"]) == 0
    capsys.readouterr()


@pytest.mark.parametrize("where,value", [("dit", math.nan), ("dit", math.inf), ("vae", math.nan)])
def test_nan_or_inf_weights_are_refused_at_load(where: str, value: float, tiny: Path, tmp_path: Path,
                                                speech: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Headers cannot show a NaN (the check reads none); the loader checks each tensor as it is read."""
    d = shutil.copytree(tiny, tmp_path / "fh")
    if where == "dit":
        _poison(d, value)
    else:
        state = torch.load(d / VAE, weights_only=True)
        next(iter(state.values())).view(-1)[0] = value
        torch.save(state, d / VAE)
    rc = main(["generate", "--model", f"flashhead-pro:{d}", "--reference", str(REFERENCE), "--audio", str(speech),
               "--out", str(tmp_path / "o.mp4"), "--no-progress", "--no-watermark"])
    _one_line(rc, capsys.readouterr().err, "NaN or infinite", str(DIT if where == "dit" else VAE))
    assert not (tmp_path / "o.mp4").exists()


def test_index_naming_a_file_outside_is_refused(tmp_path: Path) -> None:
    from avatarstream.weights.official import read_state

    (tmp_path / "secret.safetensors").write_bytes(b"")
    d = tmp_path / "m"
    d.mkdir()
    index = d / "model.safetensors.index.json"
    for shard in ("../secret.safetensors", "/etc/passwd", "sub/x.safetensors"):
        index.write_text(json.dumps({"weight_map": {"a": shard}}))
        with pytest.raises(InputError, match="not a file beside it: refused"):
            read_state(index)
    index.write_text(json.dumps({"weight_map": ["a"]}))
    with pytest.raises(InputError, match="not a shard index"):
        read_state(index)
    (d / "s.safetensors").write_bytes((2).to_bytes(8, "little") + b"{}")
    # the 14 B DiT's index says 32.6 GB: a large number where one belongs is no problem
    index.write_text(json.dumps({"metadata": {"total_size": 32_600_000_000}, "weight_map": {}}))
    with pytest.raises(InputError, match="not a shard index"):  # an empty map: no tensor
        read_state(index)
    index.write_text(json.dumps({"metadata": {"total_size": 32_600_000_000}, "weight_map": {"a": "s.safetensors"}}))
    with pytest.raises(InputError, match="listed in the index are in no shard"):
        read_state(index)


LIMIT = 3 << 30  # bytes of address space: the tiny folder needs a fraction; 26 GB attempts die


def _limited(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, ({0}, {0})); "
            "from avatarstream.cli import main; sys.exit(main(sys.argv[1:]))").format(LIMIT)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    return r, time.perf_counter() - t0


@pytest.mark.parametrize("name", ["num_layers 1e6", "sidecar size 8192"])
def test_bounded_memory_and_time_in_a_subprocess(name: str, tiny: Path, tmp_path: Path, speech: Path) -> None:
    """Under a 3 GB address-space limit (what once tried 26.5 GB, or built a million layers for
    minutes at 1.3 GB): `models check` and `generate` each refuse in one line, in seconds."""
    d, words = _broken(tiny, tmp_path, name)
    r, seconds = _limited("models", "check", str(d))
    assert r.returncode == 1 and "Traceback" not in r.stderr and words in r.stdout and seconds < 90, r.stderr
    r, seconds = _limited("generate", "--model", f"flashhead-pro:{d}", "--reference", str(REFERENCE), "--audio",
                          str(speech), "--out", str(tmp_path / "o.mp4"), "--no-progress")
    _one_line(r.returncode, r.stderr, words)
    assert seconds < 90


# -- a LiveAvatar download: its sharded DiT's index, its shards, its LoRA ----------------------------
BASE = Path("Wan2.2-S2V-14B")
INDEX = BASE / "diffusion_pytorch_model.safetensors.index.json"
LORA = Path("LiveAvatar") / "liveavatar.safetensors"


def _index(d: Path, edit: Callable[[dict], object]) -> None:
    raw = json.loads((d / INDEX).read_text())
    raw = edit(raw) or raw
    (d / INDEX).write_text(json.dumps(raw))


def _shard_out(d: Path) -> None:
    shard = d / BASE / json.loads((d / INDEX).read_text())["weight_map"].popitem()[1]
    outside = d.parent / "elsewhere.safetensors"
    shutil.move(str(shard), outside)
    shard.symlink_to(outside)


def _lora_nan(d: Path) -> None:
    state = load_file(str(d / LORA))
    k = next(iter(state))
    state[k] = state[k].float()
    state[k][0, 0] = math.nan
    save_file({key: v.to(torch.bfloat16) for key, v in state.items()}, str(d / LORA))


LA_BREAK: dict[str, tuple[Callable[[Path], None], str, bool]] = {  # -> (how, words, seen by the check)
    "index a list": (lambda d: (d / INDEX).write_text("[1]"), "not a shard index object", True),
    "index without weight_map": (lambda d: _index(d, lambda r: {"metadata": r["metadata"]}), "not a shard index", True),
    "index naming ../": (lambda d: _index(d, lambda r: r["weight_map"].update(
        {next(iter(r["weight_map"])): "../x.safetensors"})), "not a file beside it", True),
    "a shard linked out": (_shard_out, "outside", True),
    "config dim 0": (lambda d: (d / BASE / "config.json").write_text(json.dumps(
        {**json.loads((d / BASE / "config.json").read_text()), "dim": 0})), "dim is 0", True),
    "NaN in the LoRA": (_lora_nan, "not a finite floating-point tensor", False),
}


@pytest.fixture(scope="module")
def tiny_la(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from avatarstream.weights.liveavatar_folder import write_official_folder as write_liveavatar

    return write_liveavatar(tmp_path_factory.mktemp("tiny") / "la", prompt=None)


@pytest.mark.parametrize("name", list(LA_BREAK))
def test_liveavatar_check_and_loader_refuse(name: str, tiny_la: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from avatarstream.weights.liveavatar_folder import load_liveavatar_dit, parse_name

    d = shutil.copytree(tiny_la, tmp_path / "la", symlinks=True)
    how, words, checked = LA_BREAK[name]
    how(d)
    rc = main(["models", "check", str(d), "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (rc == 1 and any(words in p for p in report["problems"])) if checked else rc == 0, report["problems"]
    with pytest.raises(InputError) as e:
        load_liveavatar_dit(parse_name(f"liveavatar:{d}"), dtype=torch.float32)
    assert words in str(e.value) and "\n" not in str(e.value)
