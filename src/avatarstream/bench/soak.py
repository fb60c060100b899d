"""`avatarstream bench soak --minutes M`: does a live session hold for M minutes, and a file render?

Live (bench/soak_live.py): a real `avatarstream serve` process on loopback (one session admitted:
`--max-sessions 1`, so a machine the server would judge too slow is measured, not refused) and an
aiortc client in this process that receives the WebRTC tracks as a browser would and streams a
microphone-like track over the session's WebSocket at real time: `--pause` seconds of silence,
then `--talk` seconds of speech, repeated for M minutes. File (bench/soak_file.py):
`avatarstream generate` on the same M minutes of audio, then the MP4 read back.

Speech: `--speech FILE`, else the built-in TTS (media/tts.py, espeak-ng) reading a paragraph,
else (no TTS engine installed) synthetic speech-like sound; each utterance is the next `--talk`
seconds of it. Reference: `--reference`, else examples/reference.png when run from the
repository, else a synthetic face.

Per minute and overall (the modules' docstrings say how each is measured): A/V offset, dropped
and duplicated frames, RSS of the server (live) or of generate (file), time to first frame after
each pause, frames vs expected. `pass` applies the issue's criteria: |A/V offset| <= 40 ms in
every minute, RSS growth <= 2 % from minute 5 to the last (None: the run has no minute after 5).
Nothing is interactive; everything lives in a temporary folder removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import numpy as np

from avatarstream.bench.soak_measure import SpeechTrack, speech_track
from avatarstream.errors import ConfigError, InputError

HELP = ("an M-minute live session over WebRTC with speech and pauses, and an M-minute file render: "
        "A/V offset, dropped/duplicated frames, RSS per minute, ttff after each pause")
MAX_AV_OFFSET_MS = 40.0
MAX_RSS_GROWTH_PCT = 2.0
EXAMPLE_REFERENCE = Path("examples/reference.png")
TEXT = ("The quick brown fox jumps over the lazy dog. A live avatar speaks for an hour, and its lips "
        "should stay with its voice the whole time. Every minute we measure the offset between sound "
        "and picture, the memory of the server, and how quickly the face starts talking after a pause. "
        "Then it rests for a moment, listening, before the next sentence begins.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=60.0,
                   help="length of the live session and of the rendered audio (default 60; fractions allowed)")
    p.add_argument("--model", default=None, help="model name (default: the registry's default, the bundled model)")
    p.add_argument("--talk", type=float, default=20.0, help="seconds of each utterance (default 20)")
    p.add_argument("--pause", type=float, default=10.0, help="seconds of silence before each utterance (default 10)")
    p.add_argument("--speech", default=None, metavar="FILE", help="speech to cut the utterances from (default: TTS)")
    p.add_argument("--reference", default=None, metavar="IMAGE",
                   help="avatar image (default: examples/reference.png, else a synthetic face)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of the server and of generate (default: their own)")
    p.add_argument("--only", choices=["live", "file"], default=None, help="run one part (default: both)")


def _check(args: argparse.Namespace) -> None:
    """The user's mistakes, before anything is started."""
    if not args.minutes > 0:
        raise ConfigError("--minutes must be positive")
    if not args.talk > 0 or not args.pause > 0:
        raise ConfigError("--talk and --pause must be positive (seconds)")
    if args.threads is not None and args.threads < 1:
        raise ConfigError("--threads must be at least 1")
    for what, path in (("--speech", args.speech), ("--reference", args.reference)):
        if path is not None and not Path(path).is_file():
            raise InputError(f"{what} {path}: no such file")
    if args.only != "file":
        from avatarstream.serve.webrtc import require_aiortc

        require_aiortc()


def _speech(args: argparse.Namespace) -> tuple[np.ndarray, str]:
    if args.speech is not None:
        from avatarstream.media.audio import read_all

        x = read_all(args.speech)
        if not np.abs(x).max(initial=0.0) > 0.01:
            raise InputError(f"--speech {args.speech}: no speech in it (silent)")
        return x, f"file:{args.speech}"
    try:
        from avatarstream.media.tts import DEFAULT_VOICE, TextToSpeech

        return TextToSpeech().speak(TEXT), f"tts:{DEFAULT_VOICE}"
    except Exception:  # noqa: BLE001 - no TTS engine here: speech-like sound still exercises it all
        from avatarstream.media.synthetic import speechlike

        return speechlike(60.0, seed=3), "synthetic"


def _reference(args: argparse.Namespace, folder: Path, size: int) -> tuple[Path, str]:
    """The avatar image and what to call it in the JSON."""
    if args.reference is not None:
        return Path(args.reference), args.reference
    if EXAMPLE_REFERENCE.is_file():
        return EXAMPLE_REFERENCE, str(EXAMPLE_REFERENCE)
    from avatarstream.bench.inputs import face_image, write_png

    return write_png(folder / "reference.png", face_image(size)), "synthetic"


def _live(args: argparse.Namespace, model: str, reference: Path, track: SpeechTrack, folder: Path) -> dict:
    import aiohttp

    from avatarstream.bench.soak_live import drive, report
    from avatarstream.serve.client import ServerProcess

    seconds = track.samples.size / track.sample_rate
    # --threads 0 means the server's own default; the one session is admitted even on a machine
    # the server would call too slow, so that machine's lateness is measured rather than refused
    with ServerProcess(folder / "serve", model=model, threads=args.threads or 0,
                       args=("--max-sessions", "1"), timeout=900) as server:
        try:
            rec, log = asyncio.run(drive(server.url, server.proc.pid, reference, track))
        except (InputError, OSError, aiohttp.ClientError) as e:  # the server's own words, kept
            # before its folder is removed
            tail = server.log.read_text(errors="replace").strip().splitlines()[-5:]
            raise InputError(f"the live session failed: {e}\nserver log:\n" + "\n".join(tail)) from e
    return report(rec, log, seconds)


def _file(args: argparse.Namespace, model: str, reference: Path, track: SpeechTrack, fps: int,
          folder: Path) -> dict:
    from avatarstream.bench.inputs import write_wav
    from avatarstream.bench.soak_file import render, report

    seconds = track.samples.size / track.sample_rate
    wav = write_wav(folder / "track.wav", track.samples, track.sample_rate)
    out = folder / "render.mp4"
    summary, media, rss, wall = render(model, reference, wav, out, seconds=seconds,
                                       threads=args.threads, fps=fps)
    return report(summary, media, rss, wall, out, track.samples, track.sample_rate)


def verdict(live: dict | None, file: dict | None) -> dict:
    """The issue's criteria per part: True / False, None where not measured (a part not run, or
    no minute after minute 5); `all`: every measured criterion holds."""
    out: dict[str, bool | None] = {}
    for name, part in (("live", live), ("file", file)):
        offsets = [] if part is None else [m["av_offset_ms"] for m in part["per_minute"]]
        out[f"{name}_av_offset"] = None if part is None else all(
            o is not None and abs(o) <= MAX_AV_OFFSET_MS for o in offsets)
        growth = None if part is None else part["rss_growth_pct_5_to_end"]
        out[f"{name}_rss_growth"] = None if growth is None else bool(growth <= MAX_RSS_GROWTH_PCT)
    if file is not None:
        out["file_frames"] = file["frames"] == file["expected_frames"]
    measured = [v for v in out.values() if v is not None]
    out["all"] = bool(measured) and all(measured)
    return out


def run(args: argparse.Namespace) -> dict:
    from avatarstream.live.session import LiveSessionConfig
    from avatarstream.registry import model_spec_for, resolve_model

    _check(args)
    model = resolve_model(args.model)
    pipe = model_spec_for(model).pipeline()
    speech, source = _speech(args)
    track = speech_track(args.minutes, args.talk, args.pause, speech, source,
                         silence_rms=LiveSessionConfig.silence_rms, sample_rate=pipe.sample_rate)
    with tempfile.TemporaryDirectory(prefix="avatarstream-soak-") as d:
        folder = Path(d)
        reference, reference_name = _reference(args, folder, max(pipe.out_hw))
        live = None if args.only == "file" else _live(args, model, reference, track, folder)
        file = None if args.only == "live" else _file(args, model, reference, track, pipe.fps, folder)
    return {
        "minutes": args.minutes, "model": model, "talk_s": args.talk, "pause_s": args.pause,
        "speech": source, "reference": reference_name, "threads": args.threads,
        "live": live, "file": file, "pass": verdict(live, file),
        "criteria": {"max_av_offset_ms": MAX_AV_OFFSET_MS, "max_rss_growth_pct_5_to_end": MAX_RSS_GROWTH_PCT},
    }
