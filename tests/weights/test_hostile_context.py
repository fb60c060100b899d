"""Hostile LiveAvatar prompt contexts (`context.safetensors`, weights/text_context.py), made in the
test in a tiny official-layout download: a partial file, a header claiming 99 MB, another dtype,
too many tokens, another width, NaN/Inf values, a link out of the folder. Each ends in one clear
line naming the file through `generate --model liveavatar:DIR` (before the DiT is read), and
`models check DIR` reports the same problem: the two read the file through one path."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from avatarstream.cli import main
from avatarstream.models.liveavatar import LiveAvatarConfig
from avatarstream.weights.text_context import FORMAT

REFERENCE = Path(__file__).resolve().parents[2] / "examples" / "reference.png"
CTX = "context.safetensors"
WIDTH = LiveAvatarConfig.tiny().text_dim
TOKENS = LiveAvatarConfig.tiny().text_len


@pytest.fixture(scope="module")
def tiny_la(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from avatarstream.weights.liveavatar_folder import write_official_folder

    return write_official_folder(tmp_path_factory.mktemp("tiny") / "la", prompt="a person talking")


def _context(d: Path, context: torch.Tensor) -> None:
    """What a hostile writer stores: any tensor, with the metadata of a real context file."""
    save_file({"context": context}, str(d / CTX), metadata={"format": FORMAT, "prompt": "a person talking"})


def _truncate(d: Path) -> None:
    data = (d / CTX).read_bytes()
    (d / CTX).write_bytes(data[: len(data) - 64])


def _big_header(d: Path) -> None:
    """A header claiming 99 MB (under safetensors' own 100 MB cap, over ours), in a sparse file."""
    n = 99 << 20
    with (d / CTX).open("wb") as f:
        f.write(n.to_bytes(8, "little") + b"{")
        f.seek(8 + n + 64)
        f.write(b"\0")


def _poison(value: float) -> Callable[[Path], None]:
    def how(d: Path) -> None:
        state = load_file(str(d / CTX))
        state["context"][1, 2] = value
        _context(d, state["context"])
    return how


def _link_out(d: Path) -> None:
    outside = d.parent / "elsewhere.safetensors"
    shutil.move(str(d / CTX), outside)
    (d / CTX).symlink_to(outside)


BREAK: dict[str, tuple[Callable[[Path], None], str]] = {
    "partial download": (_truncate, "not a readable safetensors file: "),
    "99 MB header": (_big_header, "not a safetensors header"),
    "not safetensors": (lambda d: (d / CTX).write_text("prompt: hello"), "partial download"),
    "int64 context": (lambda d: _context(d, torch.ones(5, WIDTH, dtype=torch.int64)), "stored as I64"),
    "too many tokens": (lambda d: _context(d, torch.randn(TOKENS + 1, WIDTH)), f"L in 1..{TOKENS}"),
    "3-d context": (lambda d: _context(d, torch.randn(1, 5, WIDTH)), "not a text context file"),
    "another width": (lambda d: _context(d, torch.randn(5, WIDTH + 1)), f"width {WIDTH + 1}"),
    "NaN": (_poison(math.nan), "NaN or infinite"),
    "Inf": (_poison(math.inf), "NaN or infinite"),
    "a link out of the folder": (_link_out, "outside"),
}


@pytest.mark.parametrize("name", list(BREAK))
def test_check_and_generate_refuse_a_hostile_context(name: str, tiny_la: Path, tmp_path: Path, speech: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    d = shutil.copytree(tiny_la, tmp_path / "la", symlinks=True)
    how, words = BREAK[name]
    how(d)
    rc = main(["models", "check", str(d), "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 1 and not report["ok"], report["problems"]
    assert any(words in p and CTX in p for p in report["problems"]), report["problems"]
    out = tmp_path / "o.mp4"
    rc = main(["generate", "--model", f"liveavatar:{d}", "--reference", str(REFERENCE), "--audio", str(speech),
               "--out", str(out), "--no-progress", "--no-watermark"])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc != 0 and "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("avatarstream: error: ") and words in lines[0] and CTX in lines[0], lines[0]
    assert not out.exists()


def test_a_sound_context_passes_the_check_and_loads(tiny_la: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The control: the download as written passes `models check`, and its context loads."""
    from avatarstream.weights.liveavatar_folder import parse_name
    from avatarstream.weights.liveavatar_model import load_context

    rc = main(["models", "check", str(tiny_la), "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and report["ok"], report["problems"]
    text = load_context(parse_name(f"liveavatar:{tiny_la}"), None)
    assert tuple(text.context.shape) == (5, WIDTH) and torch.isfinite(text.context).all()
