"""Audio front end and encoder: log-mel vs a numpy/scipy reference, streaming == offline,
receptive field / look-ahead, bounded memory, per-latent grouping == the engine's."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.signal
import torch

from avatarstream.models.audio import (AudioConfig, AudioEncoder, StreamingAudioFeatures,
                                       group_per_latent, latent_frame_range, log_mel)

SPF = 640


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def speech(seconds: float, seed: int = 0) -> torch.Tensor:
    """[N] speech-like test signal: harmonics with a wobbling pitch, amplitude bursts, noise."""
    g = np.random.default_rng(seed)
    n = int(seconds * 16000)
    t = np.arange(n) / 16000
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / 16000
    x = sum(np.sin(k * phase) / k for k in range(1, 8))
    env = 0.5 + 0.5 * np.sin(2 * np.pi * 3.1 * t) ** 2
    x = 0.2 * env * x + 0.02 * g.standard_normal(n)
    return torch.from_numpy(x.astype(np.float32))


@pytest.fixture(scope="module")
def enc() -> AudioEncoder:
    e = AudioEncoder(AudioConfig.tiny())
    e.init_random_(0)
    return e.eval().requires_grad_(False)


# -- log-mel ------------------------------------------------------------------------------------
def ref_log_mel(x: np.ndarray, n_mels: int, pad: bool) -> np.ndarray:
    """Independent numpy/scipy log-mel: [N] float64 -> [n_mels, M]."""
    n_fft, hop, sr = 400, 160, 16000
    if pad:
        m = -(-len(x) // hop)
        x = np.concatenate([np.zeros(120), x, np.zeros(hop * (m - 1) + n_fft - 120 - len(x))])
    m = 1 + (len(x) - n_fft) // hop
    win = scipy.signal.get_window("hann", n_fft, fftbins=True)  # periodic Hann
    frames = np.stack([x[i * hop: i * hop + n_fft] * win for i in range(m)])  # [M, n_fft]
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2  # [M, 201]
    # HTK mel filterbank, filter by filter
    mel = lambda f: 2595 * np.log10(1 + f / 700)  # noqa: E731
    imel = lambda q: 700 * (10 ** (q / 2595) - 1)  # noqa: E731
    edges = imel(np.linspace(mel(0.0), mel(8000.0), n_mels + 2))
    freqs = np.arange(n_fft // 2 + 1) * sr / n_fft
    fb = np.zeros((n_mels, len(freqs)))
    for i in range(n_mels):
        lo, c, hi = edges[i], edges[i + 1], edges[i + 2]
        for j, f in enumerate(freqs):
            if lo < f <= c:
                fb[i, j] = (f - lo) / (c - lo)
            elif c < f < hi:
                fb[i, j] = (hi - f) / (hi - c)
    return np.log(np.maximum(fb @ power.T, 1e-5))


@pytest.mark.parametrize("n_mels,pad,n", [(40, True, 8000), (80, True, 5123), (80, False, 4000)])
def test_log_mel_matches_numpy_reference(n_mels, pad, n):
    x = speech(n / 16000, seed=1)[:n]
    ours = log_mel(x[None], n_mels, pad=pad)[0].numpy()
    ref = ref_log_mel(x.double().numpy(), n_mels, pad)
    assert ours.shape == ref.shape
    if pad:
        assert ours.shape[1] == -(-n // 160)
    np.testing.assert_allclose(ours, ref, atol=2e-3, rtol=0)


def test_log_mel_tone_and_silence():
    t = torch.arange(16000) / 16000
    lm = log_mel(torch.sin(2 * np.pi * 1000 * t)[None], 80)[0]  # [80, 100]
    band = int(lm[:, 50].argmax())
    centre_mel = np.linspace(0, 2595 * np.log10(1 + 8000 / 700), 82)[band + 1]
    centre_hz = 700 * (10 ** (centre_mel / 2595) - 1)
    assert abs(centre_hz - 1000) < 60
    silent = log_mel(torch.zeros(1, 1600), 40)
    torch.testing.assert_close(silent, torch.full_like(silent, float(np.log(1e-5))))


# -- encoder -------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg,dim", [(AudioConfig.tiny(), 16), (AudioConfig.small(), 128)])
def test_encoder_shapes(cfg, dim):
    e = AudioEncoder(cfg)
    e.init_random_(1)
    assert e.left_frames == 4 and e.right_frames == 1
    assert (e.left_samples, e.right_samples) == (2200, 280) and e.lookahead_ms == 17.5
    with torch.inference_mode():
        for n in (1, 639, 640, 641, 8000):
            y = e(torch.randn(2, n) * 0.1)
            assert y.shape == (2, -(-n // SPF), dim) and bool(torch.isfinite(y).all())


def test_init_random_is_deterministic():
    a, b = AudioEncoder(AudioConfig.tiny()), AudioEncoder(AudioConfig.tiny())
    a.init_random_(5)
    b.init_random_(5)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), n


def test_negative_and_past_end_frames_equal_zero_padded_offline(enc):
    wave = speech(1.0)
    n = wave.numel()  # 16000 = 25 frames
    padded = torch.cat([torch.zeros(8 * SPF), wave, torch.zeros(6 * SPF)])
    full = enc(padded[None])  # frames -8 .. 30
    torch.testing.assert_close(enc.frames(wave[None], -8, 31), full, atol=1e-5, rtol=0)
    # frames far from the audio are the silence feature, all identical
    silence = enc(torch.zeros(1, 3 * SPF))[0, 1]
    far = enc.frames(wave[None], -40, -30)[0]
    torch.testing.assert_close(far, silence.expand_as(far), atol=1e-6, rtol=0)
    st = StreamingAudioFeatures(enc)
    st.push(wave)
    st.end()
    assert st.total_frames == n // SPF
    torch.testing.assert_close(st.features(-8, 31), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_streaming_equals_offline_random_pushes(enc, seed):
    g = np.random.default_rng(seed)
    wave = speech(2.3, seed)  # not a whole number of frames
    first = -5
    st = StreamingAudioFeatures(enc)
    got, nxt, pos = [], first, 0
    while pos < wave.numel():
        k = int(g.integers(1, 2500))
        st.push(wave[pos: pos + k])
        pos += k
        avail = st.available_frames()
        if avail > nxt and g.random() < 0.7:
            with torch.inference_mode():  # as the engine calls it (Module.run)
                got.append(st.features(nxt, avail))
            nxt = avail
    st.end()
    stop = st.available_frames() + 3  # beyond the end: silence padding
    assert st.available_frames() == -(-wave.numel() // SPF)
    got.append(st.features(nxt, stop))
    stream = torch.cat(got, 1)
    offline = enc.frames(wave[None], first, stop)
    assert stream.shape == offline.shape == (1, stop - first, 16)
    assert float((stream - offline).abs().max()) <= 1e-5
    # offline forward() is the [0, ceil(N/640)) slice of the same thing
    torch.testing.assert_close(enc(wave[None]), offline[:, -first: -3], atol=1e-5, rtol=0)


def test_streaming_small_config():
    e = AudioEncoder(AudioConfig.small())
    e.init_random_(2)
    wave = speech(0.9, 3)
    st = StreamingAudioFeatures(e)
    out = []
    for a in range(0, wave.numel(), 3000):
        st.push(wave[a: a + 3000])
        if st.available_frames() > 2 and not out:
            out.append(st.features(-2, st.available_frames()))
    st.end()
    done = -2 + sum(o.shape[1] for o in out)
    out.append(st.features(done, 24))
    with torch.no_grad():
        torch.testing.assert_close(torch.cat(out, 1), e.frames(wave[None], -2, 24), atol=1e-5,
                                   rtol=0)


def test_available_frames_never_claims_unfinished_frames(enc):
    """Frames counted as available are identical whatever audio comes next; the next frame is
    not (so the count is also as large as possible)."""
    wave = speech(1.2, 4)
    g = torch.Generator().manual_seed(0)
    st = StreamingAudioFeatures(enc)
    for p in (100, 279, 280, 919, 920, 921, 1500, 4000, 7321, 12000):
        st.push(wave[st.pushed: p])
        n = st.available_frames()
        assert n == max(0, (p - 280) // SPF)
        fut_a = torch.cat([wave[:p], torch.zeros(3000)])
        fut_b = torch.cat([wave[:p], 0.3 * torch.randn(3000, generator=g)])
        fa = enc.frames(fut_a[None], -5, n + 1)
        fb = enc.frames(fut_b[None], -5, n + 1)
        # frames before n are final (frame -1 only once `right_samples` samples are in)
        final = n + 5 if p >= enc.right_samples else 4
        assert torch.equal(fa[:, :final], fb[:, :final])
        assert not torch.equal(fa[:, final], fb[:, final])  # the next frame is not final
        with pytest.raises(RuntimeError):
            StreamingAudioFeatures(enc).features(0, 1)  # nothing pushed: not final
    st.end()
    assert st.available_frames() == -(-st.pushed // SPF)


def test_declared_receptive_field_matches_empirical(enc):
    wave = speech(1.0, 5)
    f = 12
    base = enc.frames(wave[None], f, f + 1)

    def changes(lo: int, hi: int) -> bool:
        w = wave.clone()
        w[lo:hi] += 0.5
        return not torch.equal(enc.frames(w[None], f, f + 1), base)  # bit-exact outside

    frames_changed = [k for k in range(-8, 5) if changes(SPF * (f + k), SPF * (f + k + 1))]
    assert frames_changed == list(range(-enc.left_frames, enc.right_frames + 1))
    end = SPF * (f + 1)
    # look-ahead to the sample: the last sample it reads changes it, the next one does not
    assert changes(end + enc.right_samples - 1, end + enc.right_samples)
    assert not changes(end + enc.right_samples, end + enc.right_samples + 2000)
    # history: the window's first sample has Hann weight 0, so test one sample in
    start = SPF * f - enc.left_samples
    assert changes(start + 1, start + 2)
    assert not changes(start - 2000, start + 1)


def test_memory_bounded(enc):
    """The rolling buffer does not grow with the stream (engine-like: read as you push)."""
    st = StreamingAudioFeatures(enc)
    wave = speech(1.0, 6)
    nxt, sizes = -5, {}
    for i in range(600):  # 60 s in 100 ms pushes
        st.push(wave[(i % 10) * 1600: (i % 10 + 1) * 1600])
        avail = st.available_frames()
        if avail > nxt:
            st.features(nxt, avail)
            nxt = avail
        if st.pushed in (5 * 16000, 60 * 16000):
            sizes[st.pushed] = st.buffer_samples
        assert st.buffer_samples <= enc.left_samples + enc.right_samples + 1600 + SPF
    assert sizes[5 * 16000] == sizes[60 * 16000]


def test_streaming_contract_errors(enc):
    st = StreamingAudioFeatures(enc)
    st.push(speech(0.5))
    st.features(-5, 5)
    with pytest.raises(ValueError):
        st.features(2, 6)  # goes back
    st.end()
    with pytest.raises(RuntimeError):
        st.push(torch.zeros(10))
    assert st.features(5, 30).shape == (1, 25, 16)


# -- grouping per latent ---------------------------------------------------------------------------
def test_group_per_latent_layout():
    f, d = 30, 3
    feats = torch.arange(f, dtype=torch.float32)[None, :, None].expand(2, f, d) + 1  # value = frame + 1
    out = group_per_latent(feats, [0, 1, 2, 7], window=1)
    assert out.shape == (2, 4, 6, d)
    assert out[0, 0, :, 0].tolist() == [0, 0, 0, 0, 1, 2]  # frames -4..1: -4..-1 padded
    assert out[0, 1, :, 0].tolist() == [1, 2, 3, 4, 5, 6]  # frames 0..5 (latent 1 = frames 1..4)
    assert out[0, 2, :, 0].tolist() == [5, 6, 7, 8, 9, 10]
    assert out[0, 3, :, 0].tolist() == [25, 26, 27, 28, 29, 30]
    assert latent_frame_range(0, 0) == (-3, 1) and latent_frame_range(3, 0) == (9, 13)
    assert group_per_latent(feats, [1], window=0).shape == (2, 1, 4, d)
    shifted = group_per_latent(feats[:, 5:], [3, 4], window=2, first_frame=5)  # frames 7..18
    torch.testing.assert_close(shifted, group_per_latent(feats, [3, 4], window=2))


def test_group_per_latent_matches_engine_audio_context(enc):
    from avatarstream.engine.audio_context import AudioContext
    from avatarstream.engine.clock import MediaClock
    from avatarstream.engine.module import Module

    wave = speech(1.5, 7)
    w = 1
    chunks = iter(wave.split(1000))
    mod = Module("audio", enc)
    ctx = AudioContext(chunks, mod, StreamingAudioFeatures(mod.model), MediaClock(), window=w,
                       keep_frames=10_000)
    total_lat = MediaClock().latents_for_frames(MediaClock().frames_for_samples(wave.numel()))
    positions = list(range(total_lat))
    got = []
    for a in range(0, total_lat, 4):
        pos = tuple(positions[a: a + 4])
        ctx.ensure_positions(pos[-1] + 1)
        got.append(ctx.tokens(pos))
    got = torch.cat(got, 1)  # [1, T, 6, 16]
    first, last = -(4 + w), 4 * (total_lat - 1) + 1 + w
    feats = enc.frames(wave[None], first, last)
    want = group_per_latent(feats, positions, window=w, first_frame=first)
    assert got.shape == want.shape == (1, total_lat, 4 + 2 * w, 16)
    assert float((got - want).abs().max()) <= 1e-5
