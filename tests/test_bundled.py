"""The committed trained checkpoint: it loads and runs (what `--model avatarstream-small-wip` gets)."""

import pytest
import torch


def test_committed_checkpoint_loads_and_generates(one_thread):
    """The committed small checkpoint (weights/avatarstream-small-wip) loads strictly into the
    registry's classes and generates timed frames from the held-out example (1 s, 1 step)."""
    import dataclasses
    from pathlib import Path

    import numpy as np

    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.media.reference import load_reference
    from avatarstream.registry import MODELS, load_model

    if "avatarstream-small-wip" not in MODELS:
        pytest.skip("no committed checkpoint")
    models = load_model("avatarstream-small-wip")
    cfg = dataclasses.replace(models.config, steps=1)
    root = Path(__file__).resolve().parents[1]
    ref = load_reference(str(root / "examples" / "reference.png"), size=cfg.hr_size, max_frames=1).frames
    got = []

    class Sink:
        def write_video(self, chunk):  # noqa: ANN001
            got.append(chunk.frames)

        def write_audio(self, chunk):  # noqa: ANN001
            pass

    t = np.linspace(0, 1.0, 16000, dtype=np.float32)
    audio = iter(torch.from_numpy(0.3 * np.sin(2 * np.pi * 180 * t)).split(3200))
    s = Pipeline(models, cfg).run(ref, audio, [Sink()])
    frames = np.concatenate(got)
    assert s.frames == frames.shape[0] == 25 and frames.shape[1:] == (256, 256, 3)
    assert frames.std() > 5  # an image, not a flat field
