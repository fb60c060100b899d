"""`bench sessions`: how many live sessions this machine keeps in real time with one model.

For n = 1, 2, ... it opens n LiveSessions on one shared ChunkScheduler (the server's code path:
batched chunk work, idle frames, the WebRTC VP8 encode of every frame on its own thread), makes
them all talk at once, and checks over `--seconds` that every session keeps up with the wall
clock: no frame is published later than the WebRTC playout would show it (the timeline's lag
behind the wall clock stays under the server's playout delay) and the lag does not grow (its
peaks in the second half of the window are within 0.1 s of those in the first half: the lag is
a saw tooth of one chunk, so peaks are compared, not end points).
`max_realtime_sessions` is the largest n that passed. Chunks are the server's (`serve
--seconds-per-chunk`; default the model's own, at most 0.8 s = 5 latent frames); `chunk` in the
output says how many latent frames. Also reported per n: speech
time-to-first-frame (from the text arriving to the first speech frame being shown by a WebRTC
playout with the server's playout delay), batch sizes, and the capacity the server's start-up
calibration predicts.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

HELP = "concurrent live sessions in real time on one model: max_realtime_sessions, ttff per n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model name (default: the registry's default, the bundled model once it ships)")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per n")
    parser.add_argument("--max", type=int, default=16, help="largest n tried")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (model default)")
    parser.add_argument("--seconds-per-chunk", type=float, default=None,
                        help="chunk length in seconds of video (default: the server's: the model's own, at most 0.8)")
    parser.add_argument("--no-encode", action="store_true", help="skip the VP8 encode load")
    parser.add_argument("--no-batching", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")


class _VP8Sink:
    """Encodes every published frame with WebRTC's VP8 encoder (the server's per-viewer cost)."""

    durable_frames = 0

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        from aiortc.codecs.vpx import Vp8Encoder

        self.enc = Vp8Encoder()

    def write_video(self, chunk) -> None:  # type: ignore[no-untyped-def]
        from fractions import Fraction

        import av

        for i, rgb in enumerate(chunk.frames):
            f = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            f.pts, f.time_base = (chunk.start_frame + i) * 3600, Fraction(1, 90000)
            self.enc.encode(f)
            self.durable_frames += 1

    def write_audio(self, chunk) -> None:  # type: ignore[no-untyped-def]
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _trial(models, prepared, frames, n: int, args: argparse.Namespace, delay: float) -> dict:  # type: ignore[no-untyped-def]
    from avatarstream.bench.inputs import speechlike
    from avatarstream.live.scheduler import ChunkScheduler
    from avatarstream.live.session import LiveSession, LiveSessionConfig
    from avatarstream.live.sinks import BackgroundSink

    c = models.config
    sched = ChunkScheduler(models, batching=not args.no_batching)
    sched.start()
    cfg = LiveSessionConfig(idle_timeout_s=None, max_out_items=0)
    speech = speechlike(args.seconds + 10.0, c.sample_rate, seed=1)
    sessions = []
    for _ in range(n):
        sinks = [] if args.no_encode else [BackgroundSink(_VP8Sink(), max_queued=256)]
        s = LiveSession(models, frames, prepared=prepared, config=cfg, sinks=sinks, scheduler=sched)
        s.start()
        sessions.append(s)
    time.sleep(0.5)  # idle a moment, as a session does before its first words
    said = []
    for s in sessions:
        said.append(time.monotonic())
        s.say(speech)
    ttff = [None] * n
    warm = time.monotonic() + 1.5
    t_start = None
    lags: list[list[tuple[float, float]]] = [[] for _ in range(n)]  # (time in window, lag)
    start_frames: list[int] = []
    while True:
        now = time.monotonic()
        for i, s in enumerate(sessions):
            ev = next((e for e in s.events if e["type"] == "speech_started"), None)
            if ttff[i] is None and ev is not None and s.frame > ev["frame"]:
                shown = s.origin + ev["media_s"] + delay  # the playout shows it then at best
                ttff[i] = max(now, shown) - said[i]
            if t_start is not None:
                lags[i].append((now - t_start, sched.lag_s(s)))
        if t_start is None and now >= warm:
            t_start = now
            start_frames = [s.frame for s in sessions]
        if t_start is not None and now >= t_start + args.seconds:
            break
        time.sleep(0.02)
    wall = time.monotonic() - t_start
    end_frames = [s.frame for s in sessions]
    sched.stop()
    half = args.seconds / 2
    max_lag = [max(lag for _, lag in ls) for ls in lags]
    growth = [max(lag for t, lag in ls if t >= half) - max(lag for t, lag in ls if t < half)
              for ls in lags]
    rate = [(e - b) / c.fps / wall for b, e in zip(start_frames, end_frames)]
    ok = max(max_lag) <= delay and max(growth) <= 0.1
    done = [t for t in ttff if t is not None]
    return {
        "sessions": n, "realtime": ok, "min_rate": round(min(rate), 3),
        "max_lag_growth_s": round(max(growth), 3), "max_lag_s": round(max(max_lag), 3),
        "ttff_s": round(float(np.mean(done)), 3) if done else None,
        "ttff_max_s": round(max(done), 3) if done else None,
        "batch_sizes": dict(sched.stats.batch_sizes),
        "busy_share": round(sched.stats.busy_s / max(1e-9, wall + 2.0), 3),
    }


def run(args: argparse.Namespace) -> dict:
    from avatarstream.registry import resolve_model

    args.model = resolve_model(getattr(args, "model", None))
    from avatarstream.bench.inputs import face_image
    from avatarstream.registry import load_model
    from avatarstream.serve.app import playout_delay
    from avatarstream.live.prepared import prepare_reference
    from avatarstream.live.capacity import calibrate

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        import aiortc  # noqa: F401
    except ImportError:  # no WebRTC installed: measure without the encode load
        args.no_encode = True
    models = load_model(args.model)
    c = models.config
    if args.steps:
        c.steps = args.steps
    from avatarstream.serve.app import live_chunk

    c.chunk = live_chunk(c, args.seconds_per_chunk)
    frames = torch.from_numpy(face_image(c.hr_size)).permute(2, 0, 1).unsqueeze(0)  # [1,3,H,W]
    prepared = prepare_reference(models, frames)
    cap = calibrate(models, prepared)
    delay = playout_delay(models, cap.step_base_s + cap.step_per_session_s, 0.3)
    trials, best = [], 0
    for n in range(1, args.max + 1):
        t = _trial(models, prepared, frames, n, args, delay)
        trials.append(t)
        if not t["realtime"]:
            break
        best = n
    first = trials[0]
    return {
        "model": args.model, "steps": c.steps, "resolution": c.hr_size, "chunk": c.chunk,
        "threads": torch.get_num_threads(), "encode": not args.no_encode,
        "batching": not args.no_batching,
        "max_realtime_sessions": best,
        "ttff_s": first["ttff_s"], "playout_delay_s": delay,
        "predicted_max_sessions": cap.max_sessions, "capacity": cap.as_dict(),
        "trials": trials,
    }
