"""The RTMP sink: H.264 + AAC in FLV, pushed live to an RTMP(S) server, paced by the media clock.

Threads and queues
------------------
`write_video` / `write_audio` only stamp the chunk with its arrival time and append it to a bounded
inbox; they never wait for the encoder or the network, so a slow or dead server never stalls
generation. The sink's own thread takes the inbox, encodes it (`AVEncoder`, the encoder of the file
and HLS sinks, muxing into a packet list instead of a container) and sends the packets in timeline
order through FFmpeg's RTMP client (PyAV). Each chunk starts with a forced IDR keyframe, so a chunk
is a whole GOP.

Pacing
------
A packet of media time t is due at `anchor + t` (wall clock) and never leaves before it: the server
gets the stream at real-time pace even when generation runs ahead (the backlog waits in the sink).
A chunk that arrives after its due time (generation slower than real time) moves the anchor later,
so the stream pauses and continues at real time instead of bursting.

How far ahead generation may run: with `max_ahead_s` (what `generate --rtmp` uses), `write_*`
waits while the chunk would start more than `max_ahead_s` past the stream's current media time,
so the encoded backlog, and the memory it holds, stays bounded however long the run and however
fast the GPU (the run then takes about its media length, as the stream does anyway). The wait is on
the media clock only, never on the network: a server that stops answering does not hold it longer
(its packets go late and are dropped). Without it (`None`, a live session's sinks: they are written
on the scheduler thread, which must never wait, and a session's speech is bounded by its limits) the
backlog grows with how far generation runs ahead.

Dropping
--------
What cannot be sent in time is dropped and counted (`stats()`), never queued without limit:
- a chunk that finds `max_queue_s` of media of its kind already waiting in the inbox (the sender is
  stuck in a network write) is dropped whole;
- a packet more than `max_late_s` past its due time (the network fell behind, or the server is
  gone) is dropped; after a dropped video packet, video resumes at the next keyframe (the decoder
  stays sane), and so does a new connection.

Connections
-----------
Each connection is FFmpeg's `fifo` muxer around the FLV (RTMP) or MPEG-TS (SRT) muxer: FFmpeg
connects and writes on a thread of its own, without Python's GIL (PyAV opens a plain network output
holding the GIL, so a server that accepts and never answers would freeze the whole process), and
every network read and write there times out after `io_timeout_s` (`rw_timeout`). The fifo holds
`fifo_packets` packets; a write into a full fifo blocks the sink's thread only.

The URL is parsed strictly and shown without its secrets (rtmp_url.py). `reserve` (before any
work) checks that its host resolves and accepts TCP connections, and an rtmp:// stream then
connects to the address checked: a wrong URL or an unreachable server is one `ConfigError` /
`OutputError`. After that the sink never
fails a run for the network's sake: when a connection fails (refused, timed out, dropped by the
server) it connects again after an exponential back-off (`backoff_s`: 0.5 s doubling up to 8 s,
back to 0.5 s after a connection that was seen writing: more packets went into it than its fifo
holds), logs a warning each time and counts `reconnects` and `errors`; the timeline continues
(every connection stamps media time t as t + `TS_SHIFT`: timestamps keep increasing across a
reconnect). Frames handed to a connection that then fails are lost with it (at most the fifo's
worth). Only `close` of a stream that had network errors and no connection ever seen writing (a
server that refuses the stream: wrong application or key) raises an OutputError, with the last
reason.

Ending: `close` waits until the backlog is sent at its pace (at most its length + `max_late_s` +
`close_timeout_s`; a sender still stuck then is left behind with a warning, what it held counted as
dropped), then FFmpeg sends what its fifo holds and the stream's end, bounded by `io_timeout_s`.
PyAV writes that end holding the GIL, so ending a connection whose server stopped answering holds
the process for up to `io_timeout_s` (2 s): the one place the network can pause Python threads.

SRT: the FFmpeg inside PyAV's wheel is built without libsrt (no `srt` protocol), so `srt://` URLs
are refused by `reserve` with that reason; an FFmpeg with libsrt would take them (MPEG-TS over SRT).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import deque

import av

from avatarstream.errors import OutputError
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.publish.encoder import AVEncoder
from avatarstream.publish.output import os_reason
from avatarstream.publish.rtmp_packets import TS_SHIFT as TS_SHIFT  # the timeline's shift on the wire
from avatarstream.publish.rtmp_packets import PacketTap, Queued, close_quietly, dict_string, on_the_wire
from avatarstream.publish.rtmp_url import RTMPTarget, first_reachable, parse_rtmp_url, resolve

log = logging.getLogger(__name__)


class RTMPSink:
    """Publish H.264 + AAC live to `url` (rtmp://host[:port]/app/key, rtmps://...); see the module
    doc. `durable_frames` is the number of video frames sent to the server; `stats()` has the
    counters. `write_*` are called from one thread at a time and never block on the network (with
    `max_ahead_s` they wait on the media clock: module doc). `wait_on_close`
    False: `close` returns at once and the sink's thread sends the rest on its own (a live
    session's sinks are closed on the scheduler thread, which must not wait for a network)."""

    def __init__(self, url: str | RTMPTarget, *, crf: int = 23, preset: str = "veryfast",
                 max_queue_s: float = 4.0, max_late_s: float = 2.0,
                 backoff_s: tuple[float, float] = (0.5, 8.0), connect_timeout_s: float = 5.0,
                 io_timeout_s: float = 2.0, fifo_packets: int = 64, close_timeout_s: float = 10.0,
                 wait_on_close: bool = True, max_ahead_s: float | None = None,
                 address: str | None = None) -> None:
        self.target = url if isinstance(url, RTMPTarget) else parse_rtmp_url(url)
        self.url = self.target.shown  # never the secrets (rtmp_url.py)
        self.format = self.target.format
        self.address = address  # the IP every connection goes to (None: FFmpeg resolves the host)
        self.crf, self.preset = crf, preset
        self.max_queue_s, self.max_late_s = max_queue_s, max_late_s
        self.backoff_s = backoff_s
        self.connect_timeout_s, self.close_timeout_s = connect_timeout_s, close_timeout_s
        self.io_timeout_s, self.fifo_packets = io_timeout_s, fifo_packets
        self.wait_on_close = wait_on_close
        self.max_ahead_s = max_ahead_s
        self._written_s = {VideoChunk: 0.0, AudioChunk: 0.0}  # media time written, per kind
        self.ahead_waits_s = 0.0  # time write_* spent waiting for the media clock (max_ahead_s)
        self._first_write: float | None = None
        self.durable_frames = 0
        self.frames_dropped = 0
        self.audio_dropped_s = 0.0
        self.reconnects = 0
        self.errors = 0
        self.last_error: str | None = None
        self._inbox: deque[Queued] = deque()
        self._queued_s = {VideoChunk: 0.0, AudioChunk: 0.0}
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._enc: AVEncoder | None = None
        self._tap: PacketTap | None = None
        self._heap: list[tuple[float, int, av.Packet]] = []  # (media s, order, packet)
        self._order = itertools.count()
        self._anchor: float | None = None  # wall clock of media time 0
        self._last_t = 0.0  # media time of the latest packet encoded
        self._out: av.container.OutputContainer | None = None
        self._streams: dict = {}
        self._need_key = True
        self._connections = 0
        self._packets_on_connection = 0
        self._published = False  # a connection was seen writing to the server
        self._next_try = 0.0
        self._backoff = backoff_s[0]

    # -- before the run --------------------------------------------------------------------------
    def reserve(self) -> None:
        """Check that the server can be reached now (before any work): an OutputError when the
        host does not resolve or refuses connections, or the protocol is missing from FFmpeg.
        An rtmp:// stream then connects to the address checked (rtmp_url.py: no DNS rebinding);
        rtmps:// keeps the host name (TLS SNI)."""
        if self.target.scheme == "srt":
            self._check_protocol()
            return
        pinned = self.address or first_reachable(self.target, resolve(self.target),
                                                 self.connect_timeout_s)
        if self.target.scheme == "rtmp":
            self.address = pinned

    def _check_protocol(self) -> None:
        try:
            out = av.open(self.target.ffmpeg_url(), "w", format=self.format)
        except av.FFmpegError as e:
            raise OutputError(f"cannot publish to {self.url}: {self._scrub(e)}") from None
        try:
            out.add_stream("aac", rate=16000)
            out.start_encoding()  # opens the URL: "protocol not found" without libsrt
        except av.ProtocolNotFoundError:
            raise OutputError(f"cannot publish to {self.url}: this FFmpeg (PyAV {av.__version__}) "
                              f"has no {self.target.scheme} protocol") from None
        except (OSError, av.FFmpegError) as e:
            raise OutputError(f"cannot publish to {self.url}: {self._scrub(e)}") from None
        finally:
            close_quietly(out, self._scrub)

    def _scrub(self, e: BaseException | str) -> str:
        """An error's text without this URL's secrets."""
        text = e if isinstance(e, str) else (os_reason(e) or str(e))
        return self.target.scrub(text, self.address)

    # -- the Sink protocol -----------------------------------------------------------------------
    def open(self, width: int, height: int, fps: int, sample_rate: int) -> None:
        """Set up the encoders and start the sending thread (it connects at the first packet)."""
        self._tap = PacketTap(self.format)
        self._enc = AVEncoder(self._tap, width, height, fps, sample_rate,  # type: ignore[arg-type]
                              crf=self.crf, preset=self.preset, keyint=2 * fps)
        self._thread = threading.Thread(target=self._run, name="avatarstream-rtmp", daemon=True)
        self._thread.start()

    def write_video(self, chunk: VideoChunk) -> None:
        self._put(chunk)

    def write_audio(self, chunk: AudioChunk) -> None:
        self._put(chunk)

    def _put(self, chunk: VideoChunk | AudioChunk) -> None:
        """Queue a chunk for the sending thread, or drop it when its kind's queue is full."""
        if self._thread is None:
            raise RuntimeError("RTMPSink.open() must be called before writing")
        kind = type(chunk)
        with self._cond:
            self._hold_back(self._written_s[kind])
            self._written_s[kind] += Queued(chunk, 0.0).seconds
        item = Queued(chunk, time.monotonic())
        with self._cond:
            if self._queued_s[kind] + item.seconds > self.max_queue_s and self._queued_s[kind] > 0:
                self._count_drop(chunk, "the sender is behind (queue full)")
                return
            self._queued_s[kind] += item.seconds
            self._inbox.append(item)
            self._cond.notify()

    def _hold_back(self, start_s: float) -> None:
        """With `max_ahead_s`, wait (holding no lock but the condition's) until media time
        `start_s` is at most `max_ahead_s` ahead of the stream's clock, or the sink stops."""
        if self.max_ahead_s is None:
            return
        self._first_write = self._first_write or time.monotonic()
        while not self._stop:  # (the sender sets the anchor at its first chunk: the first write)
            anchor = self._first_write if self._anchor is None else self._anchor
            wait = anchor + start_s - self.max_ahead_s - time.monotonic()
            if wait <= 0:
                return
            t0 = time.monotonic()
            self._cond.wait(min(wait, 1.0))  # the anchor may move later: look again
            self.ahead_waits_s += time.monotonic() - t0

    def close(self) -> None:
        """Send what is queued (at its pace), end the stream and disconnect. An OutputError when
        there were network errors and no connection was ever seen writing (module doc)."""
        if self._thread is None:
            return
        with self._cond:
            self._inbox.append(Queued(None, time.monotonic()))
            self._cond.notify()
        if not self.wait_on_close:
            return
        self._join(self._backlog_s() + self.max_late_s + self.close_timeout_s)
        log.info("rtmp %s: %s", self.url, self.stats())
        if not self._published and self.last_error is not None:
            raise OutputError(f"nothing was published to {self.url}: {self.last_error}")

    def abort(self) -> None:
        """Stop now: drop what is queued and disconnect."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._join(self.close_timeout_s)

    def _join(self, timeout: float) -> None:
        assert self._thread is not None
        self._thread.join(timeout)
        if self._thread.is_alive():  # stuck in a network call: what it holds is never sent
            with self._cond:
                self._stop = True
                left = [item.chunk for item in self._inbox if item.chunk is not None]
                self._inbox.clear()
                self._cond.notify()
            for chunk in left:
                self._count_drop(chunk, "the server takes no data")
            self.frames_dropped += sum(p.stream.type == "video" for _, _, p in list(self._heap))
            log.warning("rtmp %s: the server takes no data; leaving its connection behind (%s)",
                        self.url, self.stats())
        self._thread = None

    def stats(self) -> dict:
        """Counters: video frames sent (handed to a connection) / dropped, audio dropped (s),
        reconnects, network errors (failed connections included), whether a connection is open,
        the last network error."""
        return {"url": self.url, "frames_sent": self.durable_frames,
                "frames_dropped": self.frames_dropped,
                "audio_dropped_s": round(self.audio_dropped_s, 3), "reconnects": self.reconnects,
                "errors": self.errors, "connected": self._out is not None,
                "last_error": self.last_error}

    # -- the sending thread ----------------------------------------------------------------------
    def _run(self) -> None:
        ending = False
        try:
            while True:
                with self._cond:
                    if self._stop:
                        return
                    items = list(self._inbox)
                    self._inbox.clear()
                    self._queued_s = {VideoChunk: 0.0, AudioChunk: 0.0}
                for item in items:
                    ending |= item.chunk is None
                    self._encode(item)
                if not self._heap:
                    if ending:
                        return
                    self._wait(None)
                    continue
                self._step()
        except Exception:  # noqa: BLE001 - a bug must not kill generation: log it, stop publishing
            log.exception("rtmp %s: the sender failed", self.url)
        finally:
            self._disconnect()
            if self._tap is not None:
                close_quietly(self._tap.codecs)

    def _wait(self, seconds: float | None) -> None:
        """Sleep until `seconds` passed or something new is queued (or the sink stops)."""
        with self._cond:
            if not self._inbox and not self._stop:
                self._cond.wait(seconds)

    def _encode(self, item: Queued) -> None:
        """Encode a queued chunk (or flush the encoders at the end) into timed packets."""
        assert self._enc is not None and self._tap is not None
        chunk = item.chunk
        if chunk is None:
            self._enc.finish()
        elif isinstance(chunk, VideoChunk):
            self._enc.add_video(chunk)
        else:
            self._enc.add_audio(chunk)
        for p in self._tap.packets:
            t = float(p.dts * p.time_base) if p.dts is not None else 0.0
            if self._anchor is None or self._anchor + t < item.arrived:
                if chunk is not None:  # late: move the schedule (the encoders' flush is never late)
                    self._anchor = item.arrived - t
            heapq.heappush(self._heap, (t, next(self._order), p))
            self._last_t = max(self._last_t, t)
        self._tap.packets.clear()

    def _step(self) -> None:
        """Drop, wait for or send the earliest packet (connecting first when needed)."""
        assert self._anchor is not None
        t, _, packet = self._heap[0]
        now = time.monotonic()
        due = self._anchor + t
        video = packet.stream.type == "video"
        if now - due > self.max_late_s or (video and self._need_key and not packet.is_keyframe):
            heapq.heappop(self._heap)
            self._drop(packet)
            return
        if self._out is None:
            if now >= self._next_try:
                self._connect()
            else:
                self._wait(min(self._next_try, due + self.max_late_s) - now)
            return
        if due > now:
            self._wait(due - now)
            return
        heapq.heappop(self._heap)
        try:
            packet.stream = self._streams[packet.stream.type]
            on_the_wire(packet)
            self._out.mux(packet)  # blocks (without the GIL) only while the fifo is full
        except (OSError, av.FFmpegError) as e:
            self._failed(e)
            self._drop(packet)
            return
        self._packets_on_connection += 1
        # more packets than the fifo holds went in: its thread connected and is writing them
        self._published |= self._packets_on_connection > self.fifo_packets
        if video:
            self.durable_frames += 1
            self._need_key = False

    def _drop(self, packet: av.Packet) -> None:
        if packet.stream.type == "video":
            self.frames_dropped += 1
            self._need_key = True
        else:
            self.audio_dropped_s += float((packet.duration or 0) * packet.time_base)

    def _count_drop(self, chunk: VideoChunk | AudioChunk, why: str) -> None:
        if isinstance(chunk, VideoChunk):
            self.frames_dropped += chunk.frames.shape[0]
            log.debug("rtmp: dropped %d frames: %s", chunk.frames.shape[0], why)
        else:
            self.audio_dropped_s += chunk.samples.shape[0] / chunk.sample_rate

    def _connect(self) -> None:
        """Start a connection: FFmpeg's fifo muxer connects and writes on a thread of its own
        (module doc), so this returns at once; a failure shows as an error of a later write."""
        assert self._enc is not None and self._tap is not None
        us = str(round(self.io_timeout_s * 1e6))
        try:
            self._tap.codecs.start_encoding()  # once: the streams' parameters, extradata included
            opts = {"rw_timeout": us, **self.target.ffmpeg_options(self.address)}
            out = av.open(self.target.ffmpeg_url(self.address), "w", format="fifo",
                          container_options={
                "fifo_format": self.format, "format_opts": dict_string(opts),
                "queue_size": str(self.fifo_packets), "attempt_recovery": "0"})
            self._streams = {"video": out.add_stream_from_template(self._enc.video),
                             "audio": out.add_stream_from_template(self._enc.audio)}
            out.start_encoding()
        except (OSError, av.FFmpegError) as e:  # no connection is made here: a bug, not the network
            raise RuntimeError(f"cannot set up the RTMP muxer: {self._scrub(e)}") from None
        self._out = out
        self._need_key = True
        if self._connections:
            self.reconnects += 1
            log.warning("rtmp %s: reconnecting (%d reconnects, %d frames dropped so far)",
                        self.url, self.reconnects, self.frames_dropped)
        self._connections += 1

    def _failed(self, e: BaseException) -> None:
        """The connection failed (refused, timed out, dropped by the server): end it and start a
        new one after the back-off; back-off doubles while no frame got through."""
        self.last_error = self._scrub(e)
        self.errors += 1
        if self._packets_on_connection > self.fifo_packets:
            self._backoff = self.backoff_s[0]
        self._disconnect()
        log.warning("rtmp %s: %s; connecting again in %.1f s", self.url,
                    self.last_error, self._backoff)
        self._next_try = time.monotonic() + self._backoff
        self._backoff = min(2 * self._backoff, self.backoff_s[1])

    def _disconnect(self) -> None:
        """End the connection: the fifo's thread sends what it holds (each network call bounded
        by `io_timeout_s`) and the trailer."""
        out, self._out = self._out, None
        self._packets_on_connection = 0
        if out is not None:
            close_quietly(out, self._scrub)

    def _backlog_s(self) -> float:
        """Seconds until the last packet encoded or queued is due (0 when nothing waits)."""
        if self._anchor is None:
            return 0.0
        with self._cond:
            queued = sum(item.seconds for item in self._inbox)
        return max(0.0, self._anchor + self._last_t + queued - time.monotonic())
