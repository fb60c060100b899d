"""`avatarstream generate` end to end, as a user runs it: real processes, real codecs, outputs decoded."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import av
import pytest

from conftest import run_cli

FPS = 25


def probe(path: Path) -> dict:
    """Decode everything: codec names, video frame count, audio seconds."""
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        info = {"vcodec": v.codec_context.name, "acodec": a.codec_context.name,
                "width": v.codec_context.width}
        frames = 0
        samples = 0
        for packet in c.demux(v, a):
            for f in packet.decode():
                if isinstance(f, av.VideoFrame):
                    frames += 1
                else:
                    samples += f.samples
        info["frames"] = frames
        info["audio_s"] = samples / a.rate
    return info


def audio_seconds(path: Path) -> float:
    with av.open(str(path)) as c:
        a = c.streams.audio[0]
        return sum(f.samples for f in c.decode(a)) / a.rate


@pytest.mark.parametrize("ref_kind", ["png", "mp4"])
def test_generate_mp3_44k_stereo(media, tmp_path, ref_kind):
    out = tmp_path / "out.mp4"
    r = run_cli("generate", "--model", "tiny-random", "--reference", str(media[ref_kind]),
                "--audio", str(media["mp3_7s"]), "--out", str(out), "--json", "--no-progress")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    info = probe(out)
    assert info["vcodec"] == "h264" and info["acodec"] == "aac"
    src = audio_seconds(media["mp3_7s"])
    assert abs(info["frames"] / FPS - src) <= 1 / FPS, (info, src)
    assert abs(info["audio_s"] - src) <= 1 / FPS + 0.03  # AAC priming/padding frames at most
    assert summary["frames"] == info["frames"]
    for key in ("ttff_s", "fps", "rtf", "peak_rss_mb", "stage_ms"):
        assert key in summary


@pytest.mark.parametrize("strategy", ["prefix", "interp"])
def test_generate_both_strategies(media, tmp_path, strategy):
    out = tmp_path / f"{strategy}.mp4"
    r = run_cli("generate", "--reference", str(media["png"]), "--audio", str(media["wav_3s"]),
                "--out", str(out), "--strategy", strategy, "--seconds-per-chunk", "0.5",
                "--no-progress")
    assert r.returncode == 0, r.stderr
    assert probe(out)["frames"] == 75


def test_sigkill_leaves_playable_file(media, tmp_path):
    """Kill -9 half way: the file being written (beside --out, named in the events) decodes to (at
    least) every frame reported durable."""
    out = tmp_path / "killed.mp4"
    cmd = [sys.executable, "-m", "avatarstream.cli", "generate", "--reference", str(media["png"]),
           "--audio", str(media["wav_60s"]), "--out", str(out), "--events", "--no-progress"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    durable = 0
    deadline = time.time() + 240
    try:
        for line in proc.stderr:
            if line.startswith("{"):
                durable, partial = json.loads(line)["durable_frames"], Path(json.loads(line)["file"])
                if durable >= 100:
                    break
            assert time.time() < deadline
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert 100 <= durable < 1500, "killed before the end"
    assert not out.exists() and partial.parent == out.parent
    info = probe(partial)
    assert info["vcodec"] == "h264"
    assert info["frames"] >= durable


BAD = [
    ("missing reference", ["--reference", "{d}/nope.png"], "reference"),
    ("corrupt reference", ["--reference", "{d}/corrupt.png"], "reference"),
    ("empty reference", ["--reference", "{d}/empty.jpg"], "reference"),
    ("missing audio", ["--audio", "{d}/nope.wav"], "audio"),
    ("empty audio", ["--audio", "{d}/silent0.wav"], "audio"),
    ("corrupt audio", ["--audio", "{d}/corrupt.mp3"], "audio"),
    ("audio over the cap", ["--max-audio-seconds", "2"], "--max-audio-seconds"),
    ("unwritable output", ["--out", "/proc/avatarstream/out.mp4"], "out"),
    ("unknown model", ["--model", "no-such-model"], "no-such-model"),
    ("missing scene image", ["--scene", "{d}/nope.png"], "scene image"),
    ("scene with causal", ["--scene", "{d}/corrupt.png", "--strategy", "causal"], "--scene"),
    ("guidance scale out of range", ["--audio-scale", "-1", "--ref-scale", "1"], "--audio-scale"),
]


@pytest.mark.parametrize("name,override,mention", BAD, ids=[b[0] for b in BAD])
def test_user_mistakes_give_one_clear_error(media, tmp_path, name, override, mention):
    d = tmp_path
    (d / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    (d / "empty.jpg").write_bytes(b"")
    (d / "corrupt.mp3").write_bytes(b"ID3" + bytes(range(256)) * 8)
    from avatarstream.bench.inputs import write_wav
    import numpy as np

    write_wav(d / "silent0.wav", np.zeros(0, np.float32))
    args = {"--reference": str(media["png"]), "--audio": str(media["wav_3s"]),
            "--out": str(d / "out.mp4"), "--model": "tiny-random"}
    extra = []
    for i in range(0, len(override), 2):
        key, val = override[i], override[i + 1].format(d=d)
        if key in args:
            args[key] = val
        else:
            extra += [key, val]
    r = run_cli("generate", *[x for kv in args.items() for x in kv], *extra, "--no-progress")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("avatarstream: error:"), r.stderr
    assert mention.lower() in lines[0].lower(), lines[0]
    if not args["--out"].startswith("/proc"):
        assert not Path(args["--out"]).exists(), "a failed run left an output file behind"


def test_sink_switches_go_both_ways():
    """`--adaptive-sink` / `--no-adaptive-sink` (and the Rolling RoPE pair) override the model's
    default either way; left out, the model's default stands."""
    from avatarstream.cli import build_parser
    from avatarstream.cli_generate import _overrides
    from avatarstream.weights import small_pipeline

    p = build_parser()
    base = ["generate", "--reference", "r.png", "--audio", "a.wav", "--out", "o.mp4"]
    c = small_pipeline()
    assert _overrides(c, p.parse_args(base)) == {}
    assert _overrides(c, p.parse_args(base + ["--no-adaptive-sink"])) == {"adaptive_sink": False}
    assert _overrides(c, p.parse_args(base + ["--adaptive-sink", "--no-rolling-rope"])) == {
        "adaptive_sink": True, "rolling_rope": False}
