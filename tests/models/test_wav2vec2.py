"""Our wav2vec2 port (models/wav2vec2): shapes of both forms, the per-variant audio paths, the
bounded FlashHead window, and equivalence with `transformers` (when it is importable; the golden
fixtures in tests/parity/test_wav2vec2.py check the same against transformers' stored outputs)."""

from __future__ import annotations

import re

import pytest
import torch

from avatarstream.errors import ConfigError
from avatarstream.models.wav2vec2 import (FlashHeadAudioConfig, FlashHeadAudioStream, Wav2Vec2,
                                          Wav2Vec2Config, flashhead_audio_context, normalize_waveform)
from avatarstream.models.wav2vec2.liveavatar import LiveAvatarAudioConfig, bucket_indices, bucket_to_video

pytestmark = pytest.mark.usefixtures("one_thread")


def random_model(cfg: Wav2Vec2Config, seed: int = 0) -> Wav2Vec2:
    """Every parameter random (norm gains 1 + 0.2·N, matrices N/√fan-in, vectors 0.2·N), so no
    zero-initialised path hides a bug."""
    g = torch.Generator().manual_seed(seed)
    net = Wav2Vec2(cfg).eval()
    with torch.no_grad():
        for name, p in net.named_parameters():
            n = torch.randn(p.shape, generator=g)
            gain = name.endswith("weight_g") or ("norm" in name and name.endswith("weight"))
            p.copy_(1 + 0.2 * n if gain else n / p[0].numel() ** 0.5 if p.dim() > 1 else 0.2 * n)
    return net


@pytest.mark.parametrize("stable", [False, True], ids=["base", "large"])
def test_hidden_states_shape_and_norm_placement(stable: bool) -> None:
    cfg = Wav2Vec2Config.tiny(stable=stable)
    net = random_model(cfg)
    wave = torch.randn(2, 4000)
    states = net(wave)
    assert states.shape == (cfg.num_hidden_layers + 1, 2, cfg.frames(4000), cfg.hidden_size)
    assert cfg.frames(4000) == 12 and cfg.frames(399) == 0  # 320x down, a 400-sample field
    ln = net.encoder.layer_norm
    if stable:  # the last state is the final LayerNorm of the last layer's output
        raw = net.encoder.layers[-1](states[-2])
        assert torch.allclose(states[-1], ln(raw), atol=1e-6) and not torch.allclose(states[-1], raw)
    else:  # post-LN: state 0 is already normalised, the last state is the raw last layer
        assert torch.allclose(states[-1], net.encoder.layers[-1](states[-2]), atol=1e-6)
        feats = net.feature_projection(net.conv_features(wave))
        assert torch.allclose(states[0], ln(feats + net.encoder.pos_conv_embed(feats)), atol=1e-6)


def test_config_from_hf_dict() -> None:
    raw = {"model_type": "wav2vec2", "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
           "intermediate_size": 4096, "conv_bias": True, "feat_extract_norm": "layer",
           "do_stable_layer_norm": True, "conv_dim": [512] * 7, "vocab_size": 33, "hidden_act": "gelu",
           "num_feat_extract_layers": 7}
    assert Wav2Vec2Config.from_hf(raw) == Wav2Vec2Config.large()
    assert Wav2Vec2Config.from_hf({}) == Wav2Vec2Config.base()
    with pytest.raises(ConfigError, match="hidden_act='relu'"):
        Wav2Vec2Config.from_hf({**raw, "hidden_act": "relu"})
    with pytest.raises(ConfigError, match="7 conv layers but conv_dim/kernel/stride have 6/7/7"):
        Wav2Vec2Config.from_hf({**raw, "conv_dim": [512] * 6})


def test_full_size_parameter_counts_on_meta() -> None:
    """Ours + the skipped CTC head and mask vector = the checkpoints' counts (transformers' `Wav2Vec2ForCTC` at the released configs:
    large 424 tensors / 315,472,545 params; base-960h 213 / 94,396,320, vocab 32)."""
    for cfg, vocab, tensors, params in [(Wav2Vec2Config.large(), 33, 424, 315_472_545),
                                        (Wav2Vec2Config.base(), 32, 213, 94_396_320)]:
        with torch.device("meta"):
            sd = Wav2Vec2(cfg).state_dict()
        skipped = vocab * cfg.hidden_size + vocab + cfg.hidden_size  # lm_head.{weight,bias}, masked_spec_embed
        assert len(sd) + 3 == tensors and sum(t.numel() for t in sd.values()) + skipped == params


def test_normalisation_is_per_clip() -> None:
    x = torch.randn(3, 1000) * 5 + 2
    y = normalize_waveform(x)
    assert torch.allclose(y.mean(-1), torch.zeros(3), atol=1e-5)
    assert torch.allclose(y.var(-1, unbiased=False), torch.ones(3), atol=1e-4)


def test_liveavatar_bucketing() -> None:
    """Video frame j takes 30-fps frame round(1.2 j); past the end: zeros; count a multiple of 48."""
    cfg = LiveAvatarAudioConfig()
    idx, n = bucket_indices(44, cfg)
    assert n == 48 and idx[:6].tolist() == [0, 1, 2, 4, 5, 6] and idx[40] == 48
    feats = torch.randn(4, 44, 8)
    out = bucket_to_video(feats, cfg)  # [1, L+1, C, frames]
    assert out.shape == (1, 4, 8, 48)
    assert torch.equal(out[0, :, :, 3], feats[:, 4]) and not out[0, :, :, idx >= 44].any()
    assert bucket_indices(70, cfg)[1] == 96  # 70 frames at 30 fps need more than one 48-frame clip


def test_flashhead_stream_is_the_trailing_window() -> None:
    """The stream's context is the official computation on the last window_samples samples (zeros
    before the start); audio older than the window has no effect: the context is bounded."""
    cfg = FlashHeadAudioConfig(window_seconds=1, frame_num=9)
    net = random_model(Wav2Vec2Config.tiny())
    stream = FlashHeadAudioStream(net, cfg)
    speech = torch.randn(28_000)
    stream.push(speech[:6_000])
    first = stream.context()
    want = flashhead_audio_context(net, torch.cat([torch.zeros(10_000), speech[:6_000]]), cfg, 16, 25)
    assert first.shape == (1, 9, 5, 2, 16) and torch.equal(first, want)
    for piece in speech[6_000:].split(7_000):
        stream.push(piece)
    fresh = FlashHeadAudioStream(net, cfg)
    fresh.push(speech[-16_000:])
    assert torch.equal(stream.context(), fresh.context())
    # the newest frames' windows are clamped at the window's end (no future audio)
    assert torch.equal(first[0, -1, 2], first[0, -1, 4]) and torch.equal(first[0, -2, 3], first[0, -2, 4])
    stream.reset()
    assert not stream.window.any()


# ---- equivalence with transformers (skipped where it is not installed) ----

def _hf(cfg: Wav2Vec2Config):  # noqa: ANN202
    tf = pytest.importorskip("transformers")
    hc = tf.Wav2Vec2Config(**{k: list(v) if isinstance(v, tuple) else v for k, v in vars(cfg).items()},
                           num_feat_extract_layers=len(cfg.conv_dim), attn_implementation="sdpa")
    return tf, hc


@pytest.mark.parametrize("stable", [False, True], ids=["base", "large"])
def test_equals_transformers(stable: bool) -> None:
    """Our port loaded from a transformers model's own state dict (today's parametrization keys,
    `wav2vec2.` prefix, CTC head skipped) gives its hidden states: 0.0 on torch 2.13 CPU."""
    from avatarstream.weights.wav2vec2 import load_wav2vec2

    cfg = Wav2Vec2Config.tiny(stable=stable)
    tf, hc = _hf(cfg)
    ours = random_model(cfg, seed=3)
    theirs = tf.Wav2Vec2ForCTC(hc).eval()
    sd = theirs.state_dict()
    loaded = load_wav2vec2({k: v for k, v in sd.items()}, cfg)  # keys as transformers names them
    wave = normalize_waveform(torch.randn(1, 8000))

    def hidden_states() -> torch.Tensor:
        """transformers' states, the last one taken as the encoder's output: 4.x returns the final
        LayerNorm's output as the last state of the pre-LN form (LiveAvatar's, which we keep),
        5.x the raw last layer's; `last_hidden_state` is the normalised one in both."""
        out = theirs.wav2vec2(wave, output_hidden_states=True)
        return torch.stack([*out.hidden_states[:-1], out.last_hidden_state])

    with torch.no_grad():
        want = hidden_states()
        assert (loaded(wave) - want).abs().max() < 1e-5
        # and ours -> theirs, through the checkpoint's weight_g / weight_v names
        mine = {("wav2vec2." + k): v for k, v in ours.state_dict().items()}
        pos = "wav2vec2.encoder.pos_conv_embed.conv."
        sd = {k.replace(pos + "weight_g", pos + "parametrizations.weight.original0")
              .replace(pos + "weight_v", pos + "parametrizations.weight.original1"): v for k, v in mine.items()}
        theirs.load_state_dict({**theirs.state_dict(), **sd})
        assert (ours(wave) - hidden_states()).abs().max() < 1e-5


@pytest.mark.parametrize("cfg", [Wav2Vec2Config.base(), Wav2Vec2Config.large()], ids=["base", "large"])
def test_full_size_keys_match_transformers(cfg: Wav2Vec2Config) -> None:
    """Key for key on the meta device: a transformers checkpoint maps onto exactly our keys."""
    from avatarstream.weights.wav2vec2 import ADAPTER, UNUSED

    tf, hc = _hf(cfg)
    with torch.device("meta"):
        theirs = tf.Wav2Vec2ForCTC(hc).state_dict()
        ours = Wav2Vec2(cfg).state_dict()
    mapped = ADAPTER.state_dict("wav2vec2", theirs)
    kept = {k: tuple(v.shape) for k, v in mapped.items() if not any(re.fullmatch(u, k) for u in UNUSED)}
    assert kept == {k: tuple(v.shape) for k, v in ours.items()}
