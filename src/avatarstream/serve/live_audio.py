"""LiveAudioSource: the audio iterator a live session hands to the Pipeline.

A client pushes speech (`push`); the pipeline pulls fixed-size packets (`__next__`). When no
speech is buffered the source hands out silence, paced against the wall clock so the media
timeline never runs more than `lead_s` ahead of real time: the avatar keeps idling/listening and
the stream never stalls, while speech pushed later enters the timeline at the next pull.

Bounds: at most `max_buffer_s` of speech waits here. `push` blocks while the buffer is full
(back-pressure on a client that sends faster than real time); with a timeout it returns False
when the audio could not be queued in time ("slow down"). `offer` never blocks: it queues a
whole piece or nothing (what a network reader uses, so control messages are never stuck behind
audio). `clear` drops the buffered speech
(interrupt); `close` ends the iterator; `idle_timeout_s` ends it after that long with neither
speech nor keep-alive.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch


class LiveAudioSource:
    def __init__(
        self,
        *,
        sample_rate: int = 16000,
        packet_s: float = 0.04,
        max_buffer_s: float = 5.0,
        lead_s: float = 0.3,
        idle_timeout_s: float | None = None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_buffer_s <= 0 or packet_s <= 0 or lead_s < 0:
            raise ValueError("max_buffer_s and packet_s must be positive, lead_s >= 0")
        self.sample_rate = sample_rate
        self.packet = max(1, round(packet_s * sample_rate))
        self.max_buffered = max(self.packet, round(max_buffer_s * sample_rate))
        self.lead_s = lead_s
        self.idle_timeout_s = idle_timeout_s
        self._now = now
        self._cond = threading.Condition()
        self._speech: deque[np.ndarray] = deque()  # pieces of float32 [N] in push order
        self._buffered = 0  # samples in self._speech
        self._closed = False
        self.emitted = 0  # samples handed to the pipeline (speech + silence)
        self.speech_emitted = 0
        self.peak_buffered = 0
        self.idle_expired = False
        self._t0: float | None = None  # wall time of the first pull (media time 0)
        self._last_activity = now()

    # -- client side -----------------------------------------------------------------------------
    @property
    def buffered_seconds(self) -> float:
        return self._buffered / self.sample_rate

    @property
    def closed(self) -> bool:
        return self._closed

    def push(self, samples: np.ndarray, *, timeout: float | None = None) -> bool:
        """Queue float32 mono speech; blocks while the buffer is full.

        Returns False (nothing more queued) if `timeout` passes first or the source is closed;
        pieces longer than the whole buffer are queued part by part as room frees up.
        """
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        deadline = None if timeout is None else self._now() + timeout
        with self._cond:
            self._last_activity = self._now()
            pos = 0
            while pos < x.size:
                while self._buffered >= self.max_buffered and not self._closed:
                    left = None if deadline is None else deadline - self._now()
                    if left is not None and left <= 0:
                        return False
                    self._cond.wait(left)
                if self._closed:
                    return False
                take = min(x.size - pos, self.max_buffered - self._buffered)
                self._speech.append(x[pos : pos + take].copy())
                self._buffered += take
                self.peak_buffered = max(self.peak_buffered, self._buffered)
                pos += take
                self._last_activity = self._now()
                self._cond.notify_all()
        return True

    def offer(self, samples: np.ndarray) -> bool:
        """Queue all of `samples` if they fit in the buffer now, else nothing (never blocks).

        For a network reader that must stay responsive to control messages: a False answer
        means "slow down and send this again later"."""
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        with self._cond:
            self._last_activity = self._now()
            if self._closed or self._buffered + x.size > self.max_buffered:
                return False
            if x.size:
                self._speech.append(x.copy())
                self._buffered += x.size
                self.peak_buffered = max(self.peak_buffered, self._buffered)
                self._cond.notify_all()
        return True

    def keep_alive(self) -> None:
        with self._cond:
            self._last_activity = self._now()

    def clear(self) -> float:
        """Drop buffered speech (interrupt); returns the seconds dropped."""
        with self._cond:
            dropped = self._buffered
            self._speech.clear()
            self._buffered = 0
            self._last_activity = self._now()
            self._cond.notify_all()
        return dropped / self.sample_rate

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # -- pipeline side ---------------------------------------------------------------------------
    def __iter__(self) -> LiveAudioSource:
        return self

    def __next__(self) -> torch.Tensor:
        """The next packet: buffered speech, else paced silence; blocks until one is due."""
        with self._cond:
            if self._t0 is None:
                self._t0 = self._now()
            while True:
                if self._closed:
                    raise StopIteration
                if self._buffered:
                    return torch.from_numpy(self._take_speech())
                now = self._now()
                if (self.idle_timeout_s is not None
                        and now - self._last_activity > self.idle_timeout_s):
                    self.idle_expired = self._closed = True
                    self._cond.notify_all()
                    raise StopIteration
                wait = self.emitted / self.sample_rate - (now - self._t0) - self.lead_s
                if wait <= 0:
                    self.emitted += self.packet
                    return torch.zeros(self.packet)
                self._cond.wait(min(wait, 0.25))

    def _take_speech(self) -> np.ndarray:
        out, need = [], self.packet
        while need and self._speech:
            head = self._speech[0]
            if head.size <= need:
                out.append(self._speech.popleft())
                need -= head.size
            else:
                out.append(head[:need])
                self._speech[0] = head[need:]
                need = 0
        x = np.concatenate(out)
        self._buffered -= x.size
        self.emitted += x.size
        self.speech_emitted += x.size
        self._cond.notify_all()  # room for a blocked push
        return x
