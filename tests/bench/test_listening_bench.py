"""`bench listening` on the tiny random model: one JSON object on the last line with the keys it
promises. The random model's frames are noise, so only the listening side is checked for values:
the mouth stays at the reference's (the ground truth's silence level) and listening moves more
than idling."""

from __future__ import annotations

import json

from conftest import run_cli


def test_bench_listening_json():
    r = run_cli("bench", "listening", "--model", "tiny-random", "--json", "--idle-s", "0.5",
                "--listen-s", "1.5", "--speech-s", "0.6", timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["model"] == "tiny-random"
    assert set(out) >= {"mouth", "seams", "motion", "speech_start_delay_s", "state_frames", "ease_s"}
    m = out["mouth"]
    assert set(m) >= {"listening", "silence", "speech", "in_silence_range", "ok", "closed_below"}
    assert m["listening"]["frames"] > 0 and m["silence"]["frames"] > 0
    assert m["listening"]["max"] < m["closed_below"]  # a closed mouth, read by the expert
    s = out["seams"]
    assert set(s["chunk"]) == {"p50", "p95", "max", "count"}
    kinds = [w["kind"] for w in s["switches"]]
    assert kinds.count("listening->speech") == 2 and len(kinds) == 4
    assert all(w["change"] >= 0 for w in s["switches"]) and isinstance(s["ok"], bool)
    mo = out["motion"]
    assert mo["listening"]["frames"] > 0 and mo["idle"]["frames"] > 0
    assert mo["change_ratio"] > 1.0 and mo["listening"]["pitch_range_deg"] >= 0
    assert all(0 < d <= out["ease_s"] + 1e-6 for d in out["speech_start_delay_s"])


def test_bench_listening_refuses_bad_options():
    r = run_cli("bench", "listening", "--model", "tiny-random", "--listen-s", "0")
    assert r.returncode != 0 and "--listen-s" in r.stderr and "Traceback" not in r.stderr
