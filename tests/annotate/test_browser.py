"""The annotation page in a real headless Chromium (Debian's, driven by Playwright, launched as
tests/serve/test_browser.py launches it) against `avatarstream annotate` run as a process: the
two renders play in sync with only the left one heard, a scripted annotator types a name and
judges three pairs with the keys (left, right, then skip, undo, tie), and the export holds
exactly the two decisive judgements, in on-disk terms whatever sides the page showed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from avatarstream.annotate.store import Store

from .helpers import make_pairs, read_jsonl

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--autoplay-policy=no-user-gesture-required"]
NAME = "Alice Martin"  # sees p0000 and p0002 with their sides swapped, p0001 as on disk (asserted below)


def _playwright():  # type: ignore[no-untyped-def]
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (make test installs the 'browser' extra)")
    if not shutil.which("chromium") and not os.path.exists(CHROMIUM):
        pytest.skip("chromium is not installed (make sysdeps installs it)")
    return sync_playwright


class AnnotateProcess:
    """`avatarstream annotate PAIRS --port 0`, until the block ends; `url` from its stderr."""

    def __init__(self, pairs) -> None:  # type: ignore[no-untyped-def]
        self.proc = subprocess.Popen([sys.executable, "-m", "avatarstream.cli", "annotate", str(pairs),
                                      "--port", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))

    def __enter__(self) -> AnnotateProcess:
        line = self.proc.stderr.readline()  # type: ignore[union-attr]
        m = re.match(r"listening on (http://127\.0\.0\.1:\d+/) \(3 pairs", line)
        if m is None:
            self.proc.kill()
            raise AssertionError(line + self.proc.stderr.read())  # type: ignore[union-attr]
        self.url = m.group(1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()  # SIGTERM: a clean stop
        assert self.proc.wait(timeout=30) == 0


def _shown_sides(page) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """The on-disk sides the page shows on the left and on the right."""
    src = page.evaluate("[document.getElementById('left').src, document.getElementById('right').src]")
    return src[0].rsplit("/", 1)[1], src[1].rsplit("/", 1)[1]


def _sync_samples(page, n: int = 12) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(n):
        page.wait_for_timeout(100)
        out.append(tuple(page.evaluate("[document.getElementById('left').currentTime,"
                                       " document.getElementById('right').currentTime]")))
    return out


@pytest.mark.timeout(240)
def test_an_annotator_judges_three_pairs_with_the_keys(tmp_path):
    sync_playwright = _playwright()
    pairs = tmp_path / "PAIRS"
    make_pairs(pairs, n=3, real=True)
    shown: dict[str, tuple[str, str]] = {}
    with AnnotateProcess(pairs) as server, sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(tmp_path / "profile"), headless=True,
                                                   executable_path=CHROMIUM, args=FLAGS)
        try:
            page = ctx.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url)
            page.fill("#annotator", NAME)
            page.press("#annotator", "Enter")
            page.wait_for_function("window.annotate.pair && window.annotate.pair.id === 'p0000'")
            page.wait_for_function("document.getElementById('left').readyState >= 3"
                                   " && document.getElementById('right').readyState >= 3")
            assert page.inner_text("#progress") == "0 of 3 judged"
            muted = page.evaluate("[document.getElementById('left').muted, document.getElementById('right').muted]")
            page.keyboard.press("Space")  # one control plays both
            page.wait_for_function("document.getElementById('left').currentTime > 0.2")
            samples = _sync_samples(page)
            page.keyboard.press("Space")
            paused = page.evaluate("[document.getElementById('left').paused, document.getElementById('right').paused]")
            # p0000: the left one (as shown) is better; p0001: the right one; p0002: skip, which
            # ends the pairs, then undo (p0002 is shown again) and tie
            for pair, key, progress in (("p0000", "ArrowLeft", "1 of 3"), ("p0001", "ArrowRight", "2 of 3"),
                                        ("p0002", "s", "3 of 3"), (None, "u", "2 of 3"), ("p0002", "t", "3 of 3")):
                want = f"window.annotate.pair && window.annotate.pair.id === '{pair}'" if pair else \
                    "window.annotate.finished"
                page.wait_for_function(f"({want}) && !window.annotate.busy")
                if pair:
                    shown[pair] = _shown_sides(page)
                page.keyboard.press(key)
                page.wait_for_function(f"document.getElementById('progress').textContent === '{progress} judged'")
            page.wait_for_function("window.annotate.finished")
            finished = page.is_visible("#finished") and page.inner_text("#finished") == "all pairs judged"
        finally:
            ctx.close()
    assert not errors, errors
    # Both videos advance together and stay within 0.1 s; only the left one is heard.
    assert muted == [False, True]
    assert samples[-1][0] - samples[0][0] > 0.6 and samples[-1][1] - samples[0][1] > 0.6, samples
    assert max(abs(a - b) for a, b in samples) < 0.1, samples
    assert paused == [True, True]
    assert finished
    # The page showed p0000 and p0002 swapped, p0001 as on disk (so both mappings are exercised).
    assert shown == {"p0000": ("right", "left"), "p0001": ("left", "right"), "p0002": ("right", "left")}
    with Store(pairs / "annotations.sqlite") as s:
        rows = [(j.pair, j.choice, j.annotator, j.swapped) for j in s.all()]
    assert rows == [("p0000", "right", NAME, True), ("p0001", "right", NAME, False), ("p0002", "tie", NAME, True)]
    out = tmp_path / "prefs.jsonl"
    r = subprocess.run([sys.executable, "-m", "avatarstream.cli", "annotate", "export", str(pairs), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["choices"] == {"left": 0, "right": 2, "tie": 1, "skip": 0} and summary["exported"] == 2
    lines = read_jsonl(out)
    # p0000: the left as shown was the on-disk right (r0001); p0001: the on-disk right (r0003).
    assert [(ln["pair"], ln["chosen"], ln["rejected"], ln["annotator"], ln["source"]) for ln in lines] == [
        ("p0000", "renders/r0001.pt", "renders/r0000.pt", NAME, "human"),
        ("p0001", "renders/r0003.pt", "renders/r0002.pt", NAME, "human")]
    drift = max(abs(a - b) for a, b in samples)
    print(f"\nannotate browser: playback drift at most {drift * 1000:.0f} ms over {len(samples)} samples")
