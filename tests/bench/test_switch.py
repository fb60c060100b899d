"""`bench switch`: one JSON object on the last line with the keys it promises and sane values
(timings of a CPU, so only orders and signs are checked, never speeds)."""

from __future__ import annotations

import json

from conftest import run_cli


def test_bench_switch_json():
    r = run_cli("bench", "switch", "--json", "--repeats", "3")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for key in ("switch_ms", "cold_switch_ms", "release_ms"):
        assert set(out[key]) == {"median", "p90"}
        assert 0 < out[key]["median"] <= out[key]["p90"] < 10_000
    assert out["device"] == "cpu" and out["size"] == "tiny" and out["repeats"] == 3
    assert out["gpu_timing"].startswith("pending")
    # bytes: the VAE's first block, part of the VAE's offloaded blocks
    assert 0 < out["bytes_moved"] <= out["incoming_offloaded_bytes"]
    assert out["outgoing_offloaded_bytes"] > 0 and out["dit_blocks"] == 2
    fw = out["dit_forward_ms"]
    assert set(fw) == {"resident", "block_store", "block_store_after_switch", "fsdp2"}
    assert all(v["median"] > 0 for v in fw.values())


def test_bench_switch_refuses_bad_options():
    r = run_cli("bench", "switch", "--repeats", "0")
    assert r.returncode == 2 and "--repeats must be at least 1" in r.stderr
