"""The command line's first contact (issue 37): every command's and sub-command's --help shows
help; `models list` lists; `--size` is checked against what the model really needs, with one line
naming the nearest sizes that work; `--seconds-per-chunk` is refused under causal, not ignored."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from avatarstream.cli import build_parser, main
from avatarstream.registry import MODELS, model_spec_for

BUNDLED = (Path(__file__).resolve().parents[1] / "src" / "avatarstream" / "weights" / "avatarstream-small"
           / "config.json").is_file()


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and sub-command of `parser`, as the words that name it."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((*path, name))
                out += _commands(sub, (*path, name))
    return out


# forms parsed from the words after the command (train's and eval's), not argparse sub-parsers
FORMS = [("train", "personality"), ("train", "prepare"), ("train", "export"), ("train", "a2v-tiny"),
         ("eval", "benchmark"), ("eval", "sweep"), ("eval", "card"), ("eval", "showcase")]


def test_every_command_and_subcommand_shows_its_help(capsys):
    """`avatarstream [COMMAND [SUB]] --help` exits 0 with its usage, never an error about the
    arguments it requires (`train personality --help` said "the following arguments are
    required")."""
    words = _commands(build_parser())
    assert ("models", "list") in words and ("bench", "realtime") in words and ("generate",) in words
    for path in [(), *words, *FORMS]:
        with pytest.raises(SystemExit) as e:
            main([*path, "--help"])
        out, err = capsys.readouterr()
        assert e.value.code == 0, (path, err)
        assert out.startswith("usage: avatarstream") and len(out) > 100, (path, out, err)
        if path[:1] == ("train",) and len(path) == 2:  # the form's own options
            assert "--" in out.split("\n", 1)[1], (path, out)


def test_models_and_models_list_list_the_models(capsys):
    assert main(["models"]) == 0
    plain = capsys.readouterr().out
    assert main(["models", "list"]) == 0
    listed = capsys.readouterr().out
    assert plain == listed
    assert {line.split()[0] for line in listed.splitlines()} == set(MODELS)


def _generate(tmp_path: Path, media: dict, *extra: str) -> list[str]:
    return ["generate", "--reference", str(media["png"]), "--audio", str(media["wav_3s"]),
            "--out", str(tmp_path / "out.mp4"), "--no-progress", *extra]


def _one_error(capsys, code: int) -> str:
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("avatarstream: error:"), (code, err)
    assert "Traceback" not in err
    return lines[0]


SIZES = [  # --size, what the one line says (every model here needs multiples of 32 pixels)
    ("144", "multiples of 32 pixels for this model", "128x128 or 160x160"),
    ("144x96", "multiples of 32 pixels for this model", "128x96 or 160x96"),
    ("100", "multiples of 32 pixels for this model", "96x96 or 128x128"),
    ("48", "multiples of 32 pixels for this model", "32x32 or 64x64"),  # a multiple of 16: ran into the DiT
    ("0", "give WIDTHxHEIGHT", ""),
    ("-5", "give WIDTHxHEIGHT", ""),
    ("abc", "give WIDTHxHEIGHT", ""),
    ("100000", "at most 4096 pixels", ""),
    ("5000x64", "at most 4096 pixels", ""),
]


@pytest.mark.parametrize("model", ["tiny-random", "avatarstream-small"])
def test_odd_sizes_are_one_clear_line_naming_the_nearest_sizes(media, tmp_path, capsys, model):
    """Before the fix the bundled model (DiT patch 4x4: 32 pixels a token) was checked against
    16 pixels (a preset's patch of 2), so `--size 144` or `48` crashed in the DiT."""
    if model == "avatarstream-small" and not BUNDLED:
        pytest.skip("no bundled model")
    for size, says, nearest in SIZES:
        line = _one_error(capsys, main(_generate(tmp_path, media, "--model", model, f"--size={size}")))
        assert says in line and nearest in line, (size, line)
        assert not (tmp_path / "out.mp4").exists()


def test_the_pixel_multiple_comes_from_the_networks():
    """What --size must be a multiple of is the model's DiT (and refiner) patch times the VAE's
    stride (times the refiner's upscale), whatever the preset says."""
    for name in ("tiny-random", "small-random", *(["avatarstream-small"] if BUNDLED else [])):
        spec = model_spec_for(name)
        c = spec.pipeline()
        assert c.patch_size == spec.dit().patch[-1]
        assert c.refiner_patch == (1 if spec.refiner is None else spec.refiner().patch[-1])
        assert c.pixel_multiple == 32, name
    if BUNDLED:
        assert model_spec_for("avatarstream-small").dit().patch == (1, 4, 4)


def test_seconds_per_chunk_is_refused_under_causal(media, tmp_path, capsys):
    """Causal generates blocks of latent frames (its KV caches are per block): the option that
    sets a prefix/interp chunk is refused with the reason, not silently ignored."""
    code = main(_generate(tmp_path, media, "--model", "tiny-random", "--strategy", "causal",
                          "--seconds-per-chunk", "1"))
    line = _one_error(capsys, code)
    assert "--seconds-per-chunk" in line and "causal generates blocks of 3 latent frames" in line, line
    assert not (tmp_path / "out.mp4").exists()


def test_seconds_per_chunk_still_sets_the_prefix_chunk():
    from avatarstream.cli_generate import _overrides

    p = build_parser(["generate"])
    base = ["generate", "--reference", "r.png", "--audio", "a.wav", "--out", "o.mp4", "--seconds-per-chunk", "1"]
    c = model_spec_for("tiny-random").pipeline()
    assert _overrides(c, p.parse_args(base)) == {"chunk": c.chunk_for_seconds(1.0)}
    assert _overrides(c, p.parse_args(base + ["--strategy", "interp"]))["chunk"] == c.chunk_for_seconds(1.0)
