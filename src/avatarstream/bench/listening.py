"""`bench listening`: does the avatar listen with a closed mouth, and turn to speaking and back
without a visible jump?

One in-process live session (the server's code path: a LiveSession on a ChunkScheduler, chunks
as `serve` runs them) goes idle -> listening -> speech -> listening -> speech -> listening, in
real time, driven as an agent stack drives it (`listen(True/False)`, `say`). The speech is the
driving audio of a held-out synthetic case (`eval benchmark`'s first heldout-identity case for
`--seed`), split in two utterances; the reference is that case's reference clip, so the ground
truth of the same person exists. Every published frame is kept with its state (idle, listening,
speech: from the session's events) and the chunks it came in.

Reported:
- `mouth`: the face-state expert's mouth opening (0 closed .. 1 widest) on the steady listening
  frames (`listening`: mean, p95, max) against the same reading on the ground truth's silent
  frames (`silence`: min, p5, p50, p95, max over both clips of the case's person, silence as
  `eval` defines it; the expert's reading of a closed mouth depends on the scene, so both scenes
  count) and on the speech frames (`speech`, for scale); `in_silence_range`: share of listening
  frames within the silence min..max; `ok`: the listening max is at most the silence max.
- `seams`: the eval seam measure (`frame_changes`: mean absolute grey change into a frame, 0-255,
  on the 128x128 canvas) at every switch between listening/idle and speech (`switches`, each
  with its kind and frame; `change`: the largest over the switch's transition, the ease into the
  first model frame or the dissolve out of the last; `at_switch`: into the switch frame itself),
  against the model's ordinary chunk seams inside speech in the same
  run (`chunk`: p50, p95, max, count); `ok`: no switch above the largest chunk seam.
- `motion`: idle vs steady listening: mean frame change, mean deviation from the still
  reference (same grey measure), the expert's head pitch range (p95 - p5, degrees: the nods);
  `change_ratio` / `deviation_ratio`: listening over idle (attentive motion is there when > 1).
- `speech_start_delay_s`: media time from the `say` call's frame to the first speech frame: the
  session's `ease_s` (the ease into speech), plus idle frames already published meanwhile.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import numpy as np
import torch

from avatarstream.errors import InputError

HELP = "listening: mouth opening vs ground-truth silence, seams at listening<->speech vs chunk seams"
SETTLE_S = 0.4  # frames this close after a state change are not steady (the blend)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="model name (default: the registry's default, the bundled model once it ships)")
    parser.add_argument("--listen-s", type=float, default=3.0, help="seconds of each listening turn")
    parser.add_argument("--speech-s", type=float, default=4.0, help="seconds of each utterance")
    parser.add_argument("--idle-s", type=float, default=1.0, help="seconds idle at the start")
    parser.add_argument("--seed", type=int, default=0, help="draw of the held-out case")
    parser.add_argument("--seconds-per-chunk", type=float, default=None,
                        help="chunk length in seconds of video (default: the server's)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")


class _Recorder:
    """Sink: every frame by index, and the start frame of every video write (a chunk)."""

    durable_frames = 0

    def __init__(self) -> None:
        self.frames: dict[int, np.ndarray] = {}
        self.writes: list[int] = []

    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        pass

    def write_video(self, chunk) -> None:  # type: ignore[no-untyped-def]
        self.writes.append(int(chunk.start_frame))
        for i, f in enumerate(chunk.frames):
            self.frames[chunk.start_frame + i] = f

    def write_audio(self, chunk) -> None:  # type: ignore[no-untyped-def]
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _pct(x: np.ndarray, keys: dict[str, float]) -> dict[str, float | None]:
    x = np.asarray(x, np.float64)
    return {k: (round(float(np.percentile(x, q)), 4) if x.size else None) for k, q in keys.items()}


def _drive(session: Any, speech: list[np.ndarray], args: argparse.Namespace) -> list[int]:
    """The conversation, in real time; returns the session's frame at each `say`."""
    def spoken(n: int) -> bool:  # the n-th utterance played out (a pause may split it)
        ev = [e["type"] for e in session.events]
        return (ev.count("speech_ended") >= n and ev.count("speech_ended") == ev.count("speech_started")
                and not session.talking and session.buffered_seconds == 0)

    def wait_ended(n: int) -> None:
        deadline = time.monotonic() + 600
        while not spoken(n):
            if not session.running or time.monotonic() > deadline:
                raise RuntimeError(f"the session did not finish utterance {n}: {session.error}")
            time.sleep(0.01)

    said = []
    time.sleep(args.idle_s)
    for i, utt in enumerate(speech):
        session.listen(True)
        time.sleep(args.listen_s)
        session.listen(False)  # the user stops; the agent answers at once
        said.append(session.frame)
        session.say(utt)
        wait_ended(i + 1)
    session.listen(True)
    time.sleep(args.listen_s)
    return said


def _states(n: int, events: list[dict], fps: int, ease: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """Per frame 0 idle / 1 listening / 2 speech / 3 easing into speech (the `ease` frames
    before a segment's first), and the speech segments (start, end)."""
    state = np.zeros(n, np.int8)
    on = None
    for e in events:
        if e["type"] == "listening":
            f = int(round(e["media_s"] * fps))
            if e["on"]:
                on = f
            elif on is not None:
                state[on:f] = 1
                on = None
    if on is not None:
        state[on:] = 1
    starts = [e["frame"] for e in events if e["type"] == "speech_started"]
    ends = [e["frame"] for e in events if e["type"] == "speech_ended"]
    segments = list(zip(starts, ends))
    for a, _ in segments:
        state[max(0, a - ease):a] = 3
    for a, b in segments:
        state[a:b] = 2
    return state, segments


def run(args: argparse.Namespace) -> dict:
    from avatarstream.registry import load_model, resolve_model

    if not (0.5 <= args.listen_s <= 60 and 0.5 <= args.speech_s <= 60 and 0 <= args.idle_s <= 60):
        raise InputError("--listen-s and --speech-s must be 0.5..60 seconds, --idle-s 0..60")
    args.model = resolve_model(args.model)
    from avatarstream.eval.benchmark import make_cases
    from avatarstream.eval.experts import load_experts
    from avatarstream.eval.metrics import (MOUTH_CLOSED, face_track, frame_changes, frame_energy_db,
                                           silent_frames)
    from avatarstream.data import Clip
    from avatarstream.live.session import LiveSession, LiveSessionConfig
    from avatarstream.media.reference import square_resize, usable_frame_count
    from avatarstream.serve.app import live_chunk

    torch.set_num_threads(max(1, args.threads))
    models = load_model(args.model)
    c = models.config
    c.chunk = live_chunk(c, args.seconds_per_chunk)
    case = make_cases("heldout-identity", seconds=2 * args.speech_s + 2.0, clips=1, seed=args.seed)[0]
    k = usable_frame_count(min(len(case.reference), c.ref_pixel_frames))
    ref = torch.stack([square_resize(f, c.hr_size) for f in case.reference[:k]])  # [k, 3, S, S]
    # two utterances from the speech's onset (a session drops leading silence anyway)
    loud = np.flatnonzero(frame_energy_db(case.clip.audio, len(case.gt)) > -45.0)
    onset = max(0, int(loud[0]) - 2) * (c.sample_rate // c.fps) if loud.size else 0
    n_utt = round(args.speech_s * c.sample_rate)
    speech = [case.clip.audio[onset + i * n_utt:onset + (i + 1) * n_utt].copy() for i in range(2)]

    rec = _Recorder()
    session = LiveSession(models, ref, sinks=[rec],
                          config=LiveSessionConfig(idle_timeout_s=None, max_out_items=0))
    session.start()
    error: list[BaseException] = []

    def drive() -> None:
        try:
            said.extend(_drive(session, speech, args))
        except BaseException as e:  # noqa: BLE001 - reported below
            error.append(e)

    said: list[int] = []
    t = threading.Thread(target=drive, daemon=True)
    t.start()
    t.join()
    session.stop()
    if error:
        raise error[0]
    if session.error is not None:
        raise session.error
    n = min(len(rec.frames), session.frame)
    frames = np.stack([rec.frames[i] for i in range(n)])
    events = list(session.events)
    ease = round(session.config.ease_s * c.fps)
    blend = session.idle.blend
    state, segments = _states(n, events, c.fps, ease)
    # steady frames: SETTLE_S after any change of state
    change_at = np.flatnonzero(np.diff(state)) + 1
    settle = round(SETTLE_S * c.fps)
    steady = np.ones(n, bool)
    for f in change_at:
        steady[f:f + settle] = False
    steady[:settle] = False

    ex = load_experts()
    track = face_track(frames, ex)
    opening, pitch = track.states[:, 7], track.states[:, 4]
    silence = []
    for clip_frames, audio in ((case.gt, case.clip.audio), (case.reference, Clip(case.ref_spec).audio)):
        sil = silent_frames(audio, len(clip_frames))
        if sil.any():
            silence.append(face_track(clip_frames[sil], ex).states[:, 7])
    sil_open = np.concatenate(silence) if silence else np.zeros(0)
    listening = (state == 1) & steady
    idle = (state == 0) & steady
    lo_, hi_ = (float(sil_open.min()), float(sil_open.max())) if sil_open.size else (None, None)
    lis_open = opening[listening]
    mouth = {
        "listening": {"mean": round(float(lis_open.mean()), 4) if lis_open.size else None,
                      **_pct(lis_open, {"p95": 95, "max": 100}), "frames": int(lis_open.size)},
        "silence": {**_pct(sil_open, {"min": 0, "p5": 5, "p50": 50, "p95": 95, "max": 100}),
                    "frames": int(sil_open.size)},
        "speech": _pct(opening[state == 2], {"p50": 50, "p95": 95}),
        "closed_below": MOUTH_CLOSED,
        "in_silence_range": (round(float(((lis_open >= lo_) & (lis_open <= hi_)).mean()), 3)
                             if lis_open.size and lo_ is not None else None),
        "ok": bool(lis_open.size and hi_ is not None and lis_open.max() <= hi_),
    }

    changes = frame_changes(frames)
    starts = {a for a, _ in segments}
    chunk_seams = [f for f in sorted(set(rec.writes)) if 0 < f < n and state[f] == 2
                   and state[f - 1] == 2 and f not in starts]
    # a switch's seam: the largest change over its transition (the ease into the first model
    # frame; the dissolve out of the last one), and the change at the switch frame itself
    switches = []
    for a, b in segments:
        if 0 < a < n:
            before = _NAMES[state[max(0, a - ease - 1)]]
            switches.append({"kind": f"{before}->speech", "frame": int(a),
                             "change": round(float(changes[max(1, a - ease):a + 1].max()), 3),
                             "at_switch": round(float(changes[a]), 3)})
        if 0 < b < n:
            after = "speech" if state[b] == 3 else _NAMES[state[min(n - 1, b + blend)]]
            switches.append({"kind": f"speech->{after}", "frame": int(b),
                             "change": round(float(changes[b:b + blend + 1].max()), 3),
                             "at_switch": round(float(changes[b]), 3)})
    chunk = changes[chunk_seams] if chunk_seams else np.zeros(0)
    sw = np.array([s["change"] for s in switches])
    seams = {"chunk": {**_pct(chunk, {"p50": 50, "p95": 95, "max": 100}), "count": int(chunk.size)},
             "switches": switches,
             "switch_max": round(float(sw.max()), 3) if sw.size else None,
             "inside_speech_p50": _pct(changes[(state == 2) & np.r_[False, state[1:] == state[:-1]]],
                                       {"p50": 50})["p50"],
             "ok": bool(sw.size and chunk.size and sw.max() <= chunk.max())}

    still = session.idle.image  # [1, 3, S, S] in [-1, 1]: the reference frame it animates
    still_u8 = ((still[0].permute(1, 2, 0) + 1) * 127.5).round().to(torch.uint8).numpy()
    deviation = _grey128(frames) - _grey128(still_u8[None])  # [N, 128, 128]
    deviation = np.abs(deviation).mean((1, 2))

    def motion(sel: np.ndarray) -> dict[str, Any]:
        return {"frames": int(sel.sum()),
                "change_mean": round(float(changes[sel].mean()), 4) if sel.any() else None,
                "deviation_mean": round(float(deviation[sel].mean()), 4) if sel.any() else None,
                "pitch_range_deg": (round(float(np.percentile(pitch[sel], 95) - np.percentile(pitch[sel], 5)), 3)
                                    if sel.any() else None)}

    mi, ml = motion(idle), motion(listening)
    def ratio(key: str) -> float | None:
        return round(ml[key] / mi[key], 3) if mi[key] and ml[key] is not None else None

    delays = [round((next(a for a, _ in segments if a >= s) - s) / c.fps, 3) for s in said
              if any(a >= s for a, _ in segments)]
    return {
        "model": args.model, "resolution": c.hr_size, "chunk": c.chunk, "seed": args.seed,
        "threads": torch.get_num_threads(), "frames": n,
        "state_frames": {"idle": int((state == 0).sum()), "listening": int((state == 1).sum()),
                         "speech": int((state == 2).sum()), "ease": int((state == 3).sum())},
        "mouth": mouth, "seams": seams,
        "motion": {"idle": mi, "listening": ml, "change_ratio": ratio("change_mean"),
                   "deviation_ratio": ratio("deviation_mean")},
        "speech_start_delay_s": delays,
        "ease_s": session.config.ease_s,
    }


_NAMES = {0: "idle", 1: "listening", 2: "speech", 3: "ease"}


def _grey128(frames: np.ndarray) -> np.ndarray:
    """[N, H, W, 3] uint8 -> [N, 128, 128] grey 0-255 on eval's canvas (as `frame_changes`)."""
    import torch.nn.functional as F

    from avatarstream.eval.experts import grey, to_canvas

    out = [grey(F.interpolate(to_canvas(frames[i:i + 64]), size=(128, 128), mode="area"))[:, 0] * 255
           for i in range(0, len(frames), 64)]
    return torch.cat(out).numpy()
