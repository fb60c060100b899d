"""What the RTMP sink's thread sends (rtmp.py): the encoders' packets collected instead of muxed,
the chunks waiting in its inbox, timestamps as they go on the wire, and FFmpeg's option strings."""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import av

from avatarstream.media.frames import AudioChunk, VideoChunk

log = logging.getLogger("avatarstream.publish.rtmp")

_MS = Fraction(1, 1000)  # FLV's time base
# added to every timestamp on the wire: the AAC encoder's first packet (its priming, 1024 samples:
# 64 ms at 16 kHz) comes before media time 0, and the FLV muxer would shift a connection that
# starts with a negative timestamp to 0 (only the first one: the timeline would jump back 64 ms
# at a reconnect)
TS_SHIFT = Fraction(1, 10)


class PacketTap:
    """Stands in for the output container of an `AVEncoder`: its streams come from a container
    that is never written (FLV, so the encoders put SPS/PPS and AAC config in the extradata each
    new connection's FLV header needs), and what the encoder muxes is collected."""

    def __init__(self, fmt: str) -> None:
        self.codecs = av.open(_Discard(), "w", format=fmt)
        self.packets: list[av.Packet] = []

    def add_stream(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return self.codecs.add_stream(*args, **kwargs)

    def mux(self, packets: list[av.Packet]) -> None:
        self.packets.extend(packets)


class _Discard(io.RawIOBase):
    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[no-untyped-def,override]
        return len(b)


@dataclass(frozen=True)
class Queued:
    chunk: VideoChunk | AudioChunk | None  # None: the end of the stream
    arrived: float

    @property
    def seconds(self) -> float:
        c = self.chunk
        if isinstance(c, VideoChunk):
            return c.frames.shape[0] / c.fps
        return 0.0 if c is None else c.samples.shape[0] / c.sample_rate


def on_the_wire(packet: av.Packet) -> None:
    """Restamp a packet in FLV's milliseconds, `TS_SHIFT` later."""
    tb = packet.time_base
    packet.pts = round((packet.pts * tb + TS_SHIFT) / _MS)
    packet.dts = round((packet.dts * tb + TS_SHIFT) / _MS)
    packet.duration = round(packet.duration * tb / _MS)
    packet.time_base = _MS


def close_quietly(out: av.container.OutputContainer,
                  scrub: Callable[[BaseException], str] = str) -> None:
    try:
        out.close()
    except (OSError, av.FFmpegError) as e:  # FFmpeg's message names the URL: `scrub` it
        log.debug("closing a failed connection: %s", scrub(e))


def dict_string(options: dict[str, str]) -> str:
    """`options` as FFmpeg's "k=v:k2=v2" string, each special character escaped."""
    def esc(text: str) -> str:
        return re.sub(r"([\\:='])", r"\\\1", text)

    return ":".join(f"{esc(k)}={esc(v)}" for k, v in options.items())
