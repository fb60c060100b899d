"""ServerConfig: how `avatarstream serve` runs (its data folder, keys, limits, sessions, chunks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from avatarstream.live.session import LiveSessionConfig
from avatarstream.serve.limits import Limits


@dataclass
class ServerConfig:
    data_dir: Path
    api_keys: frozenset[str] | None = None  # None: any non-empty bearer key
    limits: Limits = field(default_factory=Limits)  # what one request may cost
    session: LiveSessionConfig = field(default_factory=LiveSessionConfig)
    hls_segment_seconds: float = 1.0
    reap_every_s: float = 1.0  # how often ended (idle-timed-out) sessions are cleaned up
    max_sessions: int | None = None  # None: measured at start-up (calibrate)
    playout_delay_s: float | None = None  # None: derived from the model's measured chunk time
    piper_voice: str | None = None
    batching: bool = True
    # chunk length of every session and render, prefix overlap included; None: the model's own,
    # capped at LIVE_SECONDS_PER_CHUNK
    seconds_per_chunk: float | None = None
    # hosts (fnmatch patterns, e.g. "*.live-video.net") and IP networks a session's `rtmp_url`
    # may name (serve/rtmp_gate.py); the default "*" is any host on a public address: loopback,
    # private and link-local ones only when named
    rtmp_allow: tuple[str, ...] = ("*",)
    # the address of a Ray cluster that renders POST /v1/renders jobs (batch/remote.py), with this
    # many renderers; None: the server renders them itself
    batch_ray: str | None = None
    batch_workers: int = 1
