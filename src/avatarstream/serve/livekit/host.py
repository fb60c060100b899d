"""AvatarHost: the worker's one model, one ChunkScheduler and one admission, shared by its rooms.

The pieces `avatarstream serve` builds (serve/app.py), reused: the live chunk length
(`live_chunk`), one `ChunkScheduler` that batches the chunks of every session talking at once,
and its `Capacity`, measured at start-up (`calibrate`) or given by the operator. A room is one
`LiveSession` on that scheduler, admitted by the scheduler's own `admit`.

Sessions in a room differ from the server's in three settings (`room_session_config`): the
agent's audio is played as it comes, its silences included (`silence_rms` 0: nothing is dropped
as a microphone's background, so the audio out is the audio in); the room, not an idle timeout,
ends the session; and nobody reads `frames()` (the generator attaches its own sink).

Load, what LiveKit's dispatcher is told (`load`): 1.0 when admission would refuse one more
session (at capacity, or the sessions already open falling behind real time), else the share of
the capacity in use (open sessions / max_sessions). The worker registers with a load threshold of
1.0 (`LOAD_THRESHOLD`), so the dispatcher sends a room exactly while admission would accept it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

import torch

from avatarstream.engine.config import ModelSet
from avatarstream.live.capacity import Capacity, calibrate
from avatarstream.live.prepared import PreparedReference, prepare_reference
from avatarstream.live.scheduler import ChunkScheduler
from avatarstream.live.session import LiveSession, LiveSessionConfig
from avatarstream.publish.base import Sink
from avatarstream.serve.app import live_chunk
from avatarstream.serve.sessions import AdmissionError

log = logging.getLogger(__name__)

LOAD_THRESHOLD = 1.0  # the dispatcher stops sending rooms at load 1.0: when admission refuses


def room_session_config(base: LiveSessionConfig | None = None) -> LiveSessionConfig:
    """The live-session settings of a room (module doc)."""
    return dataclasses.replace(base or LiveSessionConfig(), silence_rms=0.0, idle_timeout_s=None,
                               max_out_items=0)


class AvatarHost:
    def __init__(self, models: ModelSet, reference: torch.Tensor, *,
                 max_sessions: int | None = None, batching: bool = True,
                 seconds_per_chunk: float | None = None,
                 session: LiveSessionConfig | None = None) -> None:
        """reference: [F, 3, H, W] uint8 at the model's output size, the face of every room.
        max_sessions: None measures the capacity at `start` (as `serve` does)."""
        self.models = dataclasses.replace(models, config=dataclasses.replace(
            models.config, chunk=live_chunk(models.config, seconds_per_chunk)))
        self.reference = reference
        self.max_sessions = max_sessions
        self.session_config = room_session_config(session)
        self.scheduler = ChunkScheduler(self.models, batching=batching)
        self.prepared: PreparedReference | None = None
        self.refused = 0
        self._lock = threading.Lock()  # admission and opening are one step

    @property
    def capacity(self) -> Capacity | None:
        return self.scheduler.capacity

    def start(self) -> None:
        """Prepare the face once, measure (or set) the capacity, start the scheduler."""
        self.prepared = prepare_reference(self.models, self.reference)
        if self.max_sessions is None:
            self.scheduler.capacity = calibrate(self.models, self.prepared)
        else:
            self.scheduler.capacity = Capacity(max_sessions=self.max_sessions)
        log.info("capacity %s", self.scheduler.capacity.as_dict())
        self.scheduler.start()

    def stop(self) -> None:
        """End every room's session and stop the scheduler."""
        self.scheduler.stop()

    def admit(self) -> str | None:
        """None if one more room can be served in real time, else why not."""
        return self.scheduler.admit()

    def load(self) -> float:
        """What the dispatcher is told (module doc): 1.0 = send no more rooms."""
        cap = self.scheduler.capacity
        if cap is None or not cap.max_sessions or self.admit() is not None:
            return 1.0
        live = sum(1 for s in self.scheduler.sessions if not s.finished)
        return min(1.0, live / cap.max_sessions)

    def open(self, *, sinks: Sequence[Sink] = (),
             on_event: Callable[[dict], None] | None = None) -> LiveSession:
        """A started session for one room (raises AdmissionError when it cannot be served)."""
        assert self.prepared is not None, "start() the host first"
        with self._lock:
            reason = self.admit()
            if reason is not None:
                self.refused += 1
                raise AdmissionError(reason)
            session = LiveSession(self.models, self.reference, prepared=self.prepared,
                                  config=self.session_config, sinks=sinks,
                                  scheduler=self.scheduler, on_event=on_event)
            session.start()
        return session
