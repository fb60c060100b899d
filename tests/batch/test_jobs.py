"""The JOBS file of `avatarstream batch` (batch/jobs.py): the three formats read alike, every bad
row is found with its number and reason, templates, keys. No Ray here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from avatarstream.batch.jobs import Job, check_out, load_jobs, stamp, substitute
from avatarstream.errors import ConfigError, InputError

from .helpers import write_csv

HEADER = ["reference", "audio", "text", "voice", "out", "model", "size", "seed", "first_name"]


def _good_rows(inputs) -> list[list[object]]:  # type: ignore[no-untyped-def]
    return [["ref.png", "a.wav", "", "", "one.mp4", "", "", "", ""],
            ["ref.png", "", "Hi {first_name}!", "espeak:en-us+m1", "team/two.mp4", "tiny-random", "64x32", "7", "Ann"]]


def test_csv_jsonl_and_parquet_give_the_same_jobs(inputs, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = _good_rows(inputs)
    dicts = [{k: v for k, v in zip(HEADER, r) if v != ""} for r in rows]
    d = inputs["dir"]
    csv_path = write_csv(d / "jobs.csv", HEADER, rows)
    jsonl = d / "jobs.jsonl"
    # JSONL: numbers as numbers, a blank line between rows is no row
    jsonl.write_text("\n\n".join(json.dumps({**r, **({"seed": 7} if "seed" in r else {})}) for r in dicts) + "\n")
    parquet = d / "jobs.parquet"
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in HEADER} for r in dicts]), parquet)  # nulls
    got = [load_jobs(p, default_model="tiny-random") for p in (csv_path, jsonl, parquet)]
    for jobs, bad, n in got:
        assert (bad, n) == ([], 2)
        assert jobs == got[0][0]
    one, two = got[0][0]
    assert one == Job(row=1, out="one.mp4", reference=str(inputs["ref"]), model="tiny-random",
                      audio=str(inputs["a"]), inputs=stamp(str(inputs["ref"]), str(inputs["a"])))
    # the speech re-recorded at the same path: another key, so a rerun renders the row again
    audio = Path(inputs["a"])
    audio.write_bytes(audio.read_bytes() + b"\0")
    again = load_jobs(csv_path, default_model="tiny-random")[0][0]
    assert again.key != one.key and again.audio == one.audio
    assert (two.text, two.voice, two.size, two.seed, two.out) == ("Hi Ann!", "espeak:en-us+m1", "64x32", 7, "team/two.mp4")


def test_every_bad_row_is_reported_with_its_reason_and_the_good_ones_kept(inputs):
    rows = [
        ["ref.png", "a.wav", "", "", "ok.mp4", "", "", "", ""],                       # 1 good
        ["missing.png", "a.wav", "", "", "r2.mp4", "", "", "", ""],                   # 2 no reference
        ["ref.png", "a.wav", "hello", "", "r3.mp4", "", "", "", ""],                  # 3 both
        ["ref.png", "", "", "", "r4.mp4", "", "", "", ""],                            # 4 neither
        ["ref.png", "a.wav", "", "", "r5.mp4", "no-such-model", "", "", ""],          # 5 unknown model
        ["ref.png", "a.wav", "", "", "r6.mp4", "", "65x64", "", ""],                  # 6 size
        ["ref.png", "a.wav", "", "", "/tmp/abs.mp4", "", "", "", ""],                 # 7 absolute
        ["ref.png", "a.wav", "", "", "../up.mp4", "", "", "", ""],                    # 8 ..
        ["ref.png", "not-audio.wav", "", "", "r9.mp4", "", "", "", ""],               # 9 unreadable audio
        ["ref.png", "a.wav", "", "", "dup.mp4", "", "", "", ""],                      # 10 duplicate
        ["ref.png", "b.wav", "", "", "dup.mp4", "", "", "", ""],                      # 11 duplicate
        ["ref.png", "", "Hi {first_name}", "", "r12.mp4", "", "", "", ""],            # 12 empty field
        ["ref.png", "", "Hi {last_name}", "", "r13.mp4", "", "", "", "Bo"],           # 13 no such column
        ["ref.png", "", "Hi", "klingon", "r14.mp4", "", "", "", ""],                  # 14 unknown voice
        ["ref.png", "a.wav", "", "", "r15.mov", "", "", "", ""],                      # 15 not mp4
        ["ref.png", "a.wav", "", "", "r16.mp4", "", "", "x", ""],                     # 16 seed
        ["ref.png", "", "Hi {first_name}", "", "fine.mp4", "", "", "", "Cy"],         # 17 good
    ]
    path = write_csv(inputs["dir"] / "mixed.csv", HEADER, rows)
    jobs, bad, n = load_jobs(path, default_model="tiny-random")
    assert n == 17 and [j.row for j in jobs] == [1, 17]
    reasons = {b.row: b.reason for b in bad}
    assert sorted(reasons) == list(range(2, 17))
    expect = {2: "reference missing.png not found", 3: "not both", 4: "no speech", 5: "unknown model",
              6: "65", 7: "absolute path", 8: "`..`", 9: "not a readable audio file",
              10: "out dup.mp4 is the out of rows 10, 11", 11: "rows 10, 11", 12: "`first_name` is empty",
              13: "no `last_name` column", 14: "unknown voice", 15: "end the name in .mp4",
              16: "whole number"}
    for row, words in expect.items():
        assert words in reasons[row], (row, reasons[row])
    assert str(bad[0]).startswith("row 2: ")


def test_a_file_that_is_wrong_as_a_whole_is_one_user_error(inputs, tmp_path):
    with pytest.raises(ConfigError, match="unknown JOBS format '.xlsx'"):
        load_jobs(tmp_path / "jobs.xlsx", default_model="tiny-random")
    with pytest.raises(InputError, match="does not exist"):
        load_jobs(tmp_path / "nope.csv", default_model="tiny-random")
    no_out = write_csv(inputs["dir"] / "no-out.csv", ["reference", "audio"], [["ref.png", "a.wav"]])
    with pytest.raises(ConfigError, match="no `out` column"):
        load_jobs(no_out, default_model="tiny-random")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="as Parquet"):
        load_jobs(junk, default_model="tiny-random")
    lines = tmp_path / "j.jsonl"
    lines.write_text('{"reference": "%s", "audio": "%s", "out": "a.mp4"}\n[1, 2]\n{oops\n'
                     % (inputs["ref"], inputs["a"]))
    jobs, bad, n = load_jobs(lines, default_model="tiny-random")  # a bad line is a bad row, not fatal
    assert (n, [j.row for j in jobs], [(b.row, b.reason) for b in bad][0]) == (3, [1], (2, "not a JSON object"))
    assert bad[1].row == 3 and bad[1].reason.startswith("not JSON")


def test_the_key_follows_what_decides_the_video():
    base = Job(row=1, out="a.mp4", reference="/r.png", model="tiny-random", text="Hi Ann")
    assert Job(**{**base.__dict__, "row": 9}).key == base.key  # moving a row is no edit
    for change in ({"text": "Hi Bo"}, {"seed": 1}, {"size": "64"}, {"voice": "flite:slt"},
                   {"reference": "/s.png"}, {"model": "small-random"}, {"strategy": "interp"}):
        assert Job(**{**base.__dict__, **change}).key != base.key, change


def test_template_and_out_rules():
    assert substitute("Hi {name}, {{literal}}", {"name": "Ann"}) == "Hi Ann, {literal}"
    for text in ("{name.__class__}", "{name!r}", "{0}", "{unclosed"):
        with pytest.raises(InputError):
            substitute(text, {"name": "Ann"})
    assert check_out("sub\\dir/v.mp4") == "sub/dir/v.mp4"
    for out in ("C:/x.mp4", "~/x.mp4", ".hidden.mp4", "a/.b/c.mp4", "v.partial-12.mp4", ".batch-manifest.mp4"):
        with pytest.raises(InputError):
            check_out(out)
