"""WebRTC output of a live session (aiortc): a playout buffer and the two tracks it feeds.

`Playout` is a sink of the session. It keeps what the session publishes for a few seconds and
plays it out on one clock with a fixed delay: media time m goes out at wall time
`origin + m + delay_s`, where `origin` is the session's media time 0. The delay covers the time a
talk chunk needs before its frames exist (its audio arriving in real time, plus the model's work),
so speech never waits for video. The video track sends frame k of the playout at
`start + k / fps`; the audio track sends 20 ms of the same timeline at `start + j * 0.02`; both
tracks start at the same media time (`start_media_s`, the first frame published after the viewer
joined), so RTP time 0 of both tracks is the same instant of the session (what a client needs to
measure time-to-first-frame and the audio/video offset). Audio is the master: a video frame that
is not there at its time is replaced by the last one shown (`late_frames` counts them), so the two
tracks never drift apart.

ICE: `use_host_addresses` decides which local addresses aioice offers as host candidates. aioice
itself never offers 127.0.0.1, so a server on loopback (and a client or browser on the same
machine) patches it in; no STUN or TURN server is used (LAN and loopback only).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from fractions import Fraction

import av
import numpy as np

from avatarstream.media.frames import AudioChunk, VideoChunk

log = logging.getLogger(__name__)

VIDEO_CLOCK = 90000
AUDIO_PACKET_S = 0.02
# aiortc's Opus encoder resamples to 48 kHz through a FIFO that hands out each 20 ms packet one
# call late (the resampler's delay keeps it short of a full packet), so every audio packet leaves
# one packet after its time: the audio track runs that much early to arrive with its video.
OPUS_DELAY_PACKETS = 1


def use_host_addresses(addresses: list[str] | None) -> None:
    """Host candidates aioice offers from now on in this process: `addresses`, or (None) the
    machine's own list plus 127.0.0.1. Process-wide: aioice reads a module-level function."""
    try:
        from aioice import ice
    except ImportError:  # no WebRTC installed: nothing to configure
        return
    original = getattr(ice, "_avatarstream_original_hosts", None) or ice.get_host_addresses
    ice._avatarstream_original_hosts = original  # type: ignore[attr-defined]

    def hosts(use_ipv4: bool, use_ipv6: bool) -> list[str]:
        if addresses is not None:
            return list(addresses)
        return ["127.0.0.1", *original(use_ipv4, use_ipv6)] if use_ipv4 else original(False, use_ipv6)

    ice.get_host_addresses = hosts


def is_loopback_host(host: str) -> bool:
    """True for a loopback address or `localhost` (a server or URL host name)."""
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


class Playout:
    """A session sink that plays its media out for WebRTC on a fixed delay (see module doc)."""

    def __init__(self, *, origin: float, fps: int = 25, sample_rate: int = 16000,
                 delay_s: float = 0.5, keep_s: float | None = None) -> None:
        self.origin, self.fps, self.sample_rate, self.delay_s = origin, fps, sample_rate, delay_s
        self.spf = sample_rate // fps
        keep_s = delay_s + 3.0 if keep_s is None else keep_s  # what may wait for its time
        self.keep_frames = max(1, round(keep_s * fps))
        self._lock = threading.Lock()
        self._video: dict[int, np.ndarray] = {}
        self._audio: deque[AudioChunk] = deque()
        self._first: int | None = None
        self._last_shown: np.ndarray | None = None
        self._closed = False
        self.start_frame: int | None = None
        self.start_wall: float | None = None
        self.durable_frames = 0
        self.late_frames = 0
        self.frames_sent = 0
        self.on_start: list = []  # callables(start_media_s) run once, when the playout starts

    # -- sink side (scheduler thread) ------------------------------------------------------------
    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        self._blank = np.zeros((height, width, 3), np.uint8)

    def write_video(self, chunk: VideoChunk) -> None:
        with self._lock:
            for i, frame in enumerate(chunk.frames):
                self._video[chunk.start_frame + i] = frame
            if self._first is None and len(chunk.frames):
                self._first = chunk.start_frame
            low = chunk.end_frame - self.keep_frames
            for k in [k for k in self._video if k < low]:
                del self._video[k]
            self.durable_frames += len(chunk.frames)

    def write_audio(self, chunk: AudioChunk) -> None:
        with self._lock:
            self._audio.append(chunk)
            low = chunk.end_sample - self.keep_frames * self.spf
            while self._audio and self._audio[0].end_sample < low:
                self._audio.popleft()

    def close(self) -> None:
        self._closed = True

    def abort(self) -> None:
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    # -- track side (event loop) -----------------------------------------------------------------
    @property
    def start_media_s(self) -> float | None:
        return None if self.start_frame is None else self.start_frame / self.fps

    async def wait_start(self) -> None:
        """Wait for the first published frame, fix the start, then wait until it is due."""
        if self.start_wall is None:
            while self._first is None:
                if self._closed:
                    raise EOFError("the session ended before anything was published")
                await asyncio.sleep(0.01)
            if self.start_wall is None:
                self.start_frame = self._first
                self.start_wall = self.origin + self._first / self.fps + self.delay_s
                for fn in self.on_start:
                    fn(self.start_frame / self.fps)
        await _sleep_until(self.start_wall)

    def video_frame(self, k: int) -> np.ndarray:
        """Playout frame k (timeline frame start + k), or the last one shown if it is late."""
        assert self.start_frame is not None
        idx = self.start_frame + k
        with self._lock:
            frame = self._video.pop(idx, None)
            for old in [i for i in self._video if i < idx]:
                del self._video[old]
        if frame is None:
            self.late_frames += 1
            frame = self._last_shown if self._last_shown is not None else self._blank
        self._last_shown = frame
        self.frames_sent += 1
        return frame

    def audio_samples(self, j: int, n: int) -> np.ndarray:
        """n samples of playout audio packet j (silence where nothing was published)."""
        assert self.start_frame is not None
        s0 = self.start_frame * self.spf + j * n
        out = np.zeros(n, np.float32)
        with self._lock:
            while self._audio and self._audio[0].end_sample <= s0:
                self._audio.popleft()
            for ch in self._audio:
                if ch.start_sample >= s0 + n:
                    break
                a, b = max(s0, ch.start_sample), min(s0 + n, ch.end_sample)
                out[a - s0 : b - s0] = ch.samples[a - ch.start_sample : b - ch.start_sample]
        return out


async def _sleep_until(wall: float) -> None:
    delay = wall - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


def _tracks(playout: Playout):  # type: ignore[no-untyped-def]
    from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

    async def slot(at_s: float) -> None:
        """Wait until `at_s` seconds of playout time (the session's end stops the track)."""
        try:
            await playout.wait_start()
        except EOFError as e:
            raise MediaStreamError(str(e)) from e
        if playout.closed:
            raise MediaStreamError("the session ended")
        assert playout.start_wall is not None
        await _sleep_until(playout.start_wall + at_s)

    class PlayoutVideoTrack(MediaStreamTrack):
        kind = "video"

        def __init__(self) -> None:
            super().__init__()
            self.k = 0

        async def recv(self) -> av.VideoFrame:
            k = self.k
            self.k += 1
            await slot(k / playout.fps)
            frame = av.VideoFrame.from_ndarray(playout.video_frame(k), format="rgb24")
            frame.pts = k * (VIDEO_CLOCK // playout.fps)
            frame.time_base = Fraction(1, VIDEO_CLOCK)
            return frame

    class PlayoutAudioTrack(MediaStreamTrack):
        kind = "audio"

        def __init__(self) -> None:
            super().__init__()
            self.j = 0
            self.n = round(AUDIO_PACKET_S * playout.sample_rate)

        async def recv(self) -> av.AudioFrame:
            j = self.j
            self.j += 1
            await slot((j - OPUS_DELAY_PACKETS) * AUDIO_PACKET_S)
            x = playout.audio_samples(j, self.n)
            pcm = (np.clip(x, -1, 1) * 32767).astype(np.int16)[None]  # [1, n] packed s16
            frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
            frame.sample_rate = playout.sample_rate
            frame.pts = j * self.n
            frame.time_base = Fraction(1, playout.sample_rate)
            return frame

    return PlayoutVideoTrack(), PlayoutAudioTrack()


def require_aiortc() -> None:
    """Raise a ConfigError that says how to install WebRTC support when aiortc is missing."""
    try:
        import aiortc  # noqa: F401
    except ImportError:
        from avatarstream.errors import ConfigError

        raise ConfigError("WebRTC needs aiortc: pip install 'avatarstream[serve]'") from None


class WebRTCPeer:
    """One viewer of a session: an aiortc peer connection answering the viewer's offer."""

    def __init__(self, playout: Playout) -> None:
        from aiortc import RTCConfiguration, RTCPeerConnection

        self.playout = playout
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        self.video, self.audio = _tracks(playout)
        self.closed = asyncio.Event()

        @self.pc.on("connectionstatechange")
        async def _state() -> None:
            if self.pc.connectionState in ("failed", "closed"):
                self.closed.set()

    async def answer(self, sdp: str, kind: str = "offer") -> dict:
        """Take the viewer's offer; returns the answer {sdp, type} (ICE candidates included)."""
        from aiortc import RTCSessionDescription

        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type=kind))
        kinds = {t.kind for t in self.pc.getTransceivers()}
        if not {"audio", "video"} <= kinds:
            raise ValueError("the offer must receive one video and one audio track")
        self.pc.addTrack(self.video)  # takes the offer's recvonly transceiver of its kind
        self.pc.addTrack(self.audio)
        answer = await self.pc.createAnswer()
        await self.pc.setLocalDescription(answer)
        return {"sdp": self.pc.localDescription.sdp, "type": self.pc.localDescription.type}

    async def close(self) -> None:
        self.video.stop()
        self.audio.stop()
        await self.pc.close()
        self.closed.set()
