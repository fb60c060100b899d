"""Markdown report with PNG plots, next to the JSON (no matplotlib: plots are rasterised here in
numpy and written with PyAV's png encoder).

Plots carry no text; the Markdown caption under each says what the axes and colours are.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from avatarstream.media.image import write_png

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
          (227, 119, 194), (127, 127, 127)]


class Plot:
    """A white canvas [h, w, 3] with a plot area mapped to data ranges (x0..x1, y0..y1)."""

    def __init__(self, xr: tuple[float, float], yr: tuple[float, float], w: int = 640, h: int = 240,
                 margin: int = 24) -> None:
        self.img = np.full((h, w, 3), 255, np.uint8)
        self.w, self.h, self.m = w, h, margin
        self.xr = (xr[0], xr[1] if xr[1] > xr[0] else xr[0] + 1)
        self.yr = (yr[0], yr[1] if yr[1] > yr[0] else yr[0] + 1)
        for k in range(5):  # light grid: quarters of each range
            gy = int(round(margin + k * (h - 2 * margin) / 4))
            gx = int(round(margin + k * (w - 2 * margin) / 4))
            self.img[gy, margin:w - margin] = 225
            self.img[margin:h - margin, gx] = 225
        self.img[h - margin, margin:w - margin] = 0
        self.img[margin:h - margin + 1, margin] = 0

    def px(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        fx = (np.asarray(x, float) - self.xr[0]) / (self.xr[1] - self.xr[0])
        fy = (np.asarray(y, float) - self.yr[0]) / (self.yr[1] - self.yr[0])
        return (self.m + fx * (self.w - 2 * self.m), self.h - self.m - fy * (self.h - 2 * self.m))

    def line(self, x: np.ndarray, y: np.ndarray, color: tuple[int, int, int], width: int = 1) -> None:
        """Polyline through finite points, drawn by dense sampling of each segment."""
        x, y = np.asarray(x, float), np.asarray(y, float)
        ok = np.isfinite(x) & np.isfinite(y)
        px, py = self.px(x[ok], y[ok])
        for i in range(len(px) - 1):
            n = int(max(abs(px[i + 1] - px[i]), abs(py[i + 1] - py[i]))) + 2
            self._dots(np.linspace(px[i], px[i + 1], n), np.linspace(py[i], py[i + 1], n), color, width)
        if len(px) == 1:
            self._dots(px, py, color, width + 1)

    def points(self, x: np.ndarray, y: np.ndarray, color: tuple[int, int, int], r: int = 2) -> None:
        px, py = self.px(x, y)
        self._dots(px, py, color, r)

    def vline(self, x: float, color: tuple[int, int, int]) -> None:
        px, _ = self.px(np.array([x]), np.array([0.0]))
        c = int(round(px[0]))
        if self.m <= c < self.w - self.m:
            self.img[self.m:self.h - self.m, c] = color

    def band(self, x: np.ndarray, mask: np.ndarray, color: tuple[int, int, int]) -> None:
        """Shade the columns where mask is true (e.g. silence)."""
        px, _ = self.px(x, np.zeros(len(x)))
        step = max(1, int(np.ceil((self.w - 2 * self.m) / max(len(x), 1))))
        for c, on in zip(px.round().astype(int), mask):
            if on:
                self.img[self.m:self.h - self.m, max(self.m, c):min(self.w - self.m, c + step)] = color

    def _dots(self, px: np.ndarray, py: np.ndarray, color: tuple[int, int, int], width: int) -> None:
        r = max(0, width // 2)
        for dx in range(-r, r + 1):
            for dy in range(-r, r + 1):
                cx = np.clip(np.round(px).astype(int) + dx, 0, self.w - 1)
                cy = np.clip(np.round(py).astype(int) + dy, 0, self.h - 1)
                self.img[cy, cx] = color


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def plot_case(out: Path, name: str, ev_tracks: dict[str, Any], gt_tracks: dict[str, Any] | None) -> list[tuple[str, str]]:
    """PNG plots of one evaluated video; returns (file name, caption) pairs."""
    files: list[tuple[str, str]] = []
    fps = 25.0
    mo = np.asarray(ev_tracks["mouth_open"])
    t = np.arange(len(mo)) / fps
    p = Plot((0, t[-1] if len(t) else 1), (-0.1, 1.1))
    p.band(t, np.asarray(ev_tracks["silent"]), (235, 235, 235))
    e = np.asarray(ev_tracks["energy_db"])
    p.line(t, np.clip((e + 80) / 80, 0, 1), (170, 170, 170))
    if gt_tracks is not None:
        g = np.asarray(gt_tracks["mouth_open"])
        p.line(t[:len(g)], g[:len(t)], COLORS[1], 1)
    p.line(t, mo, COLORS[0], 2)
    for s in ev_tracks.get("chunk_starts", []):
        p.vline(s / fps, COLORS[3])
    write_png(out / f"{name}_mouth.png", p.img)
    files.append((f"{name}_mouth.png", "Mouth opening read by the face-state expert over time (x: seconds, "
                  "y: 0..1). Blue: this video; orange: the ground-truth render; grey: audio level "
                  "(-80..0 dBFS); shaded: frames counted as silence; red lines: chunk starts."))
    d = np.asarray(ev_tracks["sync_dists"], float)
    offs = np.arange(len(d)) - (len(d) - 1) // 2
    both = [d] + ([np.asarray(gt_tracks["sync_dists"], float)] if gt_tracks is not None else [])
    finite = np.concatenate([x[np.isfinite(x)] for x in both])
    hi = float(finite.max()) if finite.size else 1.0
    p = Plot((offs[0], offs[-1]), (0, max(hi * 1.1, 1e-3)))
    if gt_tracks is not None:
        p.line(offs, gt_tracks["sync_dists"], COLORS[1], 1)
    p.line(offs, d, COLORS[0], 2)
    p.vline(0.0, (160, 160, 160))
    write_png(out / f"{name}_sync.png", p.img)
    files.append((f"{name}_sync.png", f"Sync expert: mean audio-video distance against audio offset o "
                  f"(x: {offs[0]}..{offs[-1]} frames, y: 0..{hi * 1.1:.2f}); the dip is the detected sync. "
                  "Blue: this video; orange: ground truth."))
    fs, fi = np.asarray(ev_tracks["face_sim"]), np.asarray(ev_tracks["face_sim_idx"])
    p = Plot((0, t[-1] if len(t) else 1), (0, 1))
    p.line(fi / fps, fs, COLORS[2], 2)
    p.points(fi / fps, fs, COLORS[2], 3)
    write_png(out / f"{name}_facesim.png", p.img)
    files.append((f"{name}_facesim.png", "Face similarity to the reference at the 2 fps samples (x: seconds, y: 0..1)."))
    return files


def frame_strip(out: Path, name: str, rows: list[np.ndarray], n: int = 6, size: int = 128) -> tuple[str, str]:
    """Rows of frames ([F, H, W, 3] each) sampled at n evenly spaced times, resized to `size`."""
    import torch
    import torch.nn.functional as F

    lines = []
    for fr in rows:
        idx = np.linspace(0, len(fr) - 1, n).round().astype(int)
        x = torch.from_numpy(np.ascontiguousarray(fr[idx])).permute(0, 3, 1, 2).float()
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=x.shape[-1] > size)
        lines.append(np.concatenate(list(x.round().clamp(0, 255).byte().permute(0, 2, 3, 1).numpy()), 1))
    write_png(out / f"{name}_frames.png", np.concatenate(lines, 0))
    return f"{name}_frames.png", "Frames at evenly spaced times; rows: " + ", ".join(
        ["generated", "ground truth", "reference"][:len(rows)]) + "."


KEYS = ("sync_c", "sync_d", "offset_frames", "face_sim", "style_error", "silence_mouth_closed",
        "boundary_smoothness", "psnr", "fps", "ttff_s")


def write_report(out: Path, summary: dict[str, Any], cases: list[dict[str, Any]], title: str) -> Path:
    """OUT/report.json (summary) and OUT/report.md (tables, per-case rows, drift tables, plots)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(summary, indent=1, default=float))
    md = [f"# {title}", "", "| metric | value |", "| --- | --- |"]
    md += [f"| {k} | {_fmt(summary.get(k))} |" for k in KEYS if k in summary]
    extra = [k for k in ("latent_cadence", "seam_vs_cadence", "ssim", "model", "split", "seed", "clips", "seconds")
             if k in summary]
    md += [f"| {k} | {_fmt(summary.get(k))} |" for k in extra]
    md += ["", "Sync-C ↑, Sync-D ↓ (distances on the unit sphere, 0..2), offset in frames (syncnet_python sign: "
           "audio late against video is negative), FaceSim ↑ (cosine), style error ↓ (mean relative error of "
           "mouth amplitude, head sway, blink rate), silence: share of silent frames with a closed mouth ↑, "
           "boundary smoothness: change at chunk seams / median change (1 = seamless), latent cadence: change "
           "where a latent frame's 4 frames start / median change (1 = no 4-frame stutter), seam vs cadence: change "
           "at chunk seams / at the other latent starts (1 = seams no jumpier than the VAE's cadence), PSNR (dB) ↑ against the "
           "ground-truth render; per-frame metrics at 2 fps, 10% trimmed means; FPS and TTFF as Live Avatar §10 "
           "(whole pipeline, from start to first published frame)."]
    if cases:
        md += ["", "## Cases", "", "| case | " + " | ".join(KEYS[:8]) + " |", "|" + " --- |" * 9]
        for c in cases:
            md.append(f"| {c['name']} | " + " | ".join(_fmt(c["metrics"].get(k)) for k in KEYS[:8]) + " |")
        md += ["", "## Drift by time window", "", "| case | window (s) | sync_c | sync_d | offset | face_sim | psnr | mouth open |",
               "|" + " --- |" * 8]
        for c in cases:
            for r in c["drift"]:
                md.append(f"| {c['name']} | {r['start_s']:.0f}–{r['end_s']:.0f} | {_fmt(r['sync_c'])} | "
                          f"{_fmt(r['sync_d'])} | {_fmt(r['offset_frames'])} | {_fmt(r['face_sim'])} | "
                          f"{_fmt(r.get('psnr'))} | {_fmt(r['mouth_open_mean'])} |")
        md += ["", "## Plots", ""]
        for c in cases:
            for f, cap in c.get("plots", []):
                md += [f"![{f}]({f})", "", f"*{c['name']}*: {cap}", ""]
    path = out / "report.md"
    path.write_text("\n".join(md) + "\n")
    return path
