"""`bench realtime` shows it is alive (issue 37 item 2): a bar on stderr from the start (what runs
now, runs done of 2 x --repeat, the last rtf), while stdout's last line stays the JSON object."""

from __future__ import annotations

import json
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np


def test_bench_realtime_draws_progress_on_stderr_and_ends_stdout_with_the_json(tmp_path):
    wav = tmp_path / "a.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes((np.sin(np.arange(16000) / 8.0) * 8000).astype(np.int16).tobytes())
    ref = Path(__file__).parents[2] / "examples" / "reference.png"
    cmd = [sys.executable, "-m", "avatarstream.cli", "bench", "realtime", "--model", "tiny-random", "--reference",
           str(ref), "--audio", str(wav), "--threads", "1", "--steps", "1"]
    p = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    states = [s.strip() for s in p.stderr.replace("\r", "\n").splitlines() if s.strip()]
    first = next(i for i, s in enumerate(states) if "generate tiny-random, watermark on" in s)
    assert states[first].startswith("bench realtime: 0/2 runs [00:0")  # before the first run ends
    done = [i for i, s in enumerate(states) if s.startswith("bench realtime: 2/2 runs")]
    assert done and done[0] > first and any("last rtf" in s for s in states[first:])
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["model"] == "tiny-random" and out["frames"] == 25 and out["rtf"] > 0
    quiet = subprocess.run([*cmd, "--repeat", "1", "--no-progress", "--json"], capture_output=True, text=True,
                           timeout=600)
    assert quiet.returncode == 0 and "bench realtime" not in quiet.stderr
    assert json.loads(quiet.stdout.strip().splitlines()[-1])["rtf"] > 0
