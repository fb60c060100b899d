"""The layer rules hold: the import-linter contracts of pyproject.toml pass (so a plain pytest
run enforces them, not only `make test`), and what they cannot see at run time holds too:
importing the registry reads nothing, and loading the bundled model and running a chunk loads
no training code or training data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> dict:
    """Run `code` in a fresh interpreter (nothing imported yet); it prints one JSON line last."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_import_contracts_hold():
    """`lint-imports` (the contracts in pyproject.toml) exits 0."""
    exe = Path(sys.executable).with_name("lint-imports")
    assert exe.is_file(), "import-linter is missing: pip install -e '.[dev]'"
    r = subprocess.run([str(exe), "--no-cache", "--no-logo"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


_WATCH = """
import json, os, sys
opened, scanned = [], []
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, os.PathLike)):
        opened.append(os.fspath(args[0]))
    elif event == "os.scandir" and args and args[0] is not None:  # glob; imports use os.listdir
        scanned.append(os.fspath(args[0]))
sys.addaudithook(hook)
def loaded(*pkgs):
    return sorted(m for m in sys.modules if m.split(".")[:2] in [["avatarstream", p] for p in pkgs])
"""


def test_importing_the_registry_reads_nothing():
    """`import avatarstream.registry` loads no train/data module, opens no weights or
    config.json and lists no weights folder; the bundled models appear when first listed."""
    out = _python(_WATCH + """
import avatarstream.registry as registry
weights = str(registry.WEIGHTS_DIR)
r = {"modules": loaded("train", "data"),
     "opened": [p for p in opened if p.startswith(weights) and not p.endswith((".py", ".pyc"))],
     "scanned": [p for p in scanned if p.startswith(weights)]}
r["listed"] = registry.available_models()
print(json.dumps(r))
""")
    assert out["modules"] == [] and out["opened"] == [] and out["scanned"] == [], out
    assert {"tiny-random", "small-random"} <= set(out["listed"])
    if (ROOT / "src" / "avatarstream" / "weights" / "avatarstream-small" / "config.json").is_file():
        assert "avatarstream-small" in out["listed"]


def test_loading_and_running_the_bundled_model_loads_no_training_code():
    """`load_model("avatarstream-small")` and a 1 s Pipeline.run (1 step) leave no
    `avatarstream.train` or `avatarstream.data` module in sys.modules."""
    if not (ROOT / "src" / "avatarstream" / "weights" / "avatarstream-small" / "config.json").is_file():
        pytest.skip("no bundled model")
    out = _python(_WATCH + """
import dataclasses, torch
from avatarstream.engine.pipeline import Pipeline
from avatarstream.media.synthetic import face_image, speechlike
from avatarstream.registry import load_model

class Sink:
    durable_frames = 0
    frames = 0
    def open(self, width, height, fps, sample_rate): pass
    def write_video(self, chunk): Sink.frames += len(chunk.frames)
    def write_audio(self, chunk): pass
    def close(self): pass
    def abort(self): pass

models = load_model("avatarstream-small")
cfg = dataclasses.replace(models.config, steps=1)
ref = torch.from_numpy(face_image(cfg.hr_size)).permute(2, 0, 1)[None]  # [1, 3, H, W] uint8
audio = iter(torch.from_numpy(speechlike(1.0)).split(3200))
Pipeline(models, cfg).run(ref, audio, [Sink()])
print(json.dumps({"modules": loaded("train", "data"), "frames": Sink.frames}))
""")
    assert out["frames"] == 25
    assert out["modules"] == [], out
