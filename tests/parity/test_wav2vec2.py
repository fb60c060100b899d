"""wav2vec2 parity with the official audio paths (`wav2vec2` fixtures, variants liveavatar and
flashhead): the CLI on both fixtures, the loader's key forms, the FlashHead stream reproducing the
fixture's windows, and bad weights or fixtures as one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from safetensors.torch import save_file

from avatarstream.errors import InputError
from avatarstream.models.wav2vec2 import FlashHeadAudioConfig, FlashHeadAudioStream
from avatarstream.parity import wav2vec2
from avatarstream.parity.fixture import FAMILY_TOLERANCE, load_fixture, run_parity
from avatarstream.weights.wav2vec2 import load_wav2vec2, load_wav2vec2_folder

from .helpers import GOLDEN, cli_parity, rewrite_fixture

LIVEAVATAR, FLASHHEAD = GOLDEN / "wav2vec2-a.safetensors", GOLDEN / "wav2vec2-flashhead-a.safetensors"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("path", [LIVEAVATAR, FLASHHEAD], ids=["liveavatar", "flashhead"])
def test_cli_parity_passes(path: Path) -> None:
    """~5e-6 of values up to 7.6 (torch 2.13, AMD EPYC: liveavatar 5.30e-6 at 1 thread, 5.01e-6
    at 2; flashhead 4.41e-6 / 4.35e-6; transformers 4.51.3 itself lands 6.2e-6 from the stored
    tensors, and our port equals it exactly): the family's bound, 3e-5, is 5.7x the largest."""
    out = cli_parity(path)
    print(path.name, out["max_abs_diff"])
    assert out["family"] == "wav2vec2" and out["tolerance"] == FAMILY_TOLERANCE["wav2vec2"] == 3e-5
    assert out["pass"] and out["max_abs_diff"] <= out["tolerance"]


def test_every_expected_tensor_is_reproduced() -> None:
    for path in (LIVEAVATAR, FLASHHEAD):
        result = run_parity(path)
        assert set(result["outputs"]) == set(load_fixture(path).expected), path.name


def test_the_stream_gives_the_fixture_windows() -> None:
    """The fixture's 1 s clip is stream mode with a 1 s window and 9-frame chunks (frames [16, 25)):
    pushing the clip in pieces into a `FlashHeadAudioStream` gives its audio context."""
    fx = load_fixture(FLASHHEAD)
    s = fx.settings
    cfg = FlashHeadAudioConfig(sample_rate=s["sample_rate"], fps=s["fps"], frame_num=s["frame_num"],
                               window_seconds=int(s["waveform_seconds"]))
    assert cfg.frames(cfg.window_samples) - cfg.frame_num == s["audio_start_idx"]
    stream = FlashHeadAudioStream(load_wav2vec2(fx.weights, fx.config), cfg)
    for piece in fx.inputs["waveform"].split(5_000):
        stream.push(piece)
    with torch.inference_mode():
        got = stream.context()
    assert (got - fx.expected["audio_embedding"]).abs().max() <= FAMILY_TOLERANCE["wav2vec2"]  # measured 2.1e-6


def test_both_weight_norm_forms_and_the_hf_prefix_load_the_same() -> None:
    """Checkpoint names (weight_g/weight_v) and today's parametrization names (original0/1), with
    and without the `wav2vec2.` prefix of a Wav2Vec2ForCTC file, give the same network."""
    fx = load_fixture(FLASHHEAD)
    pos = "encoder.pos_conv_embed.conv."
    renamed = {k.replace(pos + "weight_g", pos + "parametrizations.weight.original0")
               .replace(pos + "weight_v", pos + "parametrizations.weight.original1"): v
               for k, v in fx.weights.items()}
    prefixed = {"wav2vec2." + k: v for k, v in renamed.items()} | {"lm_head.weight": torch.zeros(32, 16)}
    wave = torch.randn(1, 4000)
    with torch.inference_mode():
        want = load_wav2vec2(fx.weights, fx.config)(wave)
        for state in (renamed, prefixed):
            assert torch.equal(load_wav2vec2(state, fx.config)(wave), want)


def test_a_folder_as_downloaded(tmp_path: Path) -> None:
    fx = load_fixture(LIVEAVATAR)
    (tmp_path / "config.json").write_text(json.dumps(fx.config))
    save_file({k: v.contiguous() for k, v in fx.weights.items()}, str(tmp_path / "model.safetensors"))
    net = load_wav2vec2_folder(tmp_path)
    assert net.cfg.do_stable_layer_norm and net.cfg.hidden_size == 32
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(InputError, match="none of model.safetensors, pytorch_model.bin"):
        load_wav2vec2_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(InputError, match="not a wav2vec2 checkpoint"):
        load_wav2vec2_folder(tmp_path)


def test_bad_weights_or_fixtures_are_one_clear_error(tmp_path: Path) -> None:
    key = "encoder.layers.0.attention.q_proj.weight"
    shapes = rewrite_fixture(FLASHHEAD, tmp_path / "shapes.safetensors", weights={key: torch.zeros(16, 8)})
    with pytest.raises(InputError, match=rf"'{key}' has shape \(16, 8\)"):
        run_parity(shapes)
    missing = rewrite_fixture(LIVEAVATAR, tmp_path / "missing.safetensors",
                       weights={"wav2vec2.encoder.layer_norm.weight": None})
    with pytest.raises(InputError, match="1 missing .*'encoder.layer_norm.weight'"):
        run_parity(missing)
    other = rewrite_fixture(GOLDEN / "wan-vae-a.safetensors", tmp_path / "other.safetensors", family="wav2vec2")
    with pytest.raises(InputError, match="not a wav2vec2 config"):
        run_parity(other)
    fx = load_fixture(FLASHHEAD)
    fx.settings["variant"] = "omni"
    with pytest.raises(InputError, match="variant 'omni' is unknown"):
        wav2vec2.run(fx)
    r = run_cli("models", "parity", str(shapes), "--json")
    assert r.returncode != 0 and "Traceback" not in r.stderr and key in r.stderr


def test_the_fixtures_catch_the_two_quirks() -> None:
    """Each variant's quirk matters far beyond the tolerance: LiveAvatar's last state is the final
    LayerNorm's output (not the raw last layer); FlashHead resamples the CNN features to 25 fps
    before the transformer (not the hidden states after it)."""
    from avatarstream.models.wav2vec2.flashhead import flashhead_states
    from avatarstream.models.wav2vec2.liveavatar import liveavatar_states
    from avatarstream.models.wav2vec2.model import normalize_waveform, resample_frames

    fx = load_fixture(LIVEAVATAR)
    net = load_wav2vec2(fx.weights, fx.config)
    with torch.inference_mode():
        states = liveavatar_states(net, fx.inputs["waveform"])
        raw_last = net.encoder.layers[-1](states[-2:-1])[0]
    want = fx.expected["hidden_states"]
    assert (states[-1] - want[-1]).abs().max() <= FAMILY_TOLERANCE["wav2vec2"]
    assert (raw_last - want[-1]).abs().max() > 1e-1

    fx = load_fixture(FLASHHEAD)
    net = load_wav2vec2(fx.weights, fx.config)
    cfg = FlashHeadAudioConfig(frame_num=fx.settings["frame_num"])
    with torch.inference_mode():
        good = flashhead_states(net, fx.inputs["waveform"], cfg)
        late = resample_frames(net(normalize_waveform(fx.inputs["waveform"])[None])[:, 0], good.shape[1])
    want = fx.expected["hidden_states"]
    assert (good - want).abs().max() <= FAMILY_TOLERANCE["wav2vec2"] and (late - want).abs().max() > 1e-1
