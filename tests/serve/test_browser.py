"""The web page in a real headless Chromium (Debian's, driven by Playwright) against a real server
process (tiny-random): create an avatar from a file, start a session (WebRTC), speak a text, and
check that frames arrive, that the mouth region changes while the avatar speaks and stops
changing in silence, that the speech's audio plays, and that the page's readouts fill in."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from avatarstream.bench.inputs import face_image, write_png
from avatarstream.serve.client import ServerProcess

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--autoplay-policy=no-user-gesture-required",
         "--disable-features=WebRtcHideLocalIpsWithMdns"]  # host candidates, not mDNS names
TEXT = "Hello! I am a live avatar on a web page, and I am speaking this sentence for a test."

# Per video frame shown: the change of the mouth region (where the reference face has its mouth)
# from the previous frame, with the frame's track time and the page's audio level readout.
SAMPLER = """
() => {
  window.mouthSamples = [];
  const v = document.getElementById("video");
  const c = document.createElement("canvas");
  const g = c.getContext("2d", { willReadFrequently: true });
  let prev = null;
  const tick = () => {
    if (v.videoWidth) {
      c.width = v.videoWidth; c.height = v.videoHeight;
      g.drawImage(v, 0, 0);
      const x0 = Math.floor(0.38 * c.width), y0 = Math.floor(0.6 * c.height);
      const d = g.getImageData(x0, y0, Math.ceil(0.24 * c.width), Math.ceil(0.14 * c.height)).data;
      if (prev) {
        let s = 0;
        for (let i = 0; i < d.length; i += 4)
          s += Math.abs(d[i] - prev[i]) + Math.abs(d[i + 1] - prev[i + 1]) + Math.abs(d[i + 2] - prev[i + 2]);
        window.mouthSamples.push({ t: window.avatarstream.trackTime, d: s / (d.length / 4 * 3) });
      }
      prev = d.slice();
    }
    v.requestVideoFrameCallback(tick);
  };
  v.requestVideoFrameCallback(tick);
}
"""


def _playwright():  # type: ignore[no-untyped-def]
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (make test installs the 'browser' extra)")
    if not shutil.which("chromium") and not __import__("os").path.exists(CHROMIUM):
        pytest.skip("chromium is not installed (make sysdeps installs it)")
    return sync_playwright


@pytest.mark.timeout(240)
def test_page_creates_an_avatar_and_speaks_live(tmp_path):
    sync_playwright = _playwright()
    png = write_png(tmp_path / "ref.png", face_image(128))
    with ServerProcess(tmp_path / "data", args=("--max-sessions", "2")) as server, \
            sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "profile"), headless=True,
                                                   executable_path=CHROMIUM, args=FLAGS)
        try:
            page = ctx.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/")
            page.set_input_files("#avatarFile", str(png))
            page.click("#createAvatar")
            page.wait_for_function("window.avatarstream.avatarId !== null", timeout=30_000)
            page.click("#start")
            page.wait_for_function("window.avatarstream.frames > 25", timeout=30_000)
            page.evaluate(SAMPLER)
            page.wait_for_timeout(1500)  # idle: listening
            energy_idle = page.evaluate("window.avatarstream.audioEnergy || 0")
            page.fill("#text", TEXT)
            page.click("#speak")
            page.wait_for_function(
                "window.avatarstream.events.some(e => e.ev.type === 'speech_ended')",
                timeout=60_000)
            page.wait_for_timeout(2500)  # the end of the speech plays out, then idle again
            samples = page.evaluate("window.mouthSamples")
            events = page.evaluate("window.avatarstream.events.map(e => e.ev)")
            state = page.evaluate("({frames: window.avatarstream.frames, fps: window.avatarstream.fps,"
                                  " ttff: window.avatarstream.ttff, energy: window.avatarstream.audioEnergy,"
                                  " level: window.avatarstream.audioLevel,"
                                  " avsource: window.avatarstream.avOffsetSource})")
            readouts = {k: page.inner_text(f"#{k}") for k in ("ttff", "fps", "avoffset")}
            page.click("#stop")
        finally:
            ctx.close()
    assert not errors, errors
    # Frames arrive, at about 25 fps.
    assert state["frames"] > 100 and 15 < state["fps"] < 35, state
    # The mouth region changes while the avatar speaks and stops changing in silence.
    by = {e["type"]: e for e in events}
    playout = by["playout"]["media_s"]
    start = by["speech_started"]["media_s"] - playout
    end = by["speech_ended"]["media_s"] - playout
    t = np.array([s["t"] if s["t"] is not None else -1 for s in samples])
    d = np.array([s["d"] for s in samples])
    talking = d[(t > start + 0.2) & (t < end - 0.2)]
    silent = d[((t > 0) & (t < start - 0.2)) | (t > end + 0.3)]
    assert talking.size > 20 and silent.size > 20, (talking.size, silent.size)
    assert np.median(talking) > 5 * max(np.median(silent), 0.5), (np.median(talking), np.median(silent))
    assert np.median(silent) < 3.0
    # The speech is heard: the received audio's energy grows while it plays.
    assert state["energy"] > energy_idle + 0.01 and state["level"] is not None
    # The readouts: time to first frame, fps, audio/video offset.
    assert state["ttff"] is not None and 0 < state["ttff"] < 10
    assert readouts["ttff"].endswith(" s") and readouts["fps"] != "–"
    print(f"\nbrowser: {state['frames']} frames at {state['fps']:.1f} fps, ttff "
          f"{state['ttff']:.2f} s, A/V offset readout {readouts['avoffset']} "
          f"({state['avsource']}), mouth change "
          f"talking {np.median(talking):.1f} vs silent {np.median(silent):.2f}")
