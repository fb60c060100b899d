"""The bundled trained model: it loads and runs, and it is the default (what `make demo` gets)."""

import pytest
import torch


@pytest.mark.parametrize("causal", [False, True])
def test_committed_checkpoint_loads_and_generates(one_thread, causal):
    """The bundled models (weights/avatarstream-small, and its causal student
    weights/avatarstream-small-causal) load strictly into the registry's classes, are the defaults
    (of generate; of the causal benchmarks) and generate timed frames from the held-out example
    (1 s, 1 step) that look like the reference (its scene anchor or sink and trained VAE: not
    noise, not a flat field)."""
    import dataclasses
    from pathlib import Path

    import numpy as np

    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.media.reference import load_reference
    from avatarstream.registry import BUNDLED, BUNDLED_CAUSAL, MODELS, default_model, load_model, resolve_model

    name = BUNDLED_CAUSAL if causal else BUNDLED
    if name not in MODELS:
        pytest.skip(f"no bundled model {name}")
    assert default_model() == BUNDLED and resolve_model(None) == BUNDLED
    if causal:
        assert default_model(causal=True) == name == resolve_model(None, causal=True)
    models = load_model(name)
    assert models.config.strategy == ("causal" if causal else "prefix")
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
    want = ref[0].permute(1, 2, 0).numpy().astype(np.float32)  # [256, 256, 3]
    err = np.abs(frames.astype(np.float32) - want).mean(axis=(1, 2, 3))
    other = np.abs(frames.astype(np.float32) - want[::-1]).mean(axis=(1, 2, 3))  # the picture upside down
    assert err.max() < 25 and err.max() < 0.5 * other.min(), (err.max(), other.min())


def test_bundled_weights_stay_within_the_repository_budget():
    """Every bundled model's files together (weights, configs, cards, plots) stay under 50 MB,
    the budget for what the repository ships."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "src" / "avatarstream" / "weights"
    sizes = {d.name: sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
             for d in root.iterdir() if (d / "config.json").is_file()}  # the model folders, not the reader's code
    assert sizes, "no bundled model folder"
    assert sum(sizes.values()) <= 50 * 2**20, sizes


@pytest.mark.parametrize("argv, want", [([], ("avatarstream-small", "prefix", 2)),
                                        (["--strategy", "causal"], ("avatarstream-small-causal", "causal", 4))])
def test_generate_picks_the_bundled_model_for_the_strategy(one_thread, media, tmp_path, capsys, argv, want):
    """`generate` without --model runs the bundled model; with `--strategy causal`, its causal
    student (each at its own default steps)."""
    import json
    from pathlib import Path

    from avatarstream.cli import main
    from avatarstream.registry import BUNDLED_CAUSAL, MODELS

    if BUNDLED_CAUSAL not in MODELS:
        pytest.skip("no bundled causal student")
    ex = Path(__file__).resolve().parents[1] / "examples"
    assert main(["generate", "--reference", str(ex / "reference.png"), "--audio", str(media["wav_3s"]),
                 "--out", str(tmp_path / "o.mp4"), "--no-progress", "--json", *argv]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (r["model"], r["strategy"], r["steps"]) == want and r["frames"] == 75
