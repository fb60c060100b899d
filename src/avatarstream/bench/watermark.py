"""`avatarstream bench watermark`: how well the invisible watermark survives what happens to a video.

Clips of our synthetic domain (data/: a person of a held seed range in a scene, idle motion, the
output size of the default model) are marked (`provenance.watermark.embed`), put through each
attack, and detected as a video (`detect`: frames pooled) and as its first frame alone:

- `h264_1mbps`, `h264_300kbps`: libx264 re-encode at that bit rate (25 fps, yuv420p);
- `downscale_2x`: half the width and height (bilinear, antialiased);
- `crop_10pct`: 10 % of the width and of the height cut off (5 % a side: an offset that is no
  multiple of the pattern's tile);
- `screen_blur`: what a screen capture of a player does: resampled to 75 % and back, then a
  Gaussian blur of σ = 1 px;
- `combo_crop_down_300k`, `combo_blur_300k`: the attacks above in a row.

Per attack: `bit_accuracy` (mean over clips of the fraction of the 16 payload bits read right),
`detection_rate` (clips with p < P_THRESHOLD), `detection_rate_1_frame`, `median_score`,
`max_p_value`. False positives: `negatives` unmarked renders (other seeds) and the same after
H.264 at 300 kbit/s, with the rate of p below 0.05 and 0.01 (the p-value is conservative: these
should be at most 0.05 and 0.01) and the largest score. Invisibility: PSNR and SSIM of marked
against unmarked frames. Cost: `embed_ms_per_frame` (marking a chunk of frames, per frame).
"""

from __future__ import annotations

import argparse
import io
import time

import numpy as np
import torch
import torch.nn.functional as F

from avatarstream.errors import ConfigError
from avatarstream.provenance import watermark as wm

HELP = "invisible watermark: bit accuracy and detection after H.264, downscale, crop, blur; false positives"
FPS = 25


# -- attacks -------------------------------------------------------------------------------------
def _even(frames: np.ndarray) -> np.ndarray:
    return frames[:, : frames.shape[1] // 2 * 2, : frames.shape[2] // 2 * 2]


def h264(frames: np.ndarray, bit_rate: int) -> np.ndarray:
    """Encode [N, H, W, 3] uint8 with libx264 at `bit_rate` bit/s into an MP4 in memory, decode back."""
    import av

    frames = _even(frames)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        s = out.add_stream("libx264", rate=FPS)
        s.width, s.height, s.pix_fmt, s.bit_rate = frames.shape[2], frames.shape[1], "yuv420p", bit_rate
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    buf.seek(0)
    with av.open(buf) as inp:
        return np.stack([f.to_ndarray(format="rgb24") for f in inp.decode(video=0)])


def _to_t(frames: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()  # [N, 3, H, W]


def _to_np(x: torch.Tensor) -> np.ndarray:
    return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def resize(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    x = _to_t(frames)
    shrink = height < x.shape[-2]
    return _to_np(F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False, antialias=shrink))


def downscale(frames: np.ndarray, factor: int = 2) -> np.ndarray:
    return resize(frames, frames.shape[1] // factor, frames.shape[2] // factor)


def crop(frames: np.ndarray, fraction: float = 0.10) -> np.ndarray:
    """Cut `fraction` of the height and of the width off (half each side)."""
    h, w = frames.shape[1:3]
    dy, dx = round(h * fraction / 2), round(w * fraction / 2)
    return np.ascontiguousarray(frames[:, dy:h - dy, dx:w - dx])


def gaussian_blur(frames: np.ndarray, sigma: float) -> np.ndarray:
    r = max(1, int(3 * sigma))
    k = torch.exp(-torch.arange(-r, r + 1).float() ** 2 / (2 * sigma ** 2))
    k = k / k.sum()
    x = F.pad(_to_t(frames), (r, r, r, r), mode="replicate")
    x = F.conv2d(x, k.view(1, 1, 1, -1).repeat(3, 1, 1, 1), groups=3)
    return _to_np(F.conv2d(x, k.view(1, 1, -1, 1).repeat(3, 1, 1, 1), groups=3))


def screen_blur(frames: np.ndarray) -> np.ndarray:
    h, w = frames.shape[1:3]
    return gaussian_blur(resize(resize(frames, round(h * 0.75), round(w * 0.75)), h, w), 1.0)


ATTACKS = {
    "none": lambda x: x,
    "h264_1mbps": lambda x: h264(x, 1_000_000),
    "h264_300kbps": lambda x: h264(x, 300_000),
    "downscale_2x": downscale,
    "crop_10pct": crop,
    "screen_blur": screen_blur,
    "combo_crop_down_300k": lambda x: h264(downscale(crop(x)), 300_000),
    "combo_blur_300k": lambda x: h264(screen_blur(x), 300_000),
}


# -- the benchmark -------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clips", type=int, default=8, help="marked clips (default 8)")
    p.add_argument("--frames", type=int, default=50, help="frames per clip (default 50: 2 s)")
    p.add_argument("--negatives", type=int, default=200, help="unmarked ground-truth renders (default 200)")
    p.add_argument("--negative-frames", type=int, default=10, help="frames per unmarked render (default 10)")
    p.add_argument("--size", type=int, default=None, help="frame side in pixels (default: the default model's)")


def _clip(i: int, size: int, frames: int) -> np.ndarray:
    """A clip of the synthetic domain: person and scene from the seed (idle motion)."""
    from avatarstream.data.clip import render_reference

    return render_reference(identity=1000 + i, scene=2000 + i, size=size, frames=frames, seed=i)


def _default_size() -> int:
    from avatarstream.registry import model_spec_for, resolve_model

    return model_spec_for(resolve_model(None)).pipeline().out_hw[0]


def _summary(results: list[wm.WatermarkResult], single: list[wm.WatermarkResult]) -> dict:
    return {"bit_accuracy": round(float(np.mean([r.bit_accuracy for r in results])), 4),
            "detection_rate": round(float(np.mean([r.detected for r in results])), 4),
            "detection_rate_1_frame": round(float(np.mean([r.detected for r in single])), 4),
            "median_score": round(float(np.median([r.score for r in results])), 2),
            "max_p_value": float(f"{max(r.p_value for r in results):.3g}")}


def _false_positives(results: list[wm.WatermarkResult]) -> dict:
    p = np.array([r.p_value for r in results])
    return {"renders": len(results), "detected": int(sum(r.detected for r in results)),
            "rate_p_below_0.05": round(float(np.mean(p < 0.05)), 4),
            "rate_p_below_0.01": round(float(np.mean(p < 0.01)), 4),
            "min_p_value": float(f"{p.min():.3g}"),
            "max_score": round(max(r.score for r in results), 2)}


def run(args: argparse.Namespace) -> dict:
    from avatarstream.eval.metrics import psnr_ssim

    if min(args.clips, args.frames, args.negatives, args.negative_frames) < 1:
        raise ConfigError("--clips, --frames, --negatives and --negative-frames must be at least 1")
    size = args.size or _default_size()
    t0 = time.perf_counter()
    wm.embed(np.zeros((1, size, size, 3), np.uint8))  # the pattern is built once per size: not timed
    per_attack: dict[str, tuple[list, list]] = {name: ([], []) for name in ATTACKS}
    psnr, ssim, embed_s, embedded = [], [], 0.0, 0
    for i in range(args.clips):
        clean = _clip(i, size, args.frames)
        t = time.perf_counter()
        marked = wm.embed(clean)
        embed_s += time.perf_counter() - t
        embedded += len(clean)
        p, s = psnr_ssim(marked, clean)
        psnr.append(p.mean())
        ssim.append(s.mean())
        for name, attack in ATTACKS.items():
            seen = attack(marked)
            per_attack[name][0].append(wm.detect(seen))
            per_attack[name][1].append(wm.detect(seen[:1]))
    negatives, negatives_h264 = [], []
    for i in range(args.negatives):
        clean = _clip(args.clips + i, size, args.negative_frames)
        negatives.append(wm.detect(clean))
        negatives_h264.append(wm.detect(h264(clean, 300_000)))
    return {
        "size": f"{size}x{size}", "clips": args.clips, "frames_per_clip": args.frames,
        "payload_bits": wm.PAYLOAD_BITS, "p_threshold": wm.P_THRESHOLD,
        "attacks": {name: _summary(*res) for name, res in per_attack.items()},
        "false_positives": _false_positives(negatives),
        "false_positives_h264_300kbps": _false_positives(negatives_h264),
        "psnr_db": round(float(np.mean(psnr)), 2), "psnr_db_min": round(float(np.min(psnr)), 2),
        "ssim": round(float(np.mean(ssim)), 5),
        "embed_ms_per_frame": round(embed_s * 1000 / embedded, 3),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
