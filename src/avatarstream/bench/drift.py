"""`bench drift`: one unbroken rollout scored per time window (Live Avatar Table 7) and the
long-video ablations (Table 4), with memory watched along the way.

The case is held out (`eval benchmark`'s cross-scene setup): a held-out identity's reference clip
and the speech of another clip of that person, looped to `--seconds` as Live Avatar repeats its
audio for the 10,000 s run. The loop is as long as a window (10 s, `--speech-seconds`), so every
window that starts on a multiple of it (all of them when `--seconds` is a multiple of 10) hears
the same speech: a change of Sync-C between windows is then the model's (drift, or the noise of
its sampling), not a change of what is said. Each row gives its `audio_phase_s` (where in the loop
it starts), and `ground_truth` scores the speech clip's own render (the same person, voice and
words) the same way, for the scale of Sync-C. The rollout streams: audio is handed to the pipeline in 0.2 s pieces
and only the frames inside the scoring windows are kept (at most five windows, whatever
`--seconds` is); they are scored after the rollout, so scoring never slows generation down and
the reported fps is the pipeline's.

Windows: 10 s each at 0, 100, 1000, 10000 s where they fit (`eval.metrics.DRIFT_STARTS`), plus
the final 10 s; `--every S` scores one every S seconds instead (at most 20), and `window_spread`
gives the mean and standard deviation over the windows, the scale against which a change between
two windows of the same speech is read. Per window, from `eval.metrics.evaluate` on the window's frames and audio:
`face_sim` (identity cosine to the reference), `sync_c`, and
- `color_shift`: ΔE*76 (CIELAB, D65) between the mean colour of the face region in this window
  and in the first (0–10 s) window. The face region is the face crop the evaluation experts
  locate in every frame (`eval.experts.face_box`), resampled to 64×64 on the 256 canvas; its
  pixels are converted sRGB -> CIELAB and averaged over the window. 0 in the first window.
Ablations (same case, same seeds, each in its own process): without the Adaptive Attention Sink,
without Rolling RoPE, and without History Corrupt — a training-time switch, so that row needs a
causal model trained without it (`--no-history-corrupt-model`); without one it is reported as
unavailable rather than faked.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from avatarstream.engine.pipeline import rss_mb
from avatarstream.errors import ConfigError

HELP = "unbroken causal rollout: FaceSim, Sync-C, face colour shift per 10 s window + ablations, memory"

COLOR_MEASURE = ("ΔE*76 (CIELAB, D65) between the window's mean face-region colour and the 0–10 s "
                 "window's (face crop located by the evaluation experts, 64x64 on the 256 canvas)")
ABLATIONS = {"no_adaptive_sink": {"adaptive_sink": False}, "no_rolling_rope": {"rolling_rope": False}}


def ablations_for(model: str) -> dict[str, dict[str, bool]]:
    """The ablation rows of `model`: each switch turned the other way from the model's default
    (a model that keeps the reference as its sink gets an `adaptive_sink` row instead of
    `no_adaptive_sink`)."""
    from avatarstream.registry import model_spec_for

    pipe = model_spec_for(model).pipeline()
    rows = {}
    for name, over in ABLATIONS.items():
        (key, _), = over.items()
        if getattr(pipe, key):
            rows[name] = over
        else:
            rows[key] = {key: True}
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=1000.0, help="length of the rollout")
    parser.add_argument("--seed", type=int, default=0, help="draws the held-out case (identity, voice)")
    parser.add_argument("--model", default=None,
                        help="model name or weights folder (default: the bundled causal student, "
                             "avatarstream-small-causal, where it ships)")
    parser.add_argument("--no-history-corrupt-model", default=None, metavar="NAME",
                        help="the same causal model trained without History Corrupt (ablation row)")
    parser.add_argument("--no-ablations", action="store_true", help="only the full model's rollout")
    parser.add_argument("--speech-seconds", type=float, default=10.0,
                        help="length of the speech clip that is looped (default: one window, so "
                             "windows starting on multiples of it hear the same speech)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each rollout")
    parser.add_argument("--every", type=float, default=None, metavar="S",
                        help="score a 10 s window every S seconds (0, S, 2S, ... and the last) instead of "
                             "at 0, 100, 1000, 10000 s: how much a metric moves between windows of the "
                             f"same speech (at most {MAX_WINDOWS} windows)")


# ---------------------------------------------------------------------------------------------
# windows, colour


MAX_WINDOWS = 20  # --every: the frames of every window are held until the rollout ends (49 MB each)


def drift_windows(seconds: float, every: float | None = None) -> list[tuple[float, float]]:
    """[(start_s, end_s)]: 10 s windows at DRIFT_STARTS that fit (`every`: at 0, every, 2·every,
    ... instead), and the last 10 s."""
    from avatarstream.eval.metrics import DRIFT_LEN, DRIFT_STARTS

    if seconds < DRIFT_LEN:
        raise ConfigError(f"--seconds must be at least {DRIFT_LEN:g} (one window)")
    if every is not None:
        if every < DRIFT_LEN:
            raise ConfigError(f"--every must be at least {DRIFT_LEN:g} s (windows do not overlap)")
        starts = [k * every for k in range(int((seconds - DRIFT_LEN) // every) + 1)]
        if len(starts) + 1 > MAX_WINDOWS:
            raise ConfigError(f"--every {every:g} over {seconds:g} s makes more than {MAX_WINDOWS} windows; "
                              "raise --every")
    else:
        starts = [s for s in DRIFT_STARTS if s + DRIFT_LEN <= seconds]
    out = [(s, s + DRIFT_LEN) for s in starts]
    last = seconds - DRIFT_LEN
    if last - out[-1][0] >= 1.0:
        out.append((last, seconds))
    return out


def srgb_to_lab(rgb: torch.Tensor) -> torch.Tensor:
    """[..., 3] sRGB in [0, 1] -> [..., 3] CIELAB (D65 white)."""
    lin = torch.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    m = torch.tensor([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
    xyz = lin @ m.T / torch.tensor([0.95047, 1.0, 1.08883])
    d = 6 / 29
    f = torch.where(xyz > d ** 3, xyz.clamp_min(1e-12) ** (1 / 3), xyz / (3 * d * d) + 4 / 29)
    return torch.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], -1)


def face_lab(frames: np.ndarray, states: np.ndarray, batch: int = 64) -> np.ndarray:
    """Mean CIELAB [3] of the face crops of frames [F, H, W, 3] uint8, located by the face-state
    track `states` [F, 10] (mouth x, y and face scale in canvas pixels, `eval.metrics.face_track`)."""
    from avatarstream.eval.experts import crop, face_box, to_canvas

    acc, n = torch.zeros(3, dtype=torch.float64), 0
    st = torch.from_numpy(np.asarray(states, np.float32))
    for i in range(0, len(frames), batch):
        x = to_canvas(frames[i:i + batch])
        s = st[i:i + batch]
        c = crop(x, *face_box(s[:, 0], s[:, 1], s[:, 2]), 64).clamp(0, 1)  # [N, 3, 64, 64]
        acc += srgb_to_lab(c.permute(0, 2, 3, 1)).reshape(-1, 3).double().sum(0)
        n += c.shape[0] * 64 * 64
    return (acc / max(n, 1)).numpy()


# ---------------------------------------------------------------------------------------------
# the streaming scorer


class WindowSink:
    """A sink that keeps only the frames inside the scoring windows (with the resident memory
    when each window completed, and how much of it is the frames this sink holds);
    `score()` evaluates them afterwards. `audio_of(lo, hi)` gives the samples of frames [lo, hi)."""

    def __init__(self, windows: list[tuple[float, float]], audio_of: Any, reference: np.ndarray,
                 experts: Any, fps: int = 25) -> None:
        self.spans = [(int(round(a * fps)), int(round(b * fps))) for a, b in windows]
        self.audio_of, self.reference, self.experts, self.fps = audio_of, reference, experts, fps
        self.durable_frames = 0
        self.done: list[tuple[int, int, np.ndarray, list[int], float, float]] = []
        self._frames: list[np.ndarray] = []
        self._starts: list[int] = []  # chunk starts inside the current window
        self._w = 0

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        pass

    def write_audio(self, chunk: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        self._frames.clear()

    def write_video(self, chunk: Any) -> None:
        start = int(chunk.start_frame)
        for i, frame in enumerate(chunk.frames):
            self._take(start + i, frame, chunk_start=(i == 0))
        self.durable_frames += int(chunk.frames.shape[0])

    def _take(self, idx: int, frame: np.ndarray, chunk_start: bool) -> None:
        if self._w >= len(self.spans):
            return
        lo, hi = self.spans[self._w]
        if lo <= idx < hi:
            if chunk_start:
                self._starts.append(idx - lo)
            self._frames.append(np.array(frame))
            if idx == hi - 1:
                frames = np.stack(self._frames)
                self._frames = []
                held = (sum(d[2].nbytes for d in self.done) + frames.nbytes) / 2**20
                self.done.append((lo, hi, frames, self._starts, rss_mb(), held))
                self._starts = []
                self._w += 1

    def score(self) -> list[dict[str, Any]]:
        """One row per completed window (`eval.metrics.evaluate` on its frames and audio)."""
        from avatarstream.eval.metrics import evaluate

        rows, lab0 = [], None
        for lo, hi, frames, starts, rss, held in self.done:
            ev = evaluate(frames, self.audio_of(lo, hi), self.reference, self.experts,
                          chunk_starts=[0, *starts] if starts else None, first_frame=lo)
            lab = face_lab(frames, ev.tracks["states"])
            lab0 = lab if lab0 is None else lab0
            m = ev.metrics
            rows.append({"start_s": lo / self.fps, "end_s": hi / self.fps, "face_sim": m["face_sim"],
                         "sync_c": m["sync_c"], "color_shift": float(np.linalg.norm(lab - lab0)),
                         "boundary_smoothness": m["boundary_smoothness"],
                         "seam_vs_cadence": m["seam_vs_cadence"], "latent_cadence": m["latent_cadence"],
                         "face_lab": [round(float(v), 3) for v in lab], "rss_mb": round(rss, 1),
                         "held_frames_mb": round(held, 1)})
        return rows


# ---------------------------------------------------------------------------------------------
# the case and one rollout


def _speech_clip(seed: int, speech_seconds: float) -> Any:
    from avatarstream.data import Clip, DatasetConfig, clip_specs

    specs = clip_specs(DatasetConfig(identities=1, clips_per_identity=2, seconds=speech_seconds, seed=seed,
                                     split="heldout-identity"))
    return Clip(specs[0])


def drift_reference(seed: int, size: int, ref_frames: int) -> np.ndarray:
    """The held-out case's reference clip: [F_r, S, S, 3] uint8 at `size`."""
    from avatarstream.data import Clip, DatasetConfig, clip_specs
    from avatarstream.media.reference import square_resize, usable_frame_count

    ref_s = max(1.0, ref_frames / 25.0)
    ref_spec = clip_specs(DatasetConfig(identities=1, clips_per_identity=2, seconds=ref_s, seed=seed,
                                        split="heldout-identity"))[1]
    ref = Clip(ref_spec).frames()
    k = usable_frame_count(min(len(ref), ref_frames))
    frames = torch.stack([square_resize(f, size) for f in ref[:k]])  # [k, 3, S, S]
    return frames.permute(0, 2, 3, 1).numpy()


def drift_case(seed: int, size: int, speech_seconds: float, ref_frames: int) -> tuple[np.ndarray, np.ndarray]:
    """(reference [F_r, S, S, 3] uint8 at `size`, speech [N] float32 16 kHz) of a held-out case."""
    speech = _speech_clip(seed, speech_seconds).audio.astype(np.float32)
    return drift_reference(seed, size, ref_frames), speech


def ground_truth(seed: int, size: int, speech_seconds: float, ref_frames: int) -> dict[str, float]:
    """FaceSim and Sync-C of the speech clip's own render (at most one window of it), scored
    against the same reference as the rollout."""
    from avatarstream.data.clip import FPS
    from avatarstream.eval.experts import load_experts
    from avatarstream.eval.metrics import DRIFT_LEN, evaluate
    from avatarstream.media.reference import square_resize

    clip = _speech_clip(seed, speech_seconds)
    speech = clip.audio.astype(np.float32)
    video = clip.frames()
    n = min(len(video), int(round(DRIFT_LEN * FPS)))
    frames = torch.stack([square_resize(f, size) for f in video[:n]]).permute(0, 2, 3, 1).numpy()
    spf = len(speech) // len(video)
    m = evaluate(frames, speech[: n * spf], drift_reference(seed, size, ref_frames), load_experts()).metrics
    return {"face_sim": m["face_sim"], "sync_c": m["sync_c"], "seconds": n / FPS}


def looped(speech: np.ndarray, samples: int, piece: int = 3200) -> Iterator[torch.Tensor]:
    """The speech repeated to `samples` samples, in pieces (never held whole)."""
    n, pos = len(speech), 0
    while pos < samples:
        a = pos % n
        take = min(piece, n - a, samples - pos)
        yield torch.from_numpy(speech[a:a + take].copy())
        pos += take


def looped_slice(speech: np.ndarray, lo: int, hi: int) -> np.ndarray:
    idx = np.arange(lo, hi) % len(speech)
    return speech[idx]


def rollout(model: str, strategy: str, seconds: float, seed: int, overrides: dict[str, Any],
            *, speech_seconds: float = 10.0, threads: int = 1, every: float | None = None) -> dict[str, Any]:
    """One unbroken generation of `seconds`, scored per window (runs in the calling process)."""
    from avatarstream.engine.pipeline import Pipeline
    from avatarstream.eval.experts import load_experts
    from avatarstream.registry import load_model

    torch.set_num_threads(max(1, threads))
    windows = drift_windows(seconds, every)
    models = load_model(model)
    cfg = models.config
    cfg.strategy = strategy
    for k, v in overrides.items():
        setattr(cfg, k, v)
    reference, speech = drift_case(seed, cfg.hr_size, speech_seconds, cfg.ref_pixel_frames)
    spf = cfg.sample_rate // cfg.fps
    sink = WindowSink(windows, lambda lo, hi: looped_slice(speech, lo * spf, hi * spf), reference,
                      load_experts(), fps=cfg.fps)
    total = int(round(seconds * cfg.sample_rate))
    rss0 = rss_mb()
    ref_t = torch.from_numpy(reference).permute(0, 3, 1, 2).contiguous()  # [F, 3, S, S]
    t0 = time.perf_counter()
    summary = Pipeline(models).run(ref_t, looped(speech, total), [sink])
    wall = time.perf_counter() - t0
    rows = sink.score()
    for r in rows:
        r["audio_phase_s"] = round((r["start_s"] * cfg.sample_rate) % len(speech) / cfg.sample_rate, 3)
    return {"windows": rows, "peak_rss_mb": round(summary.peak_rss_mb, 1),
            "rss_mb_start": round(rss0, 1), "rolling_state_bytes": summary.rolling_state_bytes,
            "fps": round(summary.fps, 2), "ttff_s": round(summary.ttff_s or 0.0, 3),
            "frames": summary.frames, "wall_s": round(wall, 1)}


def rollout_in_process(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """`rollout` in a fresh spawned process: its peak memory is its own."""
    with cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as ex:
        return ex.submit(rollout, *args, **kwargs).result()


def _change(rows: list[dict[str, Any]], key: str) -> float | None:
    a, b = rows[0].get(key), rows[-1].get(key)
    if a is None or b is None or a == 0:
        return None
    return round((b - a) / abs(a), 4)


def _spread(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]] | None:
    """Mean and standard deviation over the windows of FaceSim and Sync-C (3 windows or more):
    the scale a window-to-window change is read against."""
    if len(rows) < 3:
        return None
    return {k: {"mean": round(float(np.mean([r[k] for r in rows])), 4),
                "std": round(float(np.std([r[k] for r in rows], ddof=1)), 4)} for k in ("face_sim", "sync_c")}


def run(args: argparse.Namespace) -> dict:
    from avatarstream.registry import model_spec_for, resolve_model

    args.model = resolve_model(getattr(args, "model", None), causal=True)
    if args.no_history_corrupt_model is not None:
        resolve_model(args.no_history_corrupt_model)
    drift_windows(args.seconds, args.every)  # validates --seconds, --every
    if args.speech_seconds < 2:
        raise ConfigError("--speech-seconds must be at least 2")
    kw = {"speech_seconds": args.speech_seconds, "threads": args.threads, "every": args.every}
    full = rollout_in_process(args.model, "causal", args.seconds, args.seed, {}, **kw)
    out: dict[str, Any] = {
        "windows": [{k: r[k] for k in ("start_s", "end_s", "face_sim", "sync_c", "color_shift")}
                    for r in full["windows"]],
        "peak_rss_mb": full["peak_rss_mb"],
        "model": args.model, "seconds": args.seconds, "seed": args.seed,
        "color_measure": COLOR_MEASURE,
        "face_sim_change": _change(full["windows"], "face_sim"),
        "sync_c_change": _change(full["windows"], "sync_c"),
        "window_spread": _spread(full["windows"]),
        "rss_mb_by_window": [r["rss_mb"] for r in full["windows"]],
        # resident memory less the window frames this benchmark holds: the engine's own
        "engine_rss_mb_by_window": [round(r["rss_mb"] - r["held_frames_mb"], 1) for r in full["windows"]],
        "rolling_state_bytes": full["rolling_state_bytes"],
        "fps": full["fps"], "ttff_s": full["ttff_s"], "wall_s": full["wall_s"],
        "detail": full["windows"],
    }
    pipe = model_spec_for(args.model).pipeline()
    out["ground_truth"] = ground_truth(args.seed, pipe.hr_size, args.speech_seconds, pipe.ref_pixel_frames)
    if not args.no_ablations:
        abl: dict[str, Any] = {}
        for name, over in ablations_for(args.model).items():
            r = rollout_in_process(args.model, "causal", args.seconds, args.seed, over, **kw)
            abl[name] = {"windows": [{k: w[k] for k in ("start_s", "end_s", "face_sim", "sync_c", "color_shift")}
                                     for w in r["windows"]], "peak_rss_mb": r["peak_rss_mb"]}
        if args.no_history_corrupt_model:
            r = rollout_in_process(args.no_history_corrupt_model, "causal", args.seconds, args.seed, {}, **kw)
            abl["no_history_corrupt"] = {"windows": [{k: w[k] for k in ("start_s", "end_s", "face_sim", "sync_c",
                                                                          "color_shift")} for w in r["windows"]],
                                         "peak_rss_mb": r["peak_rss_mb"]}
        else:
            abl["no_history_corrupt"] = {"windows": None, "unavailable":
                                         "History Corrupt is a training switch: pass "
                                         "--no-history-corrupt-model NAME (a causal model trained "
                                         "with dmd.history_corrupt = 0)"}
        out["ablations"] = abl
    return out
