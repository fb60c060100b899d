"""`bench server-soak`: a small run (3 rounds of 3 clients against a real server, tiny-random)
prints one JSON object with the keys it promises and every session gone after each round; its
verdict, on made-up RSS series where the answer is known."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from avatarstream.bench.server_soak import verdict

KEYS = {"model", "rounds", "clients", "idle_timeout_s", "server_args", "server_rss_mb_start",
        "server_rss_mb_per_round", "sessions_live_after_round", "video_frames_per_round",
        "client_errors", "client_error_count", "levelled_off", "growth_mb_middle_to_last_third",
        "growth_mb_per_round_second_half", "level_mb", "wall_s"}


@pytest.mark.slow
@pytest.mark.soak  # alongside the rest in make test
@pytest.mark.timeout(400)
def test_server_soak_smoke_json():
    r = run_cli("bench", "server-soak", "--rounds", "3", "--clients", "3", "--json", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert set(out) == KEYS
    assert out["rounds"] == 3 and out["clients"] == 3 and out["client_error_count"] == 0
    assert out["sessions_live_after_round"] == [0, 0, 0]  # ended and dropped sessions all reaped
    assert len(out["server_rss_mb_per_round"]) == 3
    assert all(m > 50 for m in out["server_rss_mb_per_round"])
    assert all(f > 0 for f in out["video_frames_per_round"])  # the viewers saw video
    assert isinstance(out["levelled_off"], bool)


def test_server_soak_refuses_bad_options():
    r = run_cli("bench", "server-soak", "--rounds", "2")
    assert r.returncode == 2 and "--rounds must be at least 3" in r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli("bench", "server-soak", "--clients", "0")
    assert r.returncode == 2 and "--clients must be at least 1" in r.stderr
    r = run_cli("bench", "server-soak", "--server-args", '--threads "2')
    assert r.returncode == 2 and "--server-args: No closing quotation" in r.stderr
    assert "Traceback" not in r.stderr


def test_verdict_tells_a_level_from_a_leak():
    # what the server measured with its memory given back (MB after each of 12 rounds)
    level = [391.4, 406.4, 417.9, 438.1, 436.2, 417.0, 427.2, 428.3, 457.1, 441.3, 439.6, 451.5]
    v = verdict(level, 24.0)
    assert v["levelled_off"] is True and v["growth_mb_middle_to_last_third"] == pytest.approx(18.6)
    leak = [400 + 12.0 * i for i in range(12)]  # 12 MB more every round
    v = verdict(leak, 24.0)
    assert v["levelled_off"] is False and v["growth_mb_middle_to_last_third"] == 48.0
    assert v["growth_mb_per_round_second_half"] == pytest.approx(12.0)
    assert verdict([400.0, None, 420.0], 24.0)["levelled_off"] is None  # a round not read
