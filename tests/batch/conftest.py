"""Inputs of the batch tests (a 64-pixel face, ~1 s of speech: a tiny-random render takes well
under a second) and one local Ray for the whole module run: every in-process batch uses it (its
`ray_session` finds Ray running), and the command-line runs join it with `--ray ADDRESS`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from avatarstream.media.image import write_png
from avatarstream.media.synthetic import face_image, speechlike, write_wav


@pytest.fixture(scope="session")
def inputs(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("batch-inputs")
    (d / "not-audio.wav").write_bytes(b"RIFF junk" * 50)
    (d / "not-image.png").write_bytes(b"\x89PNG junk" * 50)
    return {"dir": d, "ref": write_png(d / "ref.png", face_image(64)),
            "a": write_wav(d / "a.wav", speechlike(1.0)), "b": write_wav(d / "b.wav", speechlike(1.2, seed=1)),
            "bad_audio": d / "not-audio.wav", "bad_image": d / "not-image.png"}


@pytest.fixture(scope="package")
def ray_address(config_dir):  # type: ignore[no-untyped-def]
    """A local Ray of 3 CPUs (2 renderers + the speech stage) for the tests of this folder; its
    address. Shut down after them (later tests start their own Ray), the environment restored."""
    ray = pytest.importorskip("ray")
    omp = os.environ.get("OMP_NUM_THREADS")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp
