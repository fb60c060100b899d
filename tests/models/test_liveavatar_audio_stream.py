"""LiveAvatar's bounded-window audio (models/wav2vec2/liveavatar_stream.py) against the whole file.

The network is the `wav2vec2-a` fixture's (the official tiny Wav2Vec2ForCTC's weights), the audio
the bundled example speech. Distances measured on it (max abs / relative Frobenius, 10.8 s,
blocks of 12 frames; docs/real-models.md): history 8 s without lookahead 4.2 / 0.30, with one
block (12 frames) 3.9 / 0.26, with 25 frames 3.1 / 0.12; the official whole-file time stretch
(`align_corners` over the file) on its own 4.8 / 0.22, because a random network's features
change 42 % from one 50 Hz frame to the next."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from avatarstream.media.audio import read_all
from avatarstream.models.wav2vec2.liveavatar import liveavatar_states
from avatarstream.models.wav2vec2.liveavatar_stream import LiveAvatarAudioStream, LiveAvatarStreamConfig
from avatarstream.parity.fixture import load_fixture
from avatarstream.weights.wav2vec2 import load_wav2vec2

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_and_wave():
    fx = load_fixture(ROOT / "tests/fixtures/golden/wav2vec2-a.safetensors")
    model = load_wav2vec2(fx.weights, fx.config, dtype=torch.float32)
    wave = torch.as_tensor(read_all(ROOT / "examples/speech.mp3", 16000)).float().flatten()[: 16000 * 6]
    return model, wave


def _blocks(stream: LiveAvatarAudioStream, n: int, block: int = 12) -> torch.Tensor:
    return torch.cat([stream.block(b, min(b + block, n)) for b in range(0, n, block)], -1)


def _whole_at_own_times(model, wave: torch.Tensor, n: int) -> torch.Tensor:
    """The whole file encoded at once, read at each 30-fps frame's own time (no stretch)."""
    st = liveavatar_states(model, wave)  # [L+1, T50, C]
    k = torch.round(torch.arange(n, dtype=torch.float64) * 30 / 25)
    pos = (k * 50 / 30).clamp(0, st.shape[1] - 1)
    i0 = pos.floor().long()
    i1 = (i0 + 1).clamp(max=st.shape[1] - 1)
    w = (pos - i0).float()[None, :, None]
    return (st[:, i0] * (1 - w) + st[:, i1] * w).permute(0, 2, 1)[None]


@torch.inference_mode()
def test_a_window_holding_the_whole_file_is_the_whole_file_encoding(model_and_wave):
    model, wave = model_and_wave
    n = wave.numel() // 640
    s = LiveAvatarAudioStream(model, LiveAvatarStreamConfig(history_seconds=60, lookahead_frames=1000))
    s.push(wave)
    s.end()
    got = _blocks(s, n)
    assert got.shape[-1] == n
    assert float((got - _whole_at_own_times(model, wave, n)).abs().max()) <= 1e-5


@torch.inference_mode()
def test_lookahead_brings_the_window_closer_to_the_whole_file(model_and_wave):
    model, wave = model_and_wave
    n = wave.numel() // 640
    whole = _whole_at_own_times(model, wave, n)
    rel = []
    for look in (0, 25):
        s = LiveAvatarAudioStream(model, LiveAvatarStreamConfig(history_seconds=4, lookahead_frames=look))
        s.push(wave)
        s.end()
        rel.append(float((_blocks(s, n) - whole).norm() / whole.norm()))
    assert rel[1] < rel[0] < 1.0


@torch.inference_mode()
def test_memory_stays_bounded_and_blocks_do_not_depend_on_how_audio_arrives(model_and_wave):
    model, wave = model_and_wave
    cfg = LiveAvatarStreamConfig(history_seconds=1.0, lookahead_frames=12)
    one, many = LiveAvatarAudioStream(model, cfg), LiveAvatarAudioStream(model, cfg)
    one.push(wave)
    sizes, outs = [], []
    for b in range(0, 120, 12):
        hi = min(wave.numel(), (b + 24) * 640)  # just enough for the block and its lookahead
        many.push(wave[many._first + many._buf.numel() : hi])
        outs.append(many.block(b, b + 12))
        sizes.append(many.nbytes())
    assert max(sizes) <= (16000 + 24 * 640) * 4
    assert torch.equal(torch.cat(outs, -1), _blocks(one, 120))
