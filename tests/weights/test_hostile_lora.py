"""Hostile adapters for `--lora FILE`, written in the test: damaged settings in the header, tensors
of a non-float type or holding NaN/Inf, a partial file, an adapter of another base. Each is one
line from the real command (`generate --model tiny-random --lora FILE`), naming the file and what
is wrong, before any frame is made; an adapter of another model says which model it was for."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from avatarstream.cli import main
from avatarstream.registry import load_model
from avatarstream.weights.lora import LoRASettings, target_modules
from avatarstream.weights.lora_file import META_KEY, lora_key, save_lora_file

REFERENCE = Path(__file__).resolve().parents[2] / "examples" / "reference.png"
SETTINGS = LoRASettings(rank=2, alpha=2.0, targets=("q", "k", "v", "o"))


@pytest.fixture(scope="module")
def shapes() -> dict[str, tuple[int, int]]:
    net = load_model("tiny-random", bf16=False).dit.model
    return target_modules({k: tuple(p.shape) for k, p in net.named_parameters()}, SETTINGS)


def tensors(shapes: dict[str, tuple[int, int]], widen: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {}
    for module, (o, i) in shapes.items():
        out[lora_key(module, "A")] = torch.randn(SETTINGS.rank, i * widen, generator=g)
        out[lora_key(module, "B")] = torch.randn(o * widen, SETTINGS.rank, generator=g)
    return out


def raw_file(path: Path, t: dict[str, torch.Tensor], **meta: object) -> Path:
    """An adapter written as-is (save_lora_file would cast to fp32): any dtype, any header entry."""
    settings = {"rank": 2, "alpha": 2.0, "targets": ["q", "k", "v", "o"], "base": "tiny-random", **meta}
    save_file(t, str(path), metadata={META_KEY: json.dumps(settings), "format": "pt"})
    return path


def generate(lora: Path, speech: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> str:
    rc = main(["generate", "--model", "tiny-random", "--lora", str(lora), "--reference", str(REFERENCE),
               "--audio", str(speech), "--out", str(tmp_path / "o.mp4"), "--no-progress", "--no-watermark"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc != 0 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith(f"avatarstream: error: --lora {lora}") and not (tmp_path / "o.mp4").exists()
    return lines[0]


def _retyped(t: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    k = next(iter(t))
    return {**t, k: t[k].to(dtype)}


def _poisoned(t: dict[str, torch.Tensor], value: float) -> dict[str, torch.Tensor]:
    k = next(iter(t))
    bad = t[k].clone()
    bad[0, 0] = value
    return {**t, k: bad}


CASES = {  # name -> (tensors(shapes) -> file's tensors, header entries, what the line says)
    "rank 0": (lambda t: t, {"rank": 0}, "rank 0 is not an integer"),
    "rank a float": (lambda t: t, {"rank": 2.5}, "rank 2.5 is not an integer"),
    "alpha 1e308": (lambda t: t, {"alpha": 1e308}, "alpha 1e+308 is not a finite number"),
    "alpha NaN": (lambda t: t, {"alpha": math.nan}, "alpha nan is not a finite number"),
    "alpha a string": (lambda t: t, {"alpha": "2"}, "alpha '2' is not a finite number"),
    "targets a string": (lambda t: t, {"targets": "qkvo"}, 'targets "qkvo" is not a list'),
    "int64 tensor": (lambda t: _retyped(t, torch.int64), {}, "stored as I64"),
    "bool tensor": (lambda t: _retyped(t, torch.bool), {}, "stored as BOOL"),
    "NaN tensor": (lambda t: _poisoned(t, math.nan), {}, "NaN or infinite"),
    "Inf tensor": (lambda t: _poisoned(t, -math.inf), {}, "NaN or infinite"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_damaged_adapter_is_one_line(name: str, shapes: dict, speech: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    how, meta, words = CASES[name]
    line = generate(raw_file(tmp_path / "x.safetensors", how(tensors(shapes)), **meta), speech, tmp_path, capsys)
    assert words in line, line


def test_a_partial_adapter(shapes: dict, speech: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_lora_file(tmp_path / "x.safetensors", tensors(shapes), SETTINGS, {"base": "tiny-random"})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])
    assert "partial download" in generate(path, speech, tmp_path, capsys)


def test_an_adapter_of_another_base_says_so_in_one_short_line(shapes: dict, speech: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Every pair of an adapter trained on a wider model mismatches: the line names the base from
    its header and the model running, and summarises (it was 8 KB of shapes)."""
    path = save_lora_file(tmp_path / "x.safetensors", tensors(shapes, widen=2), SETTINGS, {"base": "small"})
    line = generate(path, speech, tmp_path, capsys)
    assert "this adapter was trained for small, you are running tiny-random" in line, line
    assert f"{2 * len(shapes)} LoRA tensor(s) of another shape" in line and "more" in line and len(line) < 700, line


def test_an_adapter_that_fits_under_another_name_is_merged_with_a_warning(
        shapes: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = save_lora_file(tmp_path / "x.safetensors", tensors(shapes), SETTINGS, {"base": "flashhead-pro:/moved"})
    models = load_model("tiny-random", bf16=False, lora=str(path))
    assert models.name.startswith("tiny-random+lora-")
    assert "trained for flashhead-pro:/moved, merged into tiny-random" in caplog.text


def test_a_damaged_adapter_is_refused_before_the_model_loads(shapes: dict, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A real model takes minutes to load: the adapter is read and checked first."""
    import dataclasses

    import avatarstream.registry as registry
    from avatarstream.errors import InputError

    spec = registry.model_spec_for("tiny-random")

    def load(device: str, bf16: bool | None) -> None:
        pytest.fail("the model was loaded before the adapter was checked")

    monkeypatch.setattr(registry, "model_spec_for", lambda name: dataclasses.replace(spec, load=load))
    path = raw_file(tmp_path / "x.safetensors", tensors(shapes), rank=0)
    with pytest.raises(InputError, match="rank 0 is not an integer"):
        registry.load_model("tiny-random", lora=str(path))
