"""The invisible watermark (provenance/watermark.py): it survives what a video goes through, it is
not found where it was not put, it cannot be seen, and every generated frame carries it.

Tolerances written down: detection at P_THRESHOLD (1e-6) after each attack on a 1 s clip of our
synthetic domain, with at least 15 of the 16 bits right (`bench watermark`: 0.99-1.0 on average);
PSNR ≥ 40 dB and SSIM ≥ 0.97 of marked against unmarked frames (this clip: 43.5 dB, 0.98).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from avatarstream.bench.watermark import ATTACKS, h264
from avatarstream.data.clip import render_reference
from avatarstream.engine.publisher import Publisher
from avatarstream.errors import InputError
from avatarstream.eval.metrics import psnr_ssim
from avatarstream.provenance import watermark as wm
from engine.mock_models import ListSink

FPS = 25


@pytest.fixture(scope="module")
def clip() -> np.ndarray:
    """1 s of a person of our synthetic domain at the bundled model's size: [25, 256, 256, 3]."""
    return render_reference(identity=7, scene=3, size=256, frames=FPS, seed=1)


@pytest.fixture(scope="module")
def marked(clip: np.ndarray) -> np.ndarray:
    return wm.embed(clip)


def test_the_pattern_is_pinned():
    """Every detector must find the marks already published: the payload and the pattern (seeded
    numpy PCG64 normals, orthonormalised) are golden numbers; a change here is a new VERSION."""
    assert wm.PAYLOAD_BITS == 16 and wm.payload().tolist() == [1, 0, 1, 0, 0, 0, 0, 1, 0, 1, 0, 1, 0, 0, 0, 1]
    np.testing.assert_allclose(wm.mark()[0, :4], [-1.13676691, 0.10543402, 0.88448169, 0.9385326], atol=1e-6)
    p = wm.bit_patterns().reshape(wm.PAYLOAD_BITS, -1)
    np.testing.assert_allclose(p @ p.T / p.shape[1], np.eye(wm.PAYLOAD_BITS), atol=1e-9)  # orthonormal
    spec = np.abs(np.fft.fft2(wm.mark()))
    f = np.hypot(*np.meshgrid(np.fft.fftfreq(wm.TILE) * wm.TILE, np.fft.fftfreq(wm.TILE) * wm.TILE))
    assert spec[(f < wm.BAND[0]) | (f > wm.BAND[1])].max() < 1e-9  # only in the band,
    assert spec[0].max() < 1e-9 and spec[:, 0].max() < 1e-9 and spec[::4, ::4].max() < 1e-9  # off the grids


def test_embed_keeps_the_frames_format_and_is_deterministic(clip, marked):
    assert marked.shape == clip.shape and marked.dtype == np.uint8
    assert not np.array_equal(marked, clip)
    np.testing.assert_array_equal(wm.embed(clip[5:9], start_frame=5), marked[5:9])  # per frame
    assert np.abs(marked.astype(int) - clip).max() <= np.ceil(wm.A_MAX * np.abs(wm.mark()).max()) + 1
    with pytest.raises(ValueError):
        wm.embed(clip[..., :1])


def test_roundtrip(marked):
    r = wm.detect(marked)
    assert r.detected and r.bit_accuracy == 1.0 and r.p_value < 1e-12 and r.frames == FPS
    assert set(r.to_json()) == {"detected", "bit_accuracy", "score", "p_value", "frames"}
    json.dumps(r.to_json())


@pytest.mark.parametrize("attack", ["h264_300kbps", "crop_10pct", "downscale_2x", "screen_blur",
                                    "combo_crop_down_300k"])
def test_survives(marked, attack):
    r = wm.detect(ATTACKS[attack](marked))
    assert r.detected and r.bit_accuracy >= 15 / 16, r


def test_unmarked_renders_are_not_detected():
    """10 ground-truth renders (other people, scenes), as they are and after H.264 at 300 kbit/s:
    none detected, and no p-value small enough to be suspicious (the p-value is conservative)."""
    results = []
    for i in range(10):
        frames = render_reference(identity=300 + i, scene=400 + i, size=256, frames=10, seed=i)
        results += [wm.detect(frames), wm.detect(h264(frames, 300_000))]
    assert not any(r.detected for r in results)
    assert min(r.p_value for r in results) > 1e-3, [r.p_value for r in results]


def test_invisible(clip, marked):
    psnr, ssim = psnr_ssim(marked, clip)
    assert psnr.min() >= 40.0 and ssim.min() >= 0.97, (psnr.min(), ssim.min())


def test_publisher_marks_every_frame_it_writes(clip):
    """The file pipeline's choke point: the sinks get exactly `embed` of what was put (on or off)."""
    for on in (True, False):
        sink = ListSink()
        pub = Publisher([sink], watermark=on)
        pub.put_video(clip[:10], 0, FPS)
        pub.put_video(clip[10:], 10, FPS)
        pub.drain()
        got = np.concatenate([c.frames for c in sink.video])
        np.testing.assert_array_equal(got, wm.embed(clip) if on else clip)


def test_live_session_marks_what_every_sink_gets(clip):
    """A live session's frames reach its sinks (WebRTC playout, HLS, frames()) without a Publisher:
    the session marks them once, unless the model's config says not to."""
    import torch

    from avatarstream.live.session import LiveSession
    from avatarstream.registry import load_model

    base = load_model("tiny-random")
    h, w = base.config.out_hw
    ref = torch.from_numpy(clip[:1, :h, :w]).permute(0, 3, 1, 2).contiguous()
    frames = clip[:4, :h, :w]
    for on in (True, False):
        models = dataclasses.replace(base, config=dataclasses.replace(base.config, watermark=on))
        sink = ListSink()
        session = LiveSession(models, ref, sinks=[sink])
        session.put_video(frames, 0, FPS)
        np.testing.assert_array_equal(sink.video[0].frames, wm.embed(frames) if on else frames)


def test_detect_video_of_a_file_that_is_no_video_is_one_clear_error(tmp_path):
    bad = tmp_path / "notes.mp4"
    bad.write_text("not a video")
    with pytest.raises(InputError, match="cannot read the video"):
        wm.detect_video(str(bad))
    with pytest.raises(InputError, match="no such file|cannot read"):
        wm.detect_video(str(tmp_path / "missing.mp4"))


@pytest.mark.slow
def test_generate_output_is_marked_and_no_watermark_is_not(generated, generated_unmarked_user_signed):
    """`generate` with the bundled model: the file is detected as marked (a real H.264 file through
    the file sink); `--no-watermark` makes one that is not (the session's shared runs, 1 s each)."""
    results = {}
    for flag, (out, r) in ((False, generated), (True, generated_unmarked_user_signed)):
        assert r.returncode == 0, r.stderr
        results[flag] = wm.detect_video(str(out))
    assert results[False].detected and results[False].bit_accuracy == 1.0, results[False]
    assert not results[True].detected and results[True].p_value > 1e-3, results[True]


def _ref_resample(x: np.ndarray, n_out: int, axis: int) -> np.ndarray:
    """The plain gather-and-sum bilinear resampling over `_taps` (what `_resample` speeds up)."""
    idx, wts = wm._taps(x.shape[axis], n_out)
    return np.moveaxis((np.moveaxis(x, axis, -1)[..., idx] * wts).sum(-1), -1, axis)


def _ref_embed(frames: np.ndarray) -> np.ndarray:
    """`embed` written plainly: float32 luma, 8×8 block mean/std by numpy means, gather resampling."""
    f = frames.astype(np.float32)
    y = wm.LUMA[0] * f[..., 0] + wm.LUMA[1] * f[..., 1] + wm.LUMA[2] * f[..., 2]
    n, h, w = y.shape
    b = wm.BLOCK
    y = np.pad(y, ((0, 0), (0, -h % b), (0, -w % b)), mode="edge").reshape(n, -(-h // b), b, -(-w // b), b)
    mean = y.mean(axis=(2, 4))
    std = np.sqrt(np.maximum((y * y).mean(axis=(2, 4)) - mean * mean, 0.0))
    amp = np.clip(wm.A_MIN + wm.A_GAIN * std, wm.A_MIN, wm.A_MAX)
    delta = _ref_resample(_ref_resample(amp, h, 1), w, 2) * wm._tiled(h, w)
    return np.clip(frames.astype(np.int16) + np.rint(delta).astype(np.int16)[..., None], 0, 255).astype(np.uint8)


def test_fast_embed_equals_the_plain_computation():
    """At most 0.1 % of the pixels one grey level apart (float rounding of the block statistics
    and of the tap sums moves a few rint() ties), on real pictures and sizes off the 8 px grid."""
    from PIL import Image

    img = Image.open(Path(__file__).parents[2] / "examples" / "reference.png").convert("RGB")
    ref = np.asarray(img.resize((256, 256)))
    frames = [np.stack([np.roll(ref, (s, 3 * s), axis=(0, 1)) for s in range(4)]),
              np.asarray(img.resize((250, 190)))[None]]
    for x in frames:
        d = np.abs(wm.embed(x).astype(int) - _ref_embed(x))
        assert d.max() <= 1 and (d > 0).mean() <= 1e-3, (d.max(), (d > 0).mean())
    g = np.random.default_rng(0).standard_normal((2, 37, 23)).astype(np.float32)
    for n_out, axis in ((90, 1), (9, 1), (61, 2), (5, 2)):  # up- and downscales on both axes
        np.testing.assert_allclose(wm._resample(g, n_out, axis), _ref_resample(g, n_out, axis), atol=1e-5, rtol=1e-5)
