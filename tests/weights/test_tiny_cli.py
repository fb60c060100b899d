"""`avatarstream models tiny FAMILY DIR` (weights/tiny_cli.py): each family's tiny folder passes
`models check` as written, the command never writes over a folder that holds something, and the
package's check modules import no circle (check <-> check_liveavatar <-> liveavatar_folder <->
flashhead_folder was one)."""

from __future__ import annotations

import json
from pathlib import Path

import grimp
import pytest

from avatarstream.cli import main


@pytest.mark.parametrize("family", ["flashhead-pro", "liveavatar", "wav2vec2"])
def test_tiny_folder_passes_the_check(family: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "tiny"
    assert main(["models", "tiny", family, str(d), "--json"]) == 0
    made = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert made["folder"] == str(d) and made["family"] == family and made["files"]
    assert all((d / f).is_file() for f in made["files"]) and made["try"][0] == f"avatarstream models check {d}"
    assert main(["models", "check", str(d), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["ok"] and report["problems"] == []
    want = {"flashhead-pro": {"flashhead-pro"}, "liveavatar": {"liveavatar"}, "wav2vec2": set()}[family]
    assert set(report["models"]) == want


def test_both_flashhead_variants_in_one_folder_and_nothing_written_over(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "tiny"
    assert main(["models", "tiny", "flashhead-pro", str(d), "--json"]) == 0
    assert main(["models", "tiny", "flashhead-lite", str(d), "--json"]) == 0
    capsys.readouterr()
    assert main(["models", "check", str(d), "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["models"]) == {"flashhead-pro",
                                                                                            "flashhead-lite"}
    before = (d / "Model_Pro" / "config.json").read_bytes()
    assert main(["models", "tiny", "flashhead-pro", str(d)]) != 0  # Model_Pro/ is there
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(["models", "tiny", "liveavatar", str(other)]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "Traceback" not in err and "not empty" in err
    assert (d / "Model_Pro" / "config.json").read_bytes() == before and [p.name for p in other.iterdir()] == ["notes.txt"]


def test_no_import_circle_in_the_weights_package() -> None:
    graph = grimp.build_graph("avatarstream", cache_dir=None)
    mods = {m for m in graph.modules if m.startswith("avatarstream.weights.")}
    circles = [(a, b) for a in sorted(mods) for b in sorted(mods) if a < b
               and graph.chain_exists(importer=a, imported=b) and graph.chain_exists(importer=b, imported=a)]
    assert not circles, circles
