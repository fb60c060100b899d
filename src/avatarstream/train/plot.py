"""Loss-curve PNGs from a run's `log.jsonl`: one image per logged quantity (matplotlib when it is
installed, else a dependency-free raster: light grid at powers of ten on a log-y axis, the raw
curve in light blue, a moving average in dark blue, y range and step range printed in the
corners; the quantity is the file name)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def read_log(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _smooth(y: np.ndarray, k: int) -> np.ndarray:
    if len(y) < 3 or k < 2:
        return y
    k = min(k, len(y))
    c = np.cumsum(np.insert(y, 0, 0.0))
    out = np.empty_like(y)
    for i in range(len(y)):
        a = max(0, i - k + 1)
        out[i] = (c[i + 1] - c[a]) / (i + 1 - a)
    return out


# 3x5 bitmap glyphs for axis numbers in the fallback raster (rows top to bottom, 3 bits each)
_GLYPHS = {"0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7),
           "3": (7, 1, 7, 1, 7), "4": (5, 5, 7, 1, 1), "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7),
           "7": (7, 1, 1, 1, 1), "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7), ".": (0, 0, 0, 0, 2),
           "-": (0, 0, 7, 0, 0), "e": (0, 7, 7, 4, 7), "+": (0, 2, 7, 2, 0), " ": (0, 0, 0, 0, 0)}


def _text(img: np.ndarray, x: int, y: int, text: str, scale: int = 2) -> None:
    """Draw `text` (digits, '.', '-', 'e', '+') at top-left (x, y) in black."""
    for ch in text:
        rows = _GLYPHS.get(ch, _GLYPHS[" "])
        for r, bits in enumerate(rows):
            for c in range(3):
                if bits >> (2 - c) & 1:
                    y0, x0 = y + r * scale, x + c * scale
                    img[max(0, y0):y0 + scale, max(0, x0):x0 + scale] = 0
        x += 4 * scale


def _raster(steps: np.ndarray, ys: np.ndarray, path: Path, w: int = 640, h: int = 360) -> None:
    from avatarstream.media.image import write_png

    img = np.full((h, w, 3), 255, np.uint8)
    m = 24
    pos = ys > 0
    log = bool(pos.all())
    v = np.log10(ys) if log else ys
    lo, hi = float(v.min()), float(v.max())
    if hi - lo < 1e-9:
        lo, hi = lo - 0.5, hi + 0.5
    x0, x1 = float(steps.min()), float(max(steps.max(), steps.min() + 1))
    X = lambda s: (m + (s - x0) / (x1 - x0) * (w - 2 * m)).astype(int)  # noqa: E731
    Y = lambda u: (h - m - (u - lo) / (hi - lo) * (h - 2 * m)).astype(int)  # noqa: E731
    if log:
        for d in range(math.floor(lo), math.ceil(hi) + 1):
            for sub in range(1, 10):
                u = d + math.log10(sub)
                if lo <= u <= hi:
                    img[int(Y(np.array(u))), m:w - m] = (200, 200, 200) if sub == 1 else (235, 235, 235)
    img[m:h - m, m] = img[h - m, m:w - m] = 0

    def line(sx: np.ndarray, sy: np.ndarray, color: tuple[int, int, int]) -> None:
        for i in range(len(sx) - 1):
            n = max(abs(sx[i + 1] - sx[i]), abs(sy[i + 1] - sy[i]), 1)
            t = np.linspace(0, 1, n + 1)
            xx = np.clip(np.round(sx[i] + t * (sx[i + 1] - sx[i])).astype(int), 0, w - 1)
            yy = np.clip(np.round(sy[i] + t * (sy[i + 1] - sy[i])).astype(int), 0, h - 1)
            img[yy, xx] = color

    line(X(steps), Y(v), (150, 190, 235))
    line(X(steps), Y(_smooth(v, max(1, len(v) // 20))), (20, 60, 160))
    top, bottom = (10 ** hi, 10 ** lo) if log else (hi, lo)
    _text(img, m + 4, 4, f"{top:.4g}")  # y range (top-left: max, bottom-left: min)
    _text(img, m + 4, h - m - 14, f"{bottom:.4g}")
    _text(img, w - m - 8 * len(str(int(x1))), h - m + 6, str(int(x1)))  # last step
    _text(img, m, h - m + 6, str(int(x0)))
    write_png(path, img)


def plot_losses(run_dir: Path) -> list[Path]:
    """Write `plots/<key>.png` for every numeric key of the log; returns the paths."""
    rows = read_log(run_dir / "log.jsonl")
    if len(rows) < 2:
        return []
    # every numeric value any row logged (a DMD run logs its generator's values on some steps only)
    keys = [k for k in dict.fromkeys(k for r in rows for k in r)
            if k not in ("step", "time_s", "lr", "step_s", "fwd_bwd_s", "opt_s")
            and any(isinstance(r.get(k), (int, float)) and not isinstance(r.get(k), bool) for r in rows)]
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    paths = []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    for k in keys:
        pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
        if len(pts) < 2:
            continue
        s, y = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)
        p = out_dir / f"{k}.png"
        if plt is not None:
            fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
            ax.plot(s, y, color="#96bee9", lw=0.8)
            ax.plot(s, _smooth(y, max(1, len(y) // 20)), color="#143ca0", lw=1.5)
            if (y > 0).all():
                ax.set_yscale("log")
            ax.set_xlabel("step")
            ax.set_title(f"{run_dir.name}: {k}")
            ax.grid(alpha=0.3)
            fig.tight_layout()
            fig.savefig(p)
            plt.close(fig)
        else:
            _raster(s, y, p)
        paths.append(p)
    return paths
