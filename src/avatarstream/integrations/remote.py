"""The remote side of an agent-stack integration: one session of a running `avatarstream serve`.

    stream = RemoteStream("http://gpu-box:8000", api_key=KEY, avatar=Path("face.jpg"))
    await stream.open()                         # session, WebSocket, WebRTC; the first frame is in
    await stream.offer(samples16k)              # the agent's speech (float32, 16 kHz); False: later
    await stream.end_of_speech(); await stream.clear(); await stream.listen(True)
    async for item in stream: ...               # Frame(index, rgb, pcm16 | None) | SegmentEnd
    await stream.aclose()

The same interface as `local.SessionStream`, over the server's own API, as `avatarstream client`
and the web page use it (serve/client.py's helpers): `POST /v1/sessions` (the avatar uploaded
first, or one uploaded before named by id), the session's WebSocket for the speech (PCM16 mono
16 kHz) and the control messages (`end_of_speech`, `clear_buffer`, `listening`), and the video
and the session's audio back over WebRTC (aiortc; no STUN: loopback or LAN).

Media time: both WebRTC tracks start at the session's media time named by the `playout` event,
so video RTP time t is session frame `start + t * fps` and audio RTP time t is session sample
`start * 640 + t * 16000`. The audio arrives as Opus at 48 kHz; it is mixed to mono and
resampled to 16 kHz (soxr, one stream) onto that timeline. A frame inside an utterance (between
the `speech_started` and `speech_ended` events' frames) is yielded with its 40 ms of that audio
once it has arrived (or after `AUDIO_WAIT_S`: zeros where a packet was lost); any other frame at
once, without audio. The frames come paced by the server's playout (`paced`).

Back-pressure: the server takes at most its speech buffer (`slow_down` beyond it). `offer` keeps
what was sent at most `ahead_s` ahead of real time (as if it were being spoken from the moment it
was sent), so a TTS that runs ahead of real time is held here (offer returns False) and never
overflows the server's buffer. The session token in the server's URLs is never logged; the
API key is only sent, as a bearer header.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from avatarstream.errors import InputError
from avatarstream.integrations.local import Frame, SegmentEnd, _Timeline

log = logging.getLogger(__name__)

AUDIO_WAIT_S = 0.5  # a speaking frame waits at most this long for its audio
VIDEO_CLOCK = 90000
PIECE = 16000  # samples per WebSocket message at most (1 s; the server takes up to 2 s)


class RemoteStream:
    paced = True  # frames arrive at their playout time
    session = None  # no in-process LiveSession

    def __init__(self, url: str, *, api_key: str, avatar: Path | None = None,
                 avatar_id: str | None = None, ahead_s: float = 1.0,
                 timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self._api_key = api_key
        self.avatar, self.avatar_id = avatar, avatar_id
        self.ahead_s, self.timeout_s = ahead_s, timeout_s
        self.session_id: str | None = None
        self.fps, self.sample_rate, self.spf = 25, 16000, 640
        self.size = (0, 0)  # (width, height): from the first frame
        self.refused = 0  # packets the server answered with slow_down (lost speech)
        self._http: Any = None
        self._ws: Any = None
        self._pc: Any = None
        self._s: dict = {}
        self._tasks: list[asyncio.Task] = []
        self._until = 0.0  # wall time by which what was sent would be spoken
        self._last_sent = 0.0
        self._sent_since_end = False
        self._running = False
        self._start_frame: int | None = None  # the tracks' first frame (playout event)
        self._video: deque[tuple[int, np.ndarray, float]] = deque()  # (index, rgb, arrival)
        self._events: deque[dict] = deque()
        self._audio = _Timeline()
        self._audio_end = 0  # session samples received so far (the timeline's end)
        self._wake = asyncio.Event()

    # -- opening and closing -----------------------------------------------------------------------
    async def open(self) -> None:
        """Open the session and wait for its first video frame. Raises InputError when the server
        cannot be reached, refuses (its reason: no such avatar, full, ...) or sends nothing."""
        import aiohttp
        from aiortc import RTCConfiguration, RTCPeerConnection

        from avatarstream.serve.client import open_session, prepare_ice, quiet_url, receive_webrtc

        prepare_ice(self.url)
        self._http = aiohttp.ClientSession(headers={"Authorization": f"Bearer {self._api_key}"})
        try:
            self.avatar_id, s = await open_session(self._http, self.url, avatar=self.avatar,
                                                   avatar_id=self.avatar_id)
            self._s, self.session_id = s, s["session_id"]
            self.fps, self.sample_rate = int(s["fps"]), int(s["sample_rate"])
            self.spf = self.sample_rate // self.fps
            try:
                self._ws = await self._http.ws_connect(self.url + s["audio_url"])
            except aiohttp.ClientError as e:
                raise InputError(f"cannot open the session's WebSocket "
                                 f"({quiet_url(s['audio_url'])}): {type(e).__name__}") from None
            self._running = True
            self._tasks.append(asyncio.ensure_future(self._read_events()))
            self._pc = pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))

            @pc.on("track")
            def on_track(track: Any) -> None:
                read = self._read_video if track.kind == "video" else self._read_audio
                self._tasks.append(asyncio.ensure_future(read(track)))

            for kind in ("video", "audio"):
                pc.addTransceiver(kind, direction="recvonly")
            await receive_webrtc(pc, self._http, self.url, s["offer_url"])
            deadline = time.monotonic() + self.timeout_s
            while not self._video or self._start_frame is None:
                if time.monotonic() > deadline or not self._running:
                    raise InputError(f"no video arrived from the server at {self.url}")
                await asyncio.sleep(0.02)
        except aiohttp.ClientError as e:
            await self.aclose()
            raise InputError(f"cannot talk to the avatarstream server at {self.url}: "
                             f"{type(e).__name__}: {e}") from None
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """End the session on the server and close the connections. Idempotent."""
        self._running = False
        self._wake.set()
        for t in self._tasks:
            t.cancel()
        self._tasks = []
        pc, self._pc = self._pc, None
        if pc is not None:
            await pc.close()
        http, self._http = self._http, None
        if http is None:
            return
        if self.session_id is not None:
            from avatarstream.serve.client import api_call

            try:
                await api_call(http, self.url, "DELETE", f"/v1/sessions/{self.session_id}")
            except (InputError, OSError, asyncio.TimeoutError):
                pass
            except Exception as e:  # noqa: BLE001 - aiohttp's errors: the server is gone
                log.debug("closing the remote session: %s", type(e).__name__)
        if self._ws is not None:
            await self._ws.close()
        await http.close()

    @property
    def running(self) -> bool:
        return self._running

    # -- in ----------------------------------------------------------------------------------------
    async def offer(self, samples: np.ndarray) -> bool:
        """Send float32 speech at 16 kHz unless what was sent is already `ahead_s` ahead."""
        now = time.monotonic()
        if not self._running:
            return False
        if self._until - now > self.ahead_s:
            return False
        pcm = np.clip(np.round(samples * 32767.0), -32768, 32767).astype("<i2")
        for i in range(0, pcm.size, PIECE):
            await self._ws.send_bytes(pcm[i : i + PIECE].tobytes())
        self._until = max(self._until, now) + samples.size / self.sample_rate
        self._last_sent, self._sent_since_end = now, True
        return True

    async def _send(self, msg: dict) -> None:
        if self._running and self._ws is not None and not self._ws.closed:
            await self._ws.send_json(msg)

    async def end_of_speech(self) -> None:
        await self._send({"type": "end_of_speech"})

    async def clear(self) -> None:
        self._until = time.monotonic()
        self._sent_since_end = False
        await self._send({"type": "clear_buffer"})

    async def listen(self, on: bool) -> None:
        await self._send({"type": "listening", "on": bool(on)})

    async def more_to_come(self, *, talking: bool) -> bool:
        """Whether speech sent is still to be spoken: after the agent's last audio (`talking`),
        anything sent since the last utterance ended; at an utterance's end, what the server
        still has queued (its session state), or audio sent too recently to have arrived."""
        if talking:
            return self._sent_since_end
        if time.monotonic() - self._last_sent < 0.2:
            return True
        from avatarstream.serve.client import api_call

        try:
            st = await api_call(self._http, self.url, "GET", f"/v1/sessions/{self.session_id}")
        except Exception:  # noqa: BLE001 - the server is gone: nothing more comes
            return False
        return st.get("buffered_s", 0) > 0 or st.get("state") == "talking"

    # -- readers -----------------------------------------------------------------------------------
    async def _read_events(self) -> None:
        import aiohttp

        try:
            async for msg in self._ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    continue
                event = json.loads(msg.data)
                kind = event.get("type")
                if kind == "playout" and self._start_frame is None:
                    self._start_frame = round(float(event["media_s"]) * self.fps)
                elif kind == "slow_down":
                    self.refused += 1
                    log.warning("the avatar server's speech buffer was full: a packet was lost")
                elif kind == "error":
                    log.warning("the avatar server: %s", event.get("error"))
                elif kind in ("speech_started", "speech_ended", "session_ended"):
                    self._events.append(event)
                    self._wake.set()
        finally:
            self._running = False
            self._wake.set()

    async def _read_video(self, track: Any) -> None:
        from aiortc.mediastreams import MediaStreamError

        first: int | None = None
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                self._running = False
                self._wake.set()
                return
            first = frame.pts if first is None else first
            while self._start_frame is None:  # the playout event precedes the first frame
                await asyncio.sleep(0.005)
            k = round(((frame.pts - first) % (1 << 32)) * self.fps / VIDEO_CLOCK)
            rgb = frame.to_ndarray(format="rgb24")
            self.size = (rgb.shape[1], rgb.shape[0])
            self._video.append((self._start_frame + k, rgb, time.monotonic()))
            self._wake.set()

    async def _read_audio(self, track: Any) -> None:
        import soxr
        from aiortc.mediastreams import MediaStreamError

        resampler: Any = None
        first: int | None = None
        pos = 0  # input samples placed so far (at the track's rate)
        placed = 0  # output samples placed so far (at the session's rate)
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            rate = frame.sample_rate
            if resampler is None:
                resampler = soxr.ResampleStream(rate, self.sample_rate, 1, dtype="float32")
            first = frame.pts if first is None else first
            channels = len(frame.layout.channels)
            x = frame.to_ndarray().reshape(-1, channels).mean(axis=1).astype(np.float32) / 32768.0
            gap = (frame.pts - first) % (1 << 32) - pos  # a lost packet: silence in its place
            if 0 < gap < rate:
                x = np.concatenate([np.zeros(gap, np.float32), x])
            pos += x.size
            y = resampler.resample_chunk(x)
            while self._start_frame is None:
                await asyncio.sleep(0.005)
            base = self._start_frame * self.spf
            self._audio.add(base + placed, y)
            placed += y.size
            self._audio_end = base + placed
            self._wake.set()

    # -- out ---------------------------------------------------------------------------------------
    def __aiter__(self) -> Any:
        return self._stream()

    async def _stream(self) -> Any:
        talk_from: int | None = None
        ends: deque[SegmentEnd] = deque()
        while True:
            while self._events:
                e = self._events.popleft()
                if e["type"] == "speech_started":
                    talk_from = int(e["frame"])
                elif e["type"] == "speech_ended":
                    ends.append(SegmentEnd(bool(e["interrupted"]), int(e["frame"])))
            if self._video:
                n, rgb, arrived = self._video[0]
                while ends and n >= ends[0].frame:  # the utterance's last frame has gone out
                    end = ends.popleft()
                    if talk_from is not None and talk_from < end.frame:
                        talk_from = None
                    self._sent_since_end = False
                    yield end
                talking = talk_from is not None and n >= talk_from
                need = (n + 1) * self.spf
                if talking and self._audio_end < need and time.monotonic() - arrived < AUDIO_WAIT_S:
                    await self._wait(0.01)
                    continue
                self._video.popleft()
                pcm = self._audio.take(n * self.spf, need)
                yield Frame(n, rgb, pcm if talking else None)
            elif not self._running:
                for end in ends:
                    yield end
                return
            else:
                await self._wait(0.5)

    async def _wait(self, timeout: float) -> None:
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), timeout)
        except asyncio.TimeoutError:
            pass
