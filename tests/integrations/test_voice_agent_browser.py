"""The voice agent example (examples/voice_agent) end to end: a real Chromium (Debian's, driven by
Playwright) whose microphone is a WAV file of espeak-ng speech, talking over Pipecat's
SmallWebRTCTransport to the agent (PocketSphinx, Silero VAD, the rule-based stand-in LLM, espeak-ng,
our avatar on tiny-random) in its own process.

Checks: while the user speaks the avatar listens (frames keep coming, no speech, the mouth
still); then it answers (its speech reaches the page, the mouth region changes while it
speaks); the second utterance, spoken while it answers, interrupts it (its speech stops within
a chunk); and per sentence, the offset between the marker tone as WebRTC plays it out and the
marked video frame as displayed (the agent runs with --beep)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests.serve.test_browser import CHROMIUM, FLAGS, _playwright

ROOT = Path(__file__).resolve().parents[2]
AGENT = ROOT / "examples" / "voice_agent" / "agent.py"
RATE = 48000
# The microphone's WAV (Chromium loops it): silence while the page connects, a request, a pause
# for the answer, a second request while the avatar still answers (it interrupts), a long pause.
SCRIPT = [(3.0, "Tell me a story please."), (4.5, "Wait, tell me another one."), (12.0, None)]

pytestmark = [pytest.mark.slow]
pytest.importorskip("pipecat", reason="the pipecat extra is not installed")
pytest.importorskip("pocketsphinx", reason="the voice agent example needs pocketsphinx")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _microphone(path: Path, tmp: Path) -> list[tuple[float, float]]:
    """Write the script as a 48 kHz mono WAV; returns each utterance's (start, end) in seconds."""
    import soundfile as sf
    import soxr

    parts, spans, t = [], [], 0.0
    for pause, text in SCRIPT:
        parts.append(np.zeros(int(pause * RATE), np.float32))
        t += pause
        if text is None:
            continue
        wav = tmp / f"u{len(spans)}.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "150", "-w", str(wav), text], check=True)
        x, sr = sf.read(wav, dtype="float32")
        x = soxr.resample(x, sr, RATE).astype(np.float32)
        x *= 0.5 / max(float(np.abs(x).max()), 1e-6)
        parts.append(x)
        spans.append((t, t + x.size / RATE))
        t += x.size / RATE
    sf.write(path, np.concatenate(parts), RATE, subtype="PCM_16")
    return spans


def _state(url: str) -> dict:
    with urllib.request.urlopen(url + "/api/state", timeout=5) as r:
        return json.loads(r.read())


@pytest.mark.timeout(150)
def test_conversation_in_chromium(tmp_path):
    sync_playwright = _playwright()
    if not shutil.which("espeak-ng"):
        pytest.skip("espeak-ng is not installed")
    mic = tmp_path / "mic.wav"
    _microphone(mic, tmp_path)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logf = open(tmp_path / "agent.log", "w")
    agent = subprocess.Popen([sys.executable, str(AGENT), "--model", "tiny-random", "--steps", "1",
                              "--port", str(port), "--beep"], stdout=logf, stderr=subprocess.STDOUT,
                             env=env, cwd=ROOT)
    t0 = time.monotonic()
    try:
        deadline = time.monotonic() + 60
        while True:
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()[-3000:]
            try:
                _state(url)
                break
            except OSError:
                assert time.monotonic() < deadline, "the agent did not start"
                time.sleep(0.3)
        started = time.monotonic() - t0
        flags = FLAGS + ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                         f"--use-file-for-fake-audio-capture={mic}"]
        with sync_playwright() as p:
            ctx = p.chromium.launch_persistent_context(str(tmp_path / "profile"), headless=True,
                                                       executable_path=CHROMIUM, args=flags)
            try:
                page = ctx.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda e: errors.append(str(e)))
                page.goto(url + "/")
                page.click("#start")
                page.wait_for_function("window.av.connected && window.av.frames > 10", timeout=30_000)
                connected = time.monotonic()
                polls = []  # (wall, listening, frames_out, speech frames so far)
                while time.monotonic() - connected < 55:
                    s = _state(url)
                    polls.append((s["now"], s["listening"], s["frames_out"], len(s["speech_frames"])))
                    if (len(page.evaluate("window.av.offsets")) >= 20
                            and sum(e["type"] == "interruption" for e in s["events"]) >= 1):
                        break
                    time.sleep(0.25)
                av = page.evaluate("window.av")
            finally:
                ctx.close()
        state = _state(url)
    finally:
        agent.terminate()
        try:
            agent.wait(15)
        except subprocess.TimeoutExpired:
            agent.kill()
        logf.close()
    log = (tmp_path / "agent.log").read_text()
    assert not errors, errors
    events = state["events"]
    speech_t = np.array([t for t, _ in state["speech_frames"]])
    turns = state.get("turns", [])
    assert len(turns) >= 2, (turns, log[-3000:])

    # Listening: while the user first speaks, the avatar's flag is up, its frames keep coming
    # and it says nothing.
    starts = [e["t"] for e in events if e["type"] == "user_started"]
    stops = [e["t"] for e in events if e["type"] == "user_stopped"]
    assert starts and stops and stops[0] > starts[0], events
    assert all(e["listening"] for e in events if e["type"] == "user_started")
    during = [p for p in polls if starts[0] + 0.1 < p[0] < stops[0]]
    assert during and all(p[1] for p in during), polls
    assert during[-1][2] - during[0][2] >= 25 * (during[-1][0] - during[0][0]) * 0.6, during
    assert not ((speech_t > starts[0]) & (speech_t < stops[0])).any()

    # Then it answers: its speech reaches the page, and the mouth moves while it speaks.
    assert ((speech_t > stops[0])).sum() > 25
    assert av["energy"] > 0 and av["tones"], av["tones"]
    mouth_t = np.array([m["t"] for m in av["mouth"]])
    mouth_d = np.array([m["d"] for m in av["mouth"]])
    tones = np.array(av["tones"])
    talking = np.zeros(mouth_t.size, bool)
    for t in tones:
        talking |= (mouth_t > t + 200) & (mouth_t < t + 900)
    quiet = mouth_t < tones[0] - 300
    assert talking.sum() > 20 and quiet.sum() > 20, (talking.sum(), quiet.sum())
    med_talk, med_quiet = float(np.median(mouth_d[talking])), float(np.median(mouth_d[quiet]))
    assert med_talk > 3 * max(med_quiet, 0.5), (med_talk, med_quiet)

    # Interrupting it stops it: the user speaks while it answers (an interruption), and its
    # speech stops within a chunk (0.7 s, plus the pipeline's hop) and stays stopped while the
    # user speaks.
    hits = [e["t"] for e in events if e["type"] == "interruption"
            and ((speech_t > e["t"] - 1.0) & (speech_t < e["t"])).any()]
    assert hits, (events, log[-2000:])
    t_int = hits[0]
    user_done = min([t for t in stops if t > t_int] + [np.inf])
    assert user_done - t_int > 1.0, (t_int, stops)
    after = speech_t[(speech_t > t_int) & (speech_t < user_done)]
    stopped_after = float(after.max() - t_int) if after.size else 0.0
    assert stopped_after <= 0.8, stopped_after

    # A/V offset as played, per sentence: when WebRTC played the tone's first packet out
    # (getSynchronizationSources) minus when the page expected the marked frame on screen
    # (requestVideoFrameCallback); > 0: the voice is later than the face. The WebAudio copy of
    # the tone is reported beside it (it adds that graph's own buffering, ~70 ms here).
    offsets = np.array(av["offsets"])
    print(f"\nvoice agent: started in {started:.1f} s; turns heard: {[t['heard'] for t in turns]}; "
          f"{av['frames']} frames shown, {av['dropped']} dropped; mouth change talking "
          f"{med_talk:.1f} vs listening {med_quiet:.2f}; speech stopped {stopped_after:.2f} s "
          f"after the interruption; avatar TTFB {[round(x, 2) for x in state['ttfb_s']]}; "
          f"event-loop stalls over 40 ms: {[ms for _, ms in state.get('stalls', [])]}")
    print(f"A/V offset per sentence (ms, tone played minus marked frame shown; {offsets.size} of "
          f"{len(av['markers'])} markers, {len(state['markers'])} put out): "
          f"{[round(o) for o in offsets]}; min/median/max {offsets.min():.0f}/"
          f"{np.median(offsets):.0f}/{offsets.max():.0f}")
    print(f"  through WebAudio (+ its buffering): {[round(o) for o in av['offsetsWebAudio']]}")
    assert len(av["markers"]) >= 8 and offsets.size >= 0.6 * len(av["markers"]), (av["markers"], av["onsets"])
    # What this machine reaches (2 shared cores, the agent and Chromium on them): the median
    # within 80 ms; single sentences up to ~220 ms after event-loop stalls and interruptions
    # (docs/pipecat.md, "A/V offset"), so each within 300 ms (it was +-425 before the fix).
    assert abs(float(np.median(offsets))) <= 80, offsets
    assert np.abs(offsets).max() <= 300, offsets
