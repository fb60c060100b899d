"""`avatarstream eval showcase`: pictures of a model on a held-out case, for the README and docs.

- `showcase_MODEL.png`: a contact sheet of 4 moments (columns, in time order: the two widest
  mouth openings of the ground truth and two closed-mouth moments deep inside pauses), rows:
  generated, ground truth, reference video at the same time. A strip above each column marks the
  moment: red = mouth open, blue = mouth closed (the sheet carries no text; the caption says this).
- `showcase_MODEL.gif`: up to 3 s (the window where the ground-truth mouth moves most), generated |
  ground truth | reference side by side at 12.5 fps, one 256-colour palette (k-means over the
  clip's pixels), looping; shrunk until it is under 2 MB.

Moments are chosen from the renderer's annotations (exact mouth opening and speech timing): this
picks frames to show, it scores nothing.

    avatarstream eval showcase --model NAME --out docs/ [--split S] [--seed X] [--seconds S] [--steps K]
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import numpy as np
import torch
import torch.nn.functional as F

from avatarstream.errors import InputError, OutputError
from avatarstream.eval.benchmark import check_bench_args, check_run_options, load_subject, make_cases, run_model
from avatarstream.media.image import write_png

FPS = 25
GIF_SECONDS = 3.0
GIF_MAX_BYTES = 2_000_000
MIN_GAP = 25  # frames between chosen moments
OPEN_MARK, CLOSED_MARK = (214, 39, 40), (31, 119, 180)


def _resize(frames: np.ndarray, size: int) -> np.ndarray:
    """[N, H, W, 3] uint8 -> [N, size, size, 3] uint8 (bilinear, antialiased when shrinking)."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float()
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=x.shape[-1] > size)
    return x.round().clamp(0, 255).byte().permute(0, 2, 3, 1).numpy()


def _spread(order: np.ndarray, k: int, taken: list[int], gap: int = MIN_GAP) -> list[int]:
    """The first k indices of `order` at least `gap` frames from each other and from `taken`."""
    out: list[int] = []
    for i in order:
        if all(abs(int(i) - j) >= gap for j in out + taken):
            out.append(int(i))
            if len(out) == k:
                break
    return out


def _distance_to(mask: np.ndarray) -> np.ndarray:
    """[n] frames from each frame to the nearest true frame of `mask` (n where there is none)."""
    n = len(mask)
    d = np.full(n, n, np.int64)
    last = None
    for i in range(n):  # forward then backward pass
        last = i if mask[i] else last
        if last is not None:
            d[i] = i - last
    last = None
    for i in range(n - 1, -1, -1):
        last = i if mask[i] else last
        if last is not None:
            d[i] = min(d[i], last - i)
    return d


def pick_moments(open_: np.ndarray, speaking: np.ndarray) -> tuple[list[int], list[int]]:
    """(2 open frames, 2 closed frames): widest ground-truth openings, and shut frames farthest
    from any speech (pauses rather than the instants between two phones)."""
    opened = _spread(np.argsort(-open_, kind="stable"), 2, [])
    dist = _distance_to(speaking)
    shut = np.flatnonzero(open_ < 0.05)
    closed = _spread(shut[np.argsort(-dist[shut], kind="stable")], 2, opened, gap=MIN_GAP // 2)
    return opened, closed


def contact_sheet(rows: list[np.ndarray], idx: list[int], marks: list[tuple[int, int, int]],
                  size: int = 160, pad: int = 4, strip: int = 6) -> np.ndarray:
    """rows of frames ([F, H, W, 3] each) at frames `idx` -> one image; a coloured strip tops each column."""
    w = len(idx) * (size + pad) + pad
    h = strip + pad + len(rows) * (size + pad) + pad
    img = np.full((h, w, 3), 255, np.uint8)
    for c, (i, col) in enumerate(zip(idx, marks)):
        x0 = pad + c * (size + pad)
        img[pad:pad + strip, x0:x0 + size] = col
        for r, fr in enumerate(rows):
            y0 = strip + 2 * pad + r * (size + pad)
            img[y0:y0 + size, x0:x0 + size] = _resize(fr[min(i, len(fr) - 1)][None], size)[0]
    return img


def palette_quantize(frames: np.ndarray, colours: int = 256, iters: int = 8, sample: int = 20000,
                     seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """One palette for all frames: k-means over a pixel sample. frames [N, H, W, 3] uint8 ->
    (indices [N, H, W] uint8, palette [colours, 3] uint8)."""
    px = torch.from_numpy(frames.reshape(-1, 3)).float()  # [P, 3]
    g = torch.Generator().manual_seed(seed)
    pick = px[torch.randint(len(px), (min(sample, len(px)),), generator=g)]
    cent = pick[torch.randperm(len(pick), generator=g)[:colours]].clone()
    for _ in range(iters):
        lab = torch.cdist(pick, cent).argmin(1)
        s = torch.zeros_like(cent).index_add_(0, lab, pick)
        cnt = torch.bincount(lab, minlength=len(cent)).float()[:, None]
        cent = torch.where(cnt > 0, s / cnt.clamp_min(1), cent)
    idx = torch.cat([torch.cdist(c, cent).argmin(1) for c in px.split(1 << 16)])
    pal = np.zeros((colours, 3), np.uint8)
    pal[:len(cent)] = cent.round().clamp(0, 255).byte().numpy()
    return idx.to(torch.uint8).numpy().reshape(frames.shape[:3]), pal


def write_gif(path: Path, frames: np.ndarray, fps: Fraction) -> int:
    """Palette-quantised looping GIF of frames [N, H, W, 3] uint8; returns its size in bytes."""
    idx, pal = palette_quantize(frames)
    argb = np.zeros((256, 4), np.uint8)
    argb[:, 0] = 255
    argb[:len(pal), 1:] = pal
    try:
        with av.open(str(path), "w", format="gif") as c:
            s = c.add_stream("gif", rate=fps)
            s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], "pal8"
            for im in idx:
                for p in s.encode(av.VideoFrame.from_ndarray((np.ascontiguousarray(im), argb), format="pal8")):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e}") from e
    return path.stat().st_size


def gif_window(open_: np.ndarray, length: int) -> int:
    """Start of the `length`-frame window where the ground-truth mouth opening varies most."""
    if len(open_) <= length:
        return 0
    var = [float(np.var(open_[a:a + length])) for a in range(0, len(open_) - length + 1, 5)]
    return 5 * int(np.argmax(var))


def run_showcase(model: str, out: Path, *, split: str = "heldout-identity", seed: int = 0, seconds: float = 6.0,
                 steps: int | None = None) -> dict[str, Any]:
    """Run `model` on the first case of `split` and write the contact sheet and GIF into `out`."""
    check_bench_args(split, seconds, 1)
    check_run_options(model, "video", steps)
    models = load_subject(model)
    case = make_cases(split, seconds=seconds, clips=1, seed=seed)[0]
    gen = run_model(model, models, case, steps=steps).frames
    open_ = np.asarray(case.clip.mouth.open, np.float64)
    speaking = np.asarray(case.clip.mouth.speaking, bool)
    opened, closed = pick_moments(open_, speaking)
    if not opened or not closed:
        raise InputError(f"the case has no clear open and closed moments in {seconds:g} s; use --seconds 4 or more")
    moments = sorted([(i, OPEN_MARK) for i in opened] + [(i, CLOSED_MARK) for i in closed])
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create {out}: {e}") from e
    ref_at = case.reference[np.arange(len(gen)) % len(case.reference)]  # the reference video at the same times
    label = Path(model).name or model  # a weights folder given as a path: its folder name
    sheet = out / f"showcase_{label}.png"
    write_png(sheet, contact_sheet([gen, case.gt, ref_at], [i for i, _ in moments], [c for _, c in moments]))
    length = min(len(gen), int(GIF_SECONDS * FPS))
    a = gif_window(open_, length)
    sel = np.arange(a, a + length, 2)  # 12.5 fps
    gif = out / f"showcase_{label}.gif"
    for size in (128, 96, 64):
        panels = [_resize(x[sel], size) for x in (gen, case.gt, ref_at)]
        nbytes = write_gif(gif, np.concatenate(panels, 2), Fraction(FPS, 2))
        if nbytes <= GIF_MAX_BYTES:
            break
    info = case.info()
    caption = (f"{model} on a held-out case ({split}, seed {seed}: identity {info['identity']}, voice "
               f"{info['voice']}; the reference is the same person in another scene). Rows: generated, ground truth, "
               "reference video at the same time; columns in time order; strip above: red = widest mouth openings, "
               "blue = mouth closed in a pause.")
    return {"model": model, "split": split, "seed": seed, "seconds": seconds, "case": info,
            "contact_sheet": str(sheet), "frames": [i for i, _ in moments], "open_frames": opened,
            "closed_frames": closed, "gif": str(gif), "gif_bytes": nbytes, "gif_frames": len(sel),
            "gif_seconds": len(sel) * 2 / FPS, "gif_size": size, "caption": caption,
            "gif_caption": f"{len(sel) * 2 / FPS:.1f} s at 12.5 fps, left to right: generated, ground truth, reference."}
