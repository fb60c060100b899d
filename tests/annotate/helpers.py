"""Pairs folders for the annotation tests: pairs.jsonl as `avatarstream train pairs` writes it,
with real H.264 + AAC renders (PyAV) or placeholder files where only their existence matters."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np


def write_render(path: Path, shade: int, seconds: float = 3.0, size: int = 64, fps: int = 25,
                 rate: int = 16000) -> Path:
    """A short H.264 (yuv420p) + AAC mp4: a moving bar over a flat `shade`, and a tone."""
    n = int(seconds * fps)
    with av.open(str(path), "w") as c:
        v = c.add_stream("libx264", rate=fps)
        v.width = v.height = size
        v.pix_fmt = "yuv420p"
        v.thread_count = 1
        a = c.add_stream("aac", rate=rate, layout="mono")
        for i in range(n):
            img = np.full((size, size, 3), shade, np.uint8)
            img[:, (2 * i) % size] = 255 - shade
            for p in v.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in v.encode():
            c.mux(p)
        t = np.arange(int(seconds * rate)) / rate
        pcm = (0.2 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)[None]
        frame = av.AudioFrame.from_ndarray(pcm, format="fltp", layout="mono")
        frame.sample_rate = rate
        for p in a.encode(frame):
            c.mux(p)
        for p in a.encode():
            c.mux(p)
    return path


def make_pairs(root: Path, n: int = 3, real: bool = False, auto: list | None = None,
               text: str = "hello there") -> list[dict]:
    """A pairs folder at `root` with `n` pairs p0000..; renders/r{2i}.mp4 left, r{2i+1} right.
    `auto`: per pair a (left, right) score or None. Returns the lines written."""
    (root / "renders").mkdir(parents=True, exist_ok=True)
    lines = []
    for i in range(n):
        line = {"pair": f"p{i:04d}", "condition": f"c{i:04d}", "text": f"{text} {i}"}
        for side, k in (("left", 2 * i), ("right", 2 * i + 1)):
            video = root / "renders" / f"r{k:04d}.mp4"
            if real:
                write_render(video, shade=40 + 25 * k)
            else:
                video.write_bytes(b"\0" * 16)
            (root / "renders" / f"r{k:04d}.pt").write_bytes(b"record")
            line[side] = f"renders/r{k:04d}.mp4"
            line[f"{side}_record"] = f"renders/r{k:04d}.pt"
        if auto is not None and auto[i] is not None:
            line["auto"] = {"left": auto[i][0], "right": auto[i][1]}
        lines.append(line)
    write_lines(root, lines)
    return lines


def write_lines(root: Path, lines: list) -> None:
    (root / "pairs.jsonl").write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n"
                                              for ln in lines))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
