"""Metrics of a generated video, from its pixels and audio only (issue 4, item 6).

Definitions (Avatar V §7.2, Live Avatar §5 and §9):
- Sync-C / Sync-D / offset (syncnet_python): for every video frame t, the distance between the
  video embedding of frames t-2..t+2 and the audio embedding of the 0.2 s window at frame t + o,
  o in -15..15; mean over all frames t gives d(o) (a frame whose audio window t + o lies outside
  the audio counts as an unrelated pair, sqrt 2, like syncnet_python's zero-padded features). Sync-D = min d, Sync-C =
  median d - min d, offset = 15 - argmin index = -o* (syncnet_python's sign: audio delayed by
  0.4 s against the video gives -10). Video level, all frames.
- Per-frame metrics (face similarity, PSNR, SSIM) are sampled at 2 fps and averaged with a 10%
  trimmed mean (top and bottom 10% dropped).
- face_sim: cosine between the identity embedding of each sampled frame's face crop and the mean
  embedding of the reference frames.
- silence_mouth_closed: share of silent frames (audio RMS 35 dB under the clip's speech level,
  eroded by 3 frames on each side) whose mouth opening, read by the face-state regressor, is
  below 0.15 (open = 1 is the widest viseme). All silent frames count (a rate, not a mean).
- style_error: mean relative error of three statistics of the face-state tracks, generated vs
  reference video: mouth amplitude (95th - 5th percentile of opening), head sway (RMS of yaw,
  pitch, roll deviation, degrees), blink rate (closures per minute).
- boundary_smoothness: mean frame-to-frame change at chunk boundaries over the median change
  inside chunks (1 = seamless; > 1 a visible jump at the seams).
- latent_cadence: mean change into frames 4k + 1 (where the causal VAE's latent frames start: one
  latent decodes 4 frames) over the median change into the other frames; 1 = no 4-frame cadence,
  > 1 = the picture steps once a latent and holds between (a stutter at 6.25 Hz). Chunks start on
  latent boundaries, so this is the floor of boundary_smoothness for a latent-video model.
- seam_vs_cadence: mean change at chunk boundaries over the mean change at the latent boundaries
  inside chunks: the chunk seams alone, the VAE's cadence divided out (1 = seams no jumpier).
- psnr / ssim against a ground-truth render (the generated frames resized to its size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from avatarstream.eval.experts import (FACE_SIZE, FPS, MOUTH_SIZE, SAMPLE_RATE, SYNC_SIZE, Experts, audio_mel,
                                       crop, face_box, grey, mel_windows, mouth_box, to_canvas, video_windows)

VSHIFT = 15
SAMPLE_FPS = 2.0
TRIM = 0.1
MOUTH_CLOSED = 0.15
SILENCE_DB = 35.0
DRIFT_STARTS = (0.0, 100.0, 1000.0, 10000.0)
DRIFT_LEN = 10.0


def trimmed_mean(x: np.ndarray | list[float], trim: float = TRIM) -> float | None:
    """Mean after dropping the lowest and highest `trim` share (at least nothing dropped)."""
    a = np.sort(np.asarray(x, np.float64))
    a = a[np.isfinite(a)]
    if a.size == 0:
        return None
    k = int(np.floor(trim * a.size))
    return float(a[k:a.size - k].mean()) if a.size - 2 * k > 0 else float(a.mean())


def sample_indices(n: int, fps: float = FPS, rate: float = SAMPLE_FPS) -> np.ndarray:
    """Frame indices at `rate` per second (t = 0, 0.5, 1.0 ... s) of an n-frame video."""
    return np.unique(np.round(np.arange(0, n / fps, 1.0 / rate) * fps).astype(int).clip(0, max(n - 1, 0)))


def _median_filter(x: np.ndarray, k: int = 5) -> np.ndarray:
    """Running median along axis 0 (edges padded by repetition). x [F, C]."""
    if len(x) < 3:
        return x
    h = k // 2
    p = np.concatenate([np.repeat(x[:1], h, 0), x, np.repeat(x[-1:], h, 0)])
    return np.median(np.stack([p[i:i + len(x)] for i in range(k)]), 0)


@dataclass
class FaceTrack:
    """Per-frame reads of a video. states [F, 10] (STATE_KEYS order: mouth x, y, face scale (px on
    the 256 canvas), yaw, pitch, roll (deg), blink, open, width, round); mouths [F, 1, 40, 40] grey
    crops for the sync expert; ident [F_s, D] identity embeddings of the frames `ident_idx`."""

    states: np.ndarray
    mouths: torch.Tensor
    ident: torch.Tensor
    ident_idx: np.ndarray


@torch.inference_mode()
def face_track(frames: np.ndarray, ex: Experts, ident_idx: np.ndarray | None = None, batch: int = 32) -> FaceTrack:
    """Run the face-state regressor over every frame [F, H, W, 3] uint8: locate (median-smoothed
    over 5 frames), then read pose/blink/mouth from the crops; identity embeddings at `ident_idx`
    (default: 2 fps samples)."""
    n = len(frames)
    if n == 0:
        raise ValueError("no frames")
    ident_idx = sample_indices(n) if ident_idx is None else np.asarray(ident_idx, int)
    loc = torch.cat([ex.face.locate(to_canvas(frames[i:i + batch])) for i in range(0, n, batch)])
    loc = torch.from_numpy(_median_filter(loc.numpy()).astype(np.float32))
    states, mouths, ident = [], [], []
    want = set(ident_idx.tolist())
    for i in range(0, n, batch):
        x = to_canvas(frames[i:i + batch])
        lo = loc[i:i + batch]
        mx, my, a = lo[:, 0], lo[:, 1], lo[:, 2]
        face = crop(x, *face_box(mx, my, a), FACE_SIZE)
        fs = ex.face.face_state(face)
        ms = ex.face.mouth_state(crop(x, *mouth_box(mx, my, a), MOUTH_SIZE))
        states.append(torch.cat([lo, fs, ms], 1))
        mouths.append(grey(crop(x, mx, my, 2.2 * a, SYNC_SIZE)))
        sel = [j for j in range(len(x)) if i + j in want]
        if sel:
            ident.append(ex.identity(face[sel]))
    return FaceTrack(torch.cat(states).numpy(), torch.cat(mouths), torch.cat(ident), ident_idx)


UNRELATED = float(np.sqrt(2.0))  # distance of orthogonal unit embeddings: an unrelated pair


@torch.inference_mode()
def sync_distances(ex: Experts, mouths: torch.Tensor, audio: np.ndarray, vshift: int = VSHIFT) -> np.ndarray:
    """Mean embedding distance d(o) for offsets o = -vshift..vshift: the video embedding of frames
    t-2..t+2 against the audio embedding of the window at frame t + o, averaged over every video
    frame t, as syncnet_python does. Where t + o falls outside the audio, the pair counts as
    unrelated (sqrt 2), the analogue of syncnet_python's zero-padded audio features: a track
    shifted against its video pays for the frames it pushes out. mouths [F, 1, 40, 40]; audio [N]
    16 kHz -> [2 vshift + 1]."""
    n = mouths.shape[0]
    n_audio = int(np.ceil(len(audio) / (SAMPLE_RATE // FPS)))
    ev = torch.cat([ex.sync.embed_video(w) for w in video_windows(mouths).split(128)])  # [F, D]
    mw = mel_windows(audio_mel(audio), n, margin=vshift)
    ea = torch.cat([ex.sync.embed_audio(w) for w in mw.split(256)])  # [F + 2 vshift, D]
    t = torch.arange(n)
    out = []
    for k in range(2 * vshift + 1):
        d = (ev - ea[k:k + n]).norm(dim=1)
        u = t + (k - vshift)
        d = torch.where((u >= 0) & (u < n_audio), d, torch.full_like(d, UNRELATED))
        out.append(float(d.mean()))
    return np.array(out)


def sync_scores(dists: np.ndarray) -> dict[str, float | int | None]:
    """syncnet_python's reduction of d(o): sync_c (median - min), sync_d (min), offset_frames."""
    if not np.isfinite(dists).any():
        return {"sync_c": None, "sync_d": None, "offset_frames": None}
    vshift = (len(dists) - 1) // 2
    i = int(np.nanargmin(dists))
    return {"sync_c": float(np.nanmedian(dists) - dists[i]), "sync_d": float(dists[i]), "offset_frames": vshift - i}


def frame_energy_db(audio: np.ndarray, frames: int) -> np.ndarray:
    """RMS level in dBFS of each video frame's 40 ms of audio -> [frames]."""
    spf = SAMPLE_RATE // FPS
    a = np.zeros(frames * spf, np.float32)
    m = min(len(audio), len(a))
    a[:m] = audio[:m]
    rms = np.sqrt(np.mean(a.reshape(frames, spf).astype(np.float64) ** 2, 1))
    return 20 * np.log10(rms + 1e-7)


def silent_frames(audio: np.ndarray, frames: int, erode: int = 3) -> np.ndarray:
    """[frames] bool: the frame and the `erode` frames each side are 35 dB under the speech level
    (95th percentile of frame levels) and under -45 dBFS."""
    db = frame_energy_db(audio, frames)
    thr = min(np.percentile(db, 95) - SILENCE_DB, -45.0)
    quiet = db < thr
    out = quiet.copy()
    for s in range(1, erode + 1):
        out[s:] &= quiet[:-s]
        out[:-s] &= quiet[s:]
    out[:erode] &= quiet[0]
    return out


def style_stats(states: np.ndarray, fps: float = FPS) -> dict[str, float]:
    """Talking-style statistics of a face-state track [F, 10]: mouth_amp, head_sway_deg,
    blink_per_min."""
    op = states[:, 7]
    pose = states[:, 3:6]
    blink = states[:, 6] > 0.5
    onsets = int(np.sum(blink[1:] & ~blink[:-1]) + (1 if len(blink) and blink[0] else 0))
    minutes = max(len(states) / fps / 60.0, 1e-9)
    return {"mouth_amp": float(np.percentile(op, 95) - np.percentile(op, 5)),
            "head_sway_deg": float(np.sqrt(np.mean(np.var(pose, 0).sum()))),
            "blink_per_min": onsets / minutes}


STYLE_FLOOR = {"mouth_amp": 0.1, "head_sway_deg": 0.5, "blink_per_min": 6.0}


def style_error(gen: dict[str, float], ref: dict[str, float]) -> float:
    """Mean over the statistics of |gen - ref| / max(|ref|, floor)."""
    return float(np.mean([abs(gen[k] - ref[k]) / max(abs(ref[k]), STYLE_FLOOR[k]) for k in STYLE_FLOOR]))


def frame_changes(frames: np.ndarray, size: int = 128) -> np.ndarray:
    """Mean absolute grey change between consecutive frames on a 128x128 canvas -> [F] (first 0)."""
    out = [0.0]
    prev = None
    for i in range(0, len(frames), 64):
        g = grey(F.interpolate(to_canvas(frames[i:i + 64]), size=(size, size), mode="area"))[:, 0] * 255
        if prev is not None:
            g = torch.cat([prev, g])
        out.extend((g[1:] - g[:-1]).abs().mean((1, 2)).tolist())
        prev = g[-1:]
    return np.asarray(out[:len(frames)])


def boundary_smoothness(changes: np.ndarray, starts: list[int]) -> float | None:
    """Mean change at chunk starts (frames b: change b-1 -> b) over the median change inside
    chunks; 1 is seamless. None without an inner boundary."""
    b = sorted({int(s) for s in starts if 0 < s < len(changes)})
    if not b:
        return None
    inner = np.delete(changes[1:], [s - 1 for s in b])
    return float((np.mean(changes[b]) + 1e-3) / (np.median(inner) + 1e-3)) if inner.size else None


def _latent_starts(n: int, first: int) -> np.ndarray:
    """Indices i in 1..n-1 of a window (frame 0 = stream frame `first`) whose stream frame is a
    latent start 4k + 1, k ≥ 1 (changes[i]: the change into frame i)."""
    idx = np.arange(1, n)
    return idx[((idx + first) % 4 == 1) & (idx + first > 1)]


def latent_cadence(changes: np.ndarray, first: int = 0) -> float | None:
    """Mean change into stream frames 4k + 1 (k ≥ 1) over the median change into the other frames;
    changes[i]: into frame i of a window whose frame 0 is stream frame `first`."""
    at = _latent_starts(len(changes), first)
    idx = np.arange(1, len(changes))
    rest = idx[(idx + first) % 4 != 1]
    if not at.size or not rest.size:
        return None
    return float((np.mean(changes[at]) + 1e-3) / (np.median(changes[rest]) + 1e-3))


def seam_vs_cadence(changes: np.ndarray, starts: list[int], first: int = 0) -> float | None:
    """Mean change at chunk starts over the mean change at the other latent boundaries (stream
    frames 4k + 1; `first` as in latent_cadence)."""
    b = sorted({int(s) for s in starts if 0 < s < len(changes)})
    inner = np.setdiff1d(_latent_starts(len(changes), first), b)
    if not b or not inner.size:
        return None
    return float((np.mean(changes[b]) + 1e-3) / (np.mean(changes[inner]) + 1e-3))


def _gauss(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    g = torch.exp(-((torch.arange(size) - size // 2).float() ** 2) / (2 * sigma ** 2))
    g = g / g.sum()
    return (g[:, None] * g[None])[None, None]


def psnr_ssim(gen: np.ndarray, gt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-frame PSNR (dB, RGB, peak 255) and SSIM (luma, 11x11 Gaussian) of gen [N, h, w, 3] against
    gt [N, H, W, 3] uint8 (gen resized to H x W) -> ([N], [N])."""
    y = torch.from_numpy(np.ascontiguousarray(gt)).permute(0, 3, 1, 2).float()
    x = torch.from_numpy(np.ascontiguousarray(gen)).permute(0, 3, 1, 2).float()
    if x.shape[-2:] != y.shape[-2:]:
        x = F.interpolate(x, size=y.shape[-2:], mode="bilinear", align_corners=False).round().clamp(0, 255)
    mse = ((x - y) ** 2).mean((1, 2, 3))
    psnr = 10 * torch.log10(255.0 ** 2 / mse.clamp_min(1e-10))
    psnr = psnr.clamp(max=100.0)
    xl, yl = grey(x), grey(y)
    w = _gauss()
    mu_x, mu_y = F.conv2d(xl, w), F.conv2d(yl, w)
    sxx = F.conv2d(xl * xl, w) - mu_x ** 2
    syy = F.conv2d(yl * yl, w) - mu_y ** 2
    sxy = F.conv2d(xl * yl, w) - mu_x * mu_y
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    ssim = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x ** 2 + mu_y ** 2 + c1) * (sxx + syy + c2))
    return psnr.numpy(), ssim.mean((1, 2, 3)).numpy()


@dataclass
class Evaluation:
    """Scalars (`metrics`), the drift table rows and the tracks the report plots."""

    metrics: dict[str, Any]
    drift: list[dict[str, Any]]
    tracks: dict[str, Any] = field(default_factory=dict)


def _window_metrics(ex: Experts, track: FaceTrack, audio: np.ndarray, ref_emb: torch.Tensor | None,
                    lo: int, hi: int, psnr: np.ndarray | None, psnr_idx: np.ndarray | None) -> dict[str, Any]:
    spf = SAMPLE_RATE // FPS
    d = sync_distances(ex, track.mouths[lo:hi], audio[lo * spf:hi * spf])
    row: dict[str, Any] = {"start_s": lo / FPS, "end_s": hi / FPS, **sync_scores(d)}
    m = (track.ident_idx >= lo) & (track.ident_idx < hi)
    row["face_sim"] = trimmed_mean((track.ident[m] @ ref_emb).numpy()) if ref_emb is not None and m.any() else None
    if psnr is not None and psnr_idx is not None:
        pm = (psnr_idx >= lo) & (psnr_idx < hi)
        row["psnr"] = trimmed_mean(psnr[pm]) if pm.any() else None
    row["mouth_open_mean"] = float(track.states[lo:hi, 7].mean())
    return row


def reference_embedding(ex: Experts, reference: np.ndarray, max_frames: int = 16) -> tuple[torch.Tensor, np.ndarray]:
    """Mean (renormalised) identity embedding [D] of up to 16 evenly spaced reference frames, and
    the reference's face-state track [F_r, 10] (all frames)."""
    idx = np.unique(np.linspace(0, len(reference) - 1, min(max_frames, len(reference))).round().astype(int))
    tr = face_track(reference, ex, ident_idx=idx)
    return F.normalize(tr.ident.mean(0), dim=0), tr.states


def evaluate(frames: np.ndarray, audio: np.ndarray, reference: np.ndarray, ex: Experts, *,
             ground_truth: np.ndarray | None = None, chunk_starts: list[int] | None = None,
             reference_reads: tuple[torch.Tensor, np.ndarray] | None = None,
             first_frame: int = 0) -> Evaluation:
    """All metrics of one video (`first_frame`: the stream index of its frame 0, for a window of a
    longer stream: where the latent boundaries of `latent_cadence` fall).

    frames [F, H, W, 3] uint8 at 25 fps; audio [N] float32 16 kHz (its start is frame 0's start);
    reference [F_r, h, w, 3] uint8 (an image: F_r = 1, then no style_error); ground_truth
    [F_g, H', W', 3] uint8 or None; chunk_starts: first frame index of each chunk (None: no
    boundary metric); reference_reads: `reference_embedding(ex, reference)` when already computed
    (several videos scored against one reference read it once).
    """
    n = len(frames)
    track = face_track(frames, ex)
    ref_emb, ref_states = reference_reads if reference_reads is not None else reference_embedding(ex, reference)
    dists = sync_distances(ex, track.mouths, audio)
    met: dict[str, Any] = {"frames": n, "seconds": n / FPS, **sync_scores(dists)}
    sims = (track.ident @ ref_emb).numpy()
    met["face_sim"] = trimmed_mean(sims)
    gen_style = style_stats(track.states)
    met["style"] = gen_style
    if len(reference) >= FPS * 2:
        ref_style = style_stats(ref_states)
        met["reference_style"] = ref_style
        met["style_error"] = style_error(gen_style, ref_style)
    else:
        met["style_error"] = None
    silent = silent_frames(audio, n)
    closed = track.states[:, 7] < MOUTH_CLOSED
    met["silent_frames"] = int(silent.sum())
    met["silence_mouth_closed"] = float(closed[silent].mean()) if silent.any() else None
    changes = frame_changes(frames)
    met["boundary_smoothness"] = boundary_smoothness(changes, chunk_starts) if chunk_starts else None
    met["latent_cadence"] = latent_cadence(changes, first_frame)
    met["seam_vs_cadence"] = seam_vs_cadence(changes, chunk_starts, first_frame) if chunk_starts else None
    psnr = ssim = pidx = None
    if ground_truth is not None:
        m = min(n, len(ground_truth))
        pidx = sample_indices(m)
        psnr, ssim = psnr_ssim(frames[pidx], ground_truth[pidx])
        met["psnr"] = trimmed_mean(psnr)
        met["ssim"] = trimmed_mean(ssim)
    else:
        met["psnr"] = met["ssim"] = None
    drift = []
    for s in DRIFT_STARTS:
        lo, hi = int(round(s * FPS)), min(n, int(round((s + DRIFT_LEN) * FPS)))
        if hi - lo >= 2 * FPS:
            drift.append(_window_metrics(ex, track, audio, ref_emb, lo, hi, psnr, pidx))
    if n > (DRIFT_STARTS[1] + DRIFT_LEN) * FPS and n - int(DRIFT_LEN * FPS) > 0:
        lo = n - int(DRIFT_LEN * FPS)
        if all(abs(r["start_s"] * FPS - lo) > FPS for r in drift):
            drift.append(_window_metrics(ex, track, audio, ref_emb, lo, n, psnr, pidx))
    tracks = {"mouth_open": track.states[:, 7], "energy_db": frame_energy_db(audio, n), "silent": silent,
              "sync_dists": dists, "face_sim": sims, "face_sim_idx": track.ident_idx, "changes": changes,
              "chunk_starts": list(chunk_starts or []), "states": track.states}
    if psnr is not None:
        tracks.update(psnr=psnr, psnr_idx=pidx)
    return Evaluation(met, drift, tracks)
