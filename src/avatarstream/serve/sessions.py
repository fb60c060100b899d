"""SessionManager: the server's open live sessions on its one model and one ChunkScheduler.

A session entry holds the LiveSession, its owner (key fingerprint) and token, its files (live
HLS), its WebRTC viewer (one at a time: a new offer replaces the old viewer) and the WebSockets
that receive its events. Events are produced on the scheduler thread and handed to the event
loop (`call_soon_threadsafe`) before they reach a socket.

Sessions do not outlive the server: a stopping server closes every session's sockets with 1001
(going away) and a reason, and a starting one removes the session folders a killed one left.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import secrets
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from aiohttp import WSCloseCode, web

from avatarstream.engine.config import ModelSet
from avatarstream.serve.hls import FMP4HLSSink
from avatarstream.live.prepared import PreparedReference
from avatarstream.live.scheduler import ChunkScheduler
from avatarstream.live.session import LiveSession
from avatarstream.live.sinks import BackgroundSink
from avatarstream.publish.rtmp import RTMPSink

if TYPE_CHECKING:
    from avatarstream.serve.config import ServerConfig
    from avatarstream.serve.webrtc import Playout, WebRTCPeer

log = logging.getLogger(__name__)


class AdmissionError(Exception):
    """A new session would not be served in real time (HTTP 503, with the reason)."""


TRIM_EVERY_S = 5.0  # at most this often, once sessions have ended, free memory goes back


def release_free_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc `malloc_trim`); False where
    there is no glibc. A session's frames, encoders and peers are freed when it ends, but glibc
    keeps freed pages inside its heaps (one per allocating thread): after 12 rounds of 20
    clients the server held 634 MB without this, 452 MB with it (`bench server-soak`), while
    its live Python objects stayed the same from round to round."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


@dataclass
class Entry:
    session: LiveSession
    owner: str
    token: str
    dir: Path
    hls: bool = False
    rtmp: RTMPSink | None = None  # pushing the session to an RTMP server
    peer: WebRTCPeer | None = None
    playout: Playout | None = None
    sockets: set[web.WebSocketResponse] = field(default_factory=set)
    playout_start_s: float | None = None

    def broadcast(self, event: dict) -> None:
        """Send an event to every open socket of the session (event loop only)."""
        for ws in list(self.sockets):
            if ws.closed:
                self.sockets.discard(ws)
                continue
            asyncio.ensure_future(_send(ws, event))


async def _send(ws: web.WebSocketResponse, event: dict) -> None:
    try:
        await ws.send_json(event)
    except (ConnectionError, RuntimeError):  # the socket went away meanwhile
        pass


class SessionManager:
    def __init__(self, models: ModelSet, config: ServerConfig, scheduler: ChunkScheduler) -> None:
        self.models, self.config, self.scheduler = models, config, scheduler
        self.dir = config.data_dir / "sessions"
        if self.dir.is_dir():  # left by a server that was killed: those sessions are gone
            for d in self.dir.iterdir():
                if d.is_dir():
                    shutil.rmtree(d, ignore_errors=True)
                else:
                    d.unlink(missing_ok=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.entries: dict[str, Entry] = {}
        self.playout_delay_s = config.playout_delay_s if config.playout_delay_s is not None else 0.5
        self.refused = 0
        self._trim_due: float | None = None  # when ended sessions' memory goes back (reap)

    def open(self, owner: str, frames: torch.Tensor, prepared: PreparedReference, *,
             hls: bool = False, rtmp: RTMPSink | None = None) -> tuple[str, Entry]:
        """Start a session (raises AdmissionError when it cannot be served in real time);
        `rtmp`: a reserved RTMP sink the session's output is also pushed to (it never blocks the
        scheduler: it encodes and sends on its own thread)."""
        reason = self.scheduler.admit()
        if reason is not None:
            self.refused += 1
            raise AdmissionError(reason)
        loop = asyncio.get_running_loop()
        sid = secrets.token_hex(12)
        d = self.dir / sid
        sinks = []
        if hls:
            sinks.append(BackgroundSink(FMP4HLSSink(d / "hls",
                                                    segment_seconds=self.config.hls_segment_seconds)))
        if rtmp is not None:
            sinks.append(rtmp)
        # Viewers attach their own sinks; nobody reads frames(): keep no in-process frame queue.
        live = dataclasses.replace(self.config.session, max_out_items=0)
        holder: list[Entry] = []

        def on_event(event: dict) -> None:
            if holder:
                loop.call_soon_threadsafe(holder[0].broadcast, event)

        session = LiveSession(self.models, frames, prepared=prepared, config=live, sinks=sinks,
                              scheduler=self.scheduler, on_event=on_event)
        entry = Entry(session, owner, secrets.token_urlsafe(24), d, hls=hls, rtmp=rtmp)
        holder.append(entry)
        self.entries[sid] = entry
        session.start()
        return sid, entry

    async def attach_viewer(self, entry: Entry, sdp: str, kind: str) -> dict:
        """A WebRTC viewer for the session (replacing any previous one); returns the answer."""
        from avatarstream.serve.webrtc import Playout, WebRTCPeer

        await self.detach_viewer(entry)
        s = entry.session
        assert s.origin is not None
        playout = Playout(origin=s.origin, fps=s.fps, sample_rate=s.sample_rate,
                          delay_s=self.playout_delay_s)

        def started(media_s: float) -> None:
            entry.playout_start_s = media_s
            entry.broadcast({"type": "playout", "media_s": round(media_s, 4),
                             "delay_s": round(self.playout_delay_s, 3)})

        playout.on_start.append(started)
        s.add_sink(playout)
        peer = WebRTCPeer(playout)
        entry.peer, entry.playout = peer, playout
        try:
            return await peer.answer(sdp, kind)
        except Exception:
            await self.detach_viewer(entry)
            raise

    async def detach_viewer(self, entry: Entry) -> None:
        peer, playout = entry.peer, entry.playout
        entry.peer = entry.playout = None
        entry.playout_start_s = None
        if playout is not None:
            entry.session.remove_sink(playout)
        if peer is not None:
            await peer.close()

    async def close(self, sid: str, code: int = WSCloseCode.OK, reason: str | None = None) -> None:
        """End the session, close its sockets with `code` and `reason` (default: why it ended)
        and remove its files."""
        entry = self.entries.pop(sid, None)
        if entry is None:
            return
        await self.detach_viewer(entry)
        await asyncio.to_thread(entry.session.stop, 10.0)
        reason = reason or f"the session ended ({entry.session.end_reason or 'stopped'})"
        for ws in list(entry.sockets):
            await ws.close(code=code, message=reason.encode()[:123])
        shutil.rmtree(entry.dir, ignore_errors=True)
        if self._trim_due is None:
            self._trim_due = time.monotonic() + TRIM_EVERY_S

    async def reap(self) -> None:
        """Clean up sessions that ended on their own (idle timeout, failure), and viewers whose
        connection failed."""
        for sid, e in list(self.entries.items()):
            if not e.session.running:
                await self.close(sid)
            elif e.peer is not None and e.peer.closed.is_set():
                await self.detach_viewer(e)
        if self._trim_due is not None and time.monotonic() >= self._trim_due:
            self._trim_due = None
            await asyncio.to_thread(release_free_memory)

    async def close_all(self) -> None:
        """The server is stopping: every session ends, its clients told so."""
        for sid in list(self.entries):
            await self.close(sid, WSCloseCode.GOING_AWAY, "the server is shutting down; open a "
                             "new session when it is back")

    def live_count(self) -> int:
        return sum(1 for e in self.entries.values() if e.session.running)
