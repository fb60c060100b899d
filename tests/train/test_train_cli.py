"""`avatarstream train` (train/cli.py): user mistakes are one-line errors; a recipe runs and
resumes from the command line."""

from __future__ import annotations

import json

import pytest

from avatarstream.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_cli_user_errors(tmp_path, capsys, dataset):
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
    rd = tmp_path / "run"
    args = ["train", "sr-tiny", "--run-dir", str(rd), "--max-steps", "2", "--no-progress",
            "--set", f'data.prepared="{dataset["prepared"]}"', "--json"]
    assert main(args) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["step"] == 2 and s["stage"] == "sr"
    assert main(args[:-1] + ["--resume", "--max-steps", "3"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 3
