"""RTMP publishing (issue 31) against a real server: Debian's nginx with its RTMP module, started
by the test on a free loopback port (tests/nginx_rtmp.py), the stream played back from it with
PyAV as a viewer would.

Known sync: the synthetic stream shows a white frame and starts a 40 ms beep together, at frame 12
of every second; the played-back stream's A/V offset is the flash's presentation time minus the
beep's onset (what a viewer sees and hears). The generate test measures the model's stream the way
`bench soak` measures a file (bench/soak_file.py): video frame k is the model's frame for media
time k/fps, and the played-back audio is located against the input by cross-correlation.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np
import pytest
from nginx_rtmp import NginxRTMP, free_port, missing

from avatarstream.bench.soak_file import audio_shift_s
from avatarstream.errors import ConfigError, OutputError
from avatarstream.media.audio import read_all
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.publish.rtmp import TS_SHIFT, RTMPSink
from avatarstream.publish.rtmp_url import redacted

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))

FPS, RATE, SIZE = 25, 16000, 128
SPF = RATE // FPS  # audio samples per video frame
MAX_AV_OFFSET_MS = 40.0


def flash_beep(start: int, frames: int) -> tuple[VideoChunk, AudioChunk]:
    """Frames [start, start + frames) of the known-sync stream, and their audio."""
    idx = start + np.arange(frames)
    video = np.full((frames, SIZE, SIZE, 3), 40, np.uint8)  # [N, H, W, 3]
    video[idx % FPS == 12] = 230
    audio = np.zeros(frames * SPF, np.float32)
    beep = 0.5 * np.sin(2 * np.pi * 1000 * np.arange(SPF) / RATE).astype(np.float32)
    for j in np.flatnonzero(idx % FPS == 12):
        audio[j * SPF:(j + 1) * SPF] = beep
    return VideoChunk(video, start, FPS), AudioChunk(audio, start * SPF, RATE)


class Player(threading.Thread):
    """Plays `url` with PyAV (subscribes before the stream starts; nginx holds it) and keeps each
    video frame's time and mean brightness, and the decoded audio with its times. It ends when no
    data came for `idle_s` (an RTMP player is not told that the publisher left); it waits up to
    `wait_s` for the stream to start, and stops after `frames` video frames when given (a stream
    that pauses while a slow generator catches up is not over)."""

    def __init__(self, url: str, idle_s: float = 2.0, wait_s: float = 30.0,
                 frames: int | None = None) -> None:
        super().__init__(daemon=True)
        self.url, self.idle_s, self.wait_s, self.frames = url, idle_s, wait_s, frames
        self.video_t: list[float] = []
        self.luma: list[float] = []
        self.audio: list[tuple[float, np.ndarray]] = []
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            with av.open(self.url, timeout=(self.wait_s, self.idle_s),
                         options={"analyzeduration": "500000"}) as c:
                for frame in c.decode():
                    t = float(frame.pts * frame.time_base)
                    if isinstance(frame, av.VideoFrame):
                        self.video_t.append(t)
                        self.luma.append(float(frame.to_ndarray(format="gray").mean()))
                        if len(self.video_t) == self.frames:
                            return
                    else:
                        self.audio.append((t, frame.to_ndarray().reshape(-1).astype(np.float32)))
        except av.ExitError:  # the idle timeout: the stream is over
            pass
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def result(self, timeout: float = 30.0, *, cut: bool = False) -> Player:
        """The finished player; `cut`: the server died under it (an I/O error ends the stream)."""
        self.join(timeout)
        assert not self.is_alive(), "the player did not finish"
        if cut:
            assert isinstance(self.error, OSError) and self.video_t, self.error
        else:
            assert self.error is None, self.error
        return self

    def decoded_audio(self) -> tuple[float, np.ndarray]:
        """(presentation time of the first decoded sample, the samples [N]) — contiguous."""
        return self.audio[0][0], np.concatenate([x for _, x in self.audio])

    def flashes(self) -> np.ndarray:
        return np.array(self.video_t)[np.array(self.luma) > 128]

    def beeps(self) -> np.ndarray:
        """Onset times of the beeps (first loud sample after at least 0.5 s of quiet)."""
        t = np.concatenate([t0 + np.arange(x.size) / RATE for t0, x in self.audio])
        loud = t[np.abs(np.concatenate([x for _, x in self.audio])) > 0.25]
        return loud[np.concatenate([[True], np.diff(loud) > 0.5])]


def av_offset_ms(player: Player) -> float:
    """Median over flashes of (flash time - nearest beep onset), ms; > 0: video late."""
    flashes, beeps = player.flashes(), player.beeps()
    assert flashes.size and beeps.size
    nearest = beeps[np.abs(beeps[None, :] - flashes[:, None]).argmin(1)]
    return float(np.median(flashes - nearest)) * 1000


def publish(sink: RTMPSink, seconds: float, *, every_s: float, chunk: int = FPS,
            at: dict | None = None) -> float:
    """Write `seconds` of the known-sync stream in chunks of `chunk` frames, one every `every_s`
    (a generator at that pace); `at[i]` is called before chunk i. Returns the longest write."""
    worst = 0.0
    for i, start in enumerate(range(0, round(seconds * FPS), chunk)):
        if at and i in at:
            at[i]()
        video, audio = flash_beep(start, chunk)
        t = time.monotonic()
        sink.write_video(video)
        sink.write_audio(audio)
        worst = max(worst, time.monotonic() - t)
        time.sleep(every_s)
    return worst


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NginxRTMP]:
    with NginxRTMP(tmp_path / "nginx") as s:
        yield s


def test_stream_plays_back_whole_in_sync_and_paced(server: NginxRTMP) -> None:
    url = server.url("sync")
    player = Player(url)
    server.wait_players(1)
    sink = RTMPSink(url)
    sink.reserve()
    sink.open(SIZE, SIZE, FPS, RATE)
    t0 = time.monotonic()
    publish(sink, 4.0, every_s=0.1)  # generation 10x faster than real time: the sink paces it
    generated = time.monotonic() - t0
    sink.close()
    sent = time.monotonic() - t0
    p = player.result()
    assert sink.stats() | {"last_error": None} == {
        "url": redacted(url), "frames_sent": 100, "frames_dropped": 0, "audio_dropped_s": 0.0,
        "reconnects": 0, "errors": 0, "connected": False, "last_error": None}
    assert len(p.video_t) == 100  # every frame, each once, in order
    assert np.all(np.diff(p.video_t) > 0)
    assert np.allclose(np.diff(p.video_t), 1 / FPS, atol=1e-3)
    assert generated < 1.5 and sent >= 99 / FPS - 0.05, (generated, sent)  # never faster than real time
    assert p.flashes().size == 4 and p.beeps().size == 4
    assert abs(av_offset_ms(p)) <= MAX_AV_OFFSET_MS, (p.flashes(), p.beeps())


def test_a_generator_far_ahead_is_held_to_max_ahead_and_loses_nothing(server: NginxRTMP) -> None:
    """`max_ahead_s` (generate --rtmp): a generator much faster than real time waits in write_*
    so that what waits to be sent stays within max_ahead_s (+ one chunk) however long it runs:
    bounded memory, and every frame still reaches the viewer, in order."""
    url = server.url("ahead")
    player = Player(url)
    server.wait_players(1)
    sink = RTMPSink(url, max_ahead_s=1.0)
    sink.reserve()
    sink.open(SIZE, SIZE, FPS, RATE)
    backlog = []
    t0 = time.monotonic()
    for start in range(0, 6 * FPS, FPS // 5):  # 6 s in 0.2 s chunks, as fast as they can go
        video, audio = flash_beep(start, FPS // 5)
        sink.write_video(video)
        sink.write_audio(audio)
        backlog.append(sink._backlog_s())
    generated = time.monotonic() - t0
    sink.close()
    p = player.result()
    assert max(backlog) <= 1.0 + 0.2 + 0.3, max(backlog)  # max_ahead + one chunk + a busy CPU's lag
    assert generated >= 6.0 - 1.0 - 0.2 - 0.3, generated  # held back to the stream's pace
    assert sink.stats()["frames_sent"] == 150 and sink.stats()["frames_dropped"] == 0
    assert len(p.video_t) == 150 and np.allclose(np.diff(p.video_t), 1 / FPS, atol=1e-3)
    assert abs(av_offset_ms(p)) <= MAX_AV_OFFSET_MS


def test_server_restart_mid_stream_is_survived(server: NginxRTMP) -> None:
    url = server.url("restart")
    first = Player(url)
    server.wait_players(1)
    sink = RTMPSink(url, backoff_s=(0.5, 2.0))
    sink.reserve()
    sink.open(SIZE, SIZE, FPS, RATE)
    players = [first]

    def restart() -> None:  # kill -9 and start again on the same port, a player back on it
        server.restart()
        players.append(Player(url))
        server.wait_players(1)

    publish(sink, 8.0, every_s=1.0, at={3: restart})
    sink.close()
    before, after = players[0].result(cut=True), players[1].result()
    stats = sink.stats()
    assert stats["reconnects"] == 1 and stats["errors"] == 1, stats
    assert stats["frames_sent"] + stats["frames_dropped"] == 200, stats
    assert stats["frames_dropped"] <= 2 * FPS, stats  # at most the chunk cut by the kill and the next
    # the timeline goes on: on both connections frame k is at k / fps (+ TS_SHIFT); the second
    # one's frames come after the first's, up to the last frame
    index = [(np.array(p.video_t) - float(TS_SHIFT)) * FPS for p in (before, after)]
    assert all(np.allclose(k, np.round(k), atol=0.05) for k in index)
    assert len(before.video_t) >= 2 * FPS and len(after.video_t) >= 3 * FPS
    assert index[1].min() > index[0].max() and round(index[1].max()) == 199
    assert np.all(np.diff(index[1]) > 0)
    assert len(before.video_t) + len(after.video_t) >= stats["frames_sent"] - FPS
    assert abs(av_offset_ms(after)) <= MAX_AV_OFFSET_MS


def test_a_server_that_takes_no_data_never_blocks_generation() -> None:
    """A server that accepts the connection and never answers (a dead network): the writes return
    at once, the process is not frozen while it streams (FFmpeg waits on its own thread, without
    the GIL; only ending a stuck connection holds it, for at most `io_timeout_s`), frames are
    dropped and counted, the connection is retried, and close ends in bounded time with one error
    saying nothing was published."""
    ticks = [time.monotonic()]
    done = threading.Event()

    def tick() -> None:  # a Python thread that needs the GIL every 10 ms
        while not done.is_set():
            time.sleep(0.01)
            ticks.append(time.monotonic())

    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"rtmp://127.0.0.1:{silent.getsockname()[1]}/live/dead"
        sink = RTMPSink(url, max_queue_s=1.0, max_late_s=0.5, io_timeout_s=1.0,
                        backoff_s=(0.2, 0.4), close_timeout_s=1.0)
        sink.reserve()
        sink.open(SIZE, SIZE, FPS, RATE)
        threading.Thread(target=tick, daemon=True).start()
        t0 = time.monotonic()
        worst = publish(sink, 4.0, every_s=0.25, chunk=FPS // 5 * 2)  # 0.4 s chunks, 1.6x real time
        generated = time.monotonic() - t0
        streaming = list(ticks)
        with pytest.raises(OutputError, match="nothing was published to .*/live/\\*\\*\\*"):
            sink.close()
        closed = time.monotonic() - t0
        done.set()
        stats = sink.stats()
    assert worst < 0.05 and generated < 3.5, (worst, generated)
    assert closed - generated < 5.0
    assert max(np.diff(streaming)) < 0.3 and max(np.diff(ticks)) < 1.0 + 0.3  # GIL holds
    assert stats["errors"] >= 2 and stats["reconnects"] >= 1, stats
    assert stats["frames_dropped"] > 0 and stats["frames_sent"] + stats["frames_dropped"] == 100, stats


def test_generate_publishes_the_model_stream(tmp_path: Path, media, server: NginxRTMP) -> None:
    url = server.url("generate")
    player = Player(url, idle_s=30.0, wait_s=280.0, frames=75)  # the model loads first
    server.wait_players(1)
    out = tmp_path / "talk.mp4"
    r = subprocess.run([sys.executable, "-m", "avatarstream.cli", "generate", "--reference",
                        str(media["png"]), "--audio", str(media["wav_3s"]), "--out", str(out),
                        "--rtmp", url, "--json", "--no-progress"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    p = player.result(timeout=60)
    frames = summary["frames"]
    assert summary["rtmp"]["frames_sent"] == frames == 75 and summary["rtmp"]["frames_dropped"] == 0
    assert summary["rtmp"]["errors"] == 0  # pauses while the CPU generates slower than real time
    assert len(p.video_t) == frames and out.exists()
    # A/V offset as bench soak measures a file: video frame k is the model's frame for k / fps
    video_lag = float(np.median(np.array(p.video_t) - np.arange(frames) / FPS))
    t_audio, decoded = p.decoded_audio()
    source = read_all(media["wav_3s"], RATE)
    shift = audio_shift_s(source, decoded, 0, source.size - RATE // 2, RATE)
    assert shift is not None
    offset_ms = (video_lag - (t_audio + shift)) * 1000
    assert abs(offset_ms) <= MAX_AV_OFFSET_MS, (video_lag, t_audio, shift)


def test_wrong_urls_are_one_clear_error(tmp_path: Path, media, server: NginxRTMP) -> None:
    with pytest.raises(ConfigError, match="rtmp://, rtmps:// or srt://"):
        RTMPSink("http://example.com/live/key")
    port = free_port()  # nothing listens there
    with pytest.raises(OutputError, match=f"rtmp://127.0.0.1:{port}/live/\\*\\*\\*: .*refused"):
        RTMPSink(f"rtmp://127.0.0.1:{port}/live/secret-key").reserve()
    # SRT: PyAV's FFmpeg is built without libsrt (the README says so); the reason is named
    with pytest.raises(OutputError, match="no srt protocol"):
        RTMPSink(f"srt://127.0.0.1:{port}").reserve()
    # a server that refuses the stream (no such application): warnings, then one error at the end
    sink = RTMPSink(server.url("key").replace("/live/", "/nosuchapp/"), backoff_s=(0.2, 0.4))
    sink.reserve()
    sink.open(SIZE, SIZE, FPS, RATE)
    publish(sink, 1.6, every_s=0.4, chunk=10)
    with pytest.raises(OutputError, match="nothing was published to .*/nosuchapp/"):
        sink.close()
    assert sink.stats()["errors"] >= 2
    out = tmp_path / "talk.mp4"
    r = subprocess.run([sys.executable, "-m", "avatarstream.cli", "generate", "--model", "tiny-random",
                        "--reference", str(media["png"]), "--audio", str(media["wav_3s"]),
                        "--out", str(out), "--rtmp", f"rtmp://127.0.0.1:{port}/live/secret-key",
                        "--no-progress"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "cannot publish to" in r.stderr and "secret-key" not in r.stderr
    assert not out.exists() and not list(tmp_path.glob("talk*"))


@pytest.mark.usefixtures("one_thread")
def test_a_server_session_is_pushed_to_rtmp(tmp_path: Path, server: NginxRTMP) -> None:
    """`rtmp_url` of POST /v1/sessions: the session's idle stream reaches the RTMP server (the
    session state reports the counters); a URL of another scheme is a 400 naming the schemes."""
    import dataclasses

    from serve.helpers import A, _app, _avatar, _run

    from avatarstream.serve.app import CONFIG, SESSIONS

    app, config = _app(tmp_path)
    app[CONFIG] = dataclasses.replace(app[CONFIG], rtmp_allow=("127.0.0.1",))  # loopback: named
    url = server.url("session")
    player = Player(url, frames=2 * config.fps)  # 2 s of the session's (idle) stream

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        r = await client.post("/v1/sessions", json={"avatar_id": avatar, "rtmp_url": "http://x/y"},
                              headers=A)
        assert r.status == 400 and "rtmp://" in (await r.json())["error"]
        await asyncio.to_thread(server.wait_players, 1)
        r = await client.post("/v1/sessions", json={"avatar_id": avatar, "rtmp_url": url}, headers=A)
        assert r.status == 201, await r.text()
        s = await r.json()
        assert s["rtmp"] == redacted(url)
        await asyncio.to_thread(player.result, 60)
        state = await (await client.get(f"/v1/sessions/{s['session_id']}", headers=A)).json()
        assert state["rtmp"]["frames_sent"] >= 2 * config.fps and state["rtmp"]["errors"] == 0
        sink = app[SESSIONS].entries[s["session_id"]].rtmp
        assert (await client.delete(f"/v1/sessions/{s['session_id']}", headers=A)).status == 204
        for _ in range(100):  # the session's end ends its stream (the sink's thread finishes)
            if not sink.stats()["connected"]:
                break
            await asyncio.sleep(0.1)
        assert not sink.stats()["connected"] and sink.stats()["errors"] == 0

    _run(app, body, timeout=90)
    assert len(player.video_t) == 2 * config.fps and np.all(np.diff(player.video_t) > 0)


def test_a_server_pushes_only_to_allowed_hosts(tmp_path: Path) -> None:
    """`serve --rtmp-allow`: a session's rtmp_url naming a host off the list is a 400 before any
    connection is tried (an API key holder cannot make the server connect anywhere)."""
    import dataclasses

    from serve.helpers import A, _app, _avatar, _run

    from avatarstream.serve.app import CONFIG

    app, _ = _app(tmp_path)
    app[CONFIG] = dataclasses.replace(app[CONFIG], rtmp_allow=("*.ingest.example.com", "127.0.0.1"))

    async def body(client):  # type: ignore[no-untyped-def]
        avatar = await _avatar(client)
        for url in ("rtmp://10.0.0.1:1935/live/KEY", "rtmp://evil.example.com/live/KEY",
                    "rtmp://ingest.example.com.evil.net/live/KEY"):
            r = await client.post("/v1/sessions", json={"avatar_id": avatar, "rtmp_url": url}, headers=A)
            message = (await r.json())["error"]
            assert r.status == 400 and "--rtmp-allow" in message and "KEY" not in message, message
            assert "*.ingest.example.com" not in message  # the list is the operator's, not shown
        # an allowed host goes on to the reachability check (nothing listens there: 400, not 201)
        r = await client.post("/v1/sessions", json={"avatar_id": avatar, "rtmp_url": "rtmp://127.0.0.1:1/live/KEY"},
                              headers=A)
        assert r.status == 400 and "--rtmp-allow" not in (await r.json())["error"]

    _run(app, body, timeout=60)
