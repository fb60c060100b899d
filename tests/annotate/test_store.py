"""The pairs folder's checks, the judgement store and both exports, without a browser."""

from __future__ import annotations

import json
import sqlite3

import pytest

from avatarstream.annotate.export import export_auto, export_human
from avatarstream.annotate.pairs import load_pairs
from avatarstream.annotate.store import SCHEMA_VERSION, Store
from avatarstream.errors import ConfigError, InputError, OutputError
from .helpers import make_pairs, read_jsonl, write_lines


@pytest.fixture
def pairs(tmp_path):
    root = tmp_path / "PAIRS"
    make_pairs(root, n=4, auto=[(0.41, 0.28), (0.30, 0.31), (0.20, 0.45), None])
    return root


# -- the pairs folder ------------------------------------------------------------------------------
def test_a_pairs_folder_loads_with_paths_inside_it(pairs):
    folder = load_pairs(pairs)
    assert [p.pair for p in folder.pairs] == ["p0000", "p0001", "p0002", "p0003"]
    p = folder.get("p0002")
    assert p.left_record == "renders/r0004.pt" and p.auto == (0.20, 0.45) and p.text == "hello there 2"
    assert p.video("right") == (pairs / "renders" / "r0005.mp4").resolve()
    assert folder.get("p0003").auto is None and folder.get("nope") is None


@pytest.mark.parametrize("bad, message", [
    ('{"pair": "p0000", "condition": ', "line 2: not valid JSON"),
    ('["a list"]', "line 2: not a JSON object"),
    ('{"pair": "", "condition": "c"}', 'line 2: "pair" must be a non-empty string'),
    ({"left": "/etc/passwd"}, 'line 2: "left" (/etc/passwd) leaves the pairs folder'),
    ({"right": "renders/../../secret.mp4"}, "leaves the pairs folder"),
    ({"left_record": "../r.pt"}, '"left_record" (../r.pt) leaves the pairs folder'),
    ({"right": "renders/missing.mp4"}, "line 2: video not found"),
    ({"auto": {"left": 0.1}}, '"auto" must be'),
    ({"pair": "p0000"}, 'pair "p0000" appears twice'),
])
def test_a_bad_line_is_refused_with_its_line_number(pairs, bad, message):
    lines = make_pairs(pairs, n=2)
    lines[1] = bad if isinstance(bad, str) else {**lines[1], **bad}
    write_lines(pairs, lines)
    with pytest.raises(InputError) as e:
        load_pairs(pairs)
    assert "pairs.jsonl, line 2: " in str(e.value) and message in str(e.value) and "\n" not in str(e.value)


def test_a_link_out_of_the_folder_is_refused(pairs, tmp_path):
    (tmp_path / "outside.mp4").write_bytes(b"x")
    (pairs / "renders" / "link.mp4").symlink_to(tmp_path / "outside.mp4")
    lines = make_pairs(pairs, n=1)
    write_lines(pairs, [{**lines[0], "left": "renders/link.mp4"}])
    with pytest.raises(InputError, match="leads out of the pairs folder"):
        load_pairs(pairs)


def test_a_missing_folder_or_pairs_file_is_refused(tmp_path):
    with pytest.raises(InputError, match="pairs folder not found"):
        load_pairs(tmp_path / "nope")
    with pytest.raises(InputError, match="pairs.jsonl not found"):
        load_pairs(tmp_path)
    (tmp_path / "pairs.jsonl").write_text("\n\n")
    with pytest.raises(InputError, match="holds no pairs"):
        load_pairs(tmp_path)


# -- the store -------------------------------------------------------------------------------------
def test_choices_are_recorded_and_undone(tmp_path):
    with Store(tmp_path / "a.sqlite") as s:
        s.record("p0000", "left", "  ann ", swapped=True)
        s.record("p0001", "skip", "ann")
        s.record("p0000", "tie", "bob")
        assert s.judged("ann") == {"p0000", "p0001"} and s.judged("bob") == {"p0000"}
        rows = s.all()
        assert [(j.pair, j.choice, j.annotator, j.swapped) for j in rows] == [
            ("p0000", "left", "ann", True), ("p0001", "skip", "ann", False), ("p0000", "tie", "bob", False)]
        assert rows[0].time.endswith("Z") and "T" in rows[0].time
        assert s.undo("ann").pair == "p0001" and s.judged("ann") == {"p0000"}
        assert s.undo("carol") is None
        with pytest.raises(InputError, match="name is required"):
            s.record("p0000", "left", "  ")
        with pytest.raises(InputError, match="choice must be one of"):
            s.record("p0000", "better", "ann")
    db = sqlite3.connect(tmp_path / "a.sqlite")
    assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_other_databases_are_refused(tmp_path):
    newer = tmp_path / "newer.sqlite"
    sqlite3.connect(newer).execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(InputError, match="newer avatarstream"):
        Store(newer)
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as db:
        db.execute("CREATE TABLE t (x)")
    with pytest.raises(InputError, match="something else"):
        Store(other)
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all" * 100)
    with pytest.raises(InputError, match="cannot use"):
        Store(tmp_path / "junk.sqlite")
    with pytest.raises(InputError, match="no annotations found"):
        Store(tmp_path / "missing.sqlite", create=False)
    with pytest.raises(OutputError, match="its folder does not exist"):
        Store(tmp_path / "no" / "a.sqlite")


# -- exports ---------------------------------------------------------------------------------------
def test_export_writes_the_latest_decisive_judgements(pairs, tmp_path):
    db = pairs / "annotations.sqlite"
    with Store(db) as s:
        s.record("p0000", "right", "ann", time="2026-01-01T00:00:00Z")
        s.record("p0000", "left", "ann", time="2026-01-01T00:01:00Z")  # ann changed her mind: latest wins
        s.record("p0001", "tie", "ann")
        s.record("p0002", "left", "ann")
        s.record("p0002", "skip", "ann")  # a later skip withdraws the preference
        s.record("p0003", "right", "ann")
        s.record("p0000", "right", "bob", time="2026-01-01T00:02:00Z")
        s.record("gone", "left", "bob")  # a pair no longer in pairs.jsonl
    out = tmp_path / "prefs.jsonl"
    out.write_text("old\n")
    summary = export_human(load_pairs(pairs), db, out)
    lines = read_jsonl(out)
    assert [(ln["pair"], ln["annotator"], ln["chosen"], ln["rejected"]) for ln in lines] == [
        ("p0000", "ann", "renders/r0000.pt", "renders/r0001.pt"),
        ("p0003", "ann", "renders/r0007.pt", "renders/r0006.pt"),
        ("p0000", "bob", "renders/r0001.pt", "renders/r0000.pt")]
    assert lines[0] == {"pair": "p0000", "condition": "c0000", "chosen": "renders/r0000.pt",
                        "rejected": "renders/r0001.pt", "chosen_video": "renders/r0000.mp4",
                        "rejected_video": "renders/r0001.mp4", "annotator": "ann",
                        "time": "2026-01-01T00:01:00Z", "source": "human",
                        "pairs": "PAIRS"}  # the pairs folder, relative to the file's folder
    assert summary["exported"] == 3 and summary["unknown_pairs"] == 1
    assert summary["choices"] == {"left": 1, "right": 2, "tie": 1, "skip": 1}
    assert summary["annotators"] == {"ann": {"judged": 4, "exported": 2}, "bob": {"judged": 1, "exported": 1}}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["PAIRS", "prefs.jsonl"]  # no temporary file left
    only = export_human(load_pairs(pairs), db, out, annotator="bob")
    assert only["exported"] == 1 and [ln["annotator"] for ln in read_jsonl(out)] == ["bob"]


def test_export_refuses_without_a_database_or_an_output_folder(pairs, tmp_path):
    with pytest.raises(InputError, match="no annotations found"):
        export_human(load_pairs(pairs), pairs / "annotations.sqlite", tmp_path / "p.jsonl")
    Store(pairs / "annotations.sqlite").close()
    with pytest.raises(OutputError, match="folder does not exist"):
        export_human(load_pairs(pairs), pairs / "annotations.sqlite", tmp_path / "no" / "p.jsonl")


def test_auto_prefers_the_higher_score_beyond_the_margin(pairs, tmp_path):
    out = tmp_path / "auto.jsonl"
    summary = export_auto(load_pairs(pairs), out, margin=0.02)
    lines = read_jsonl(out)
    assert [(ln["pair"], ln["chosen"], ln["rejected"], ln["annotator"], ln["source"]) for ln in lines] == [
        ("p0000", "renders/r0000.pt", "renders/r0001.pt", "reward", "auto"),
        ("p0002", "renders/r0005.pt", "renders/r0004.pt", "reward", "auto")]
    assert summary == {"out": str(out), "exported": 2, "below_margin": 1, "unscored": 1, "pairs": 4,
                       "margin": 0.02}
    assert export_auto(load_pairs(pairs), out, margin=0.01)["exported"] == 3  # 0.30 vs 0.31: exactly 0.01
    assert export_auto(load_pairs(pairs), out, margin=0.5)["exported"] == 0 and read_jsonl(out) == []
    with pytest.raises(ConfigError, match="margin"):
        export_auto(load_pairs(pairs), out, margin=-1)
    assert json.loads(json.dumps(summary)) == summary
