"""SpeechQueue: the speech a live session has been given and not yet spoken.

Two inputs, one bounded queue each:
- streamed speech (`push` / `offer`: PCM from a WebSocket or a microphone) waits in a buffer of
  at most `max_buffer_s`. `push` blocks while it is full (back-pressure on a client that sends
  faster than real time; with a timeout it returns False: "slow down"); `offer` never blocks and
  queues a whole piece or nothing (what a network reader uses, so control messages are never
  stuck behind audio).
- scripted speech (`say`: a whole utterance from the server's own TTS) waits in a script of at
  most `max_script_s`; it is bounded by the text limits, not by the client's pace.

The session takes speech out with `take` (never blocks): streamed speech first, then the script.
`clear` drops both (interrupt) and bumps `epoch`, so whoever was speaking can tell that the
utterance was cut. `end_of_speech` marks the current utterance complete (the next `push` starts a
new one). `idle_timeout_s` ends the queue after that long with no speech, no keep-alive and nothing
queued; `close` ends it at once. The clock is injectable (`now`) for tests.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np


class SpeechQueue:
    def __init__(
        self,
        *,
        sample_rate: int = 16000,
        max_buffer_s: float = 5.0,
        max_script_s: float = 180.0,
        idle_timeout_s: float | None = None,
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_buffer_s <= 0 or max_script_s <= 0:
            raise ValueError("max_buffer_s and max_script_s must be positive")
        self.sample_rate = sample_rate
        self.max_buffered = max(1, round(max_buffer_s * sample_rate))
        self.max_script = max(1, round(max_script_s * sample_rate))
        self.idle_timeout_s = idle_timeout_s
        self._now = now
        self._cond = threading.Condition()
        self._buffer: deque[np.ndarray] = deque()  # streamed pieces, float32 [N], in push order
        self._buffered = 0
        self._script: deque[np.ndarray] = deque()  # TTS utterances, float32 [N]
        self._scripted = 0
        self._closed = False
        self.ended = False  # the current utterance is complete (end_of_speech, or cleared)
        self.epoch = 0  # bumped by every clear()
        self.peak_buffered = 0
        self.taken = 0  # samples handed out by take()
        self.idle_expired = False
        self._last_activity = now()

    # -- state -----------------------------------------------------------------------------------
    @property
    def buffered(self) -> int:
        """Samples waiting (streamed + scripted)."""
        return self._buffered + self._scripted

    @property
    def buffered_seconds(self) -> float:
        return self.buffered / self.sample_rate

    @property
    def closed(self) -> bool:
        return self._closed

    # -- client side -----------------------------------------------------------------------------
    def _append(self, x: np.ndarray) -> None:
        self._buffer.append(x.copy())
        self._buffered += x.size
        self.peak_buffered = max(self.peak_buffered, self._buffered)
        self.ended = False
        self._last_activity = self._now()
        self._cond.notify_all()

    def push(self, samples: np.ndarray, *, timeout: float | None = None) -> bool:
        """Queue float32 mono speech; blocks while the buffer is full.

        Returns False (nothing more queued) if `timeout` passes first or the queue is closed;
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
                self._append(x[pos : pos + take])
                pos += take
        return not self._closed

    def offer(self, samples: np.ndarray) -> bool:
        """Queue all of `samples` if they fit in the buffer now, else nothing (never blocks).

        False means "slow down and send this again later" (or: the queue is closed)."""
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        with self._cond:
            if not self._fits(x, self._buffered, self.max_buffered):
                return False
            if x.size:
                self._append(x)
        return True

    def _fits(self, x: np.ndarray, used: int, limit: int) -> bool:
        """Under the lock: note the client's activity; whether `x` fits (and the queue is open)."""
        self._last_activity = self._now()
        return not self._closed and used + x.size <= limit

    def say(self, samples: np.ndarray) -> bool:
        """Queue a whole scripted utterance (server-side TTS); False if the script is full/closed."""
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        with self._cond:
            if not self._fits(x, self._scripted, self.max_script):
                return False
            if x.size:
                self._script.append(x.copy())
                self._scripted += x.size
                self.ended = True  # a scripted utterance is complete in itself
                self._cond.notify_all()
        return True

    def end_of_speech(self) -> None:
        """The current utterance is complete: what is queued is spoken, then the avatar listens."""
        with self._cond:
            self.ended = True
            self._last_activity = self._now()
            self._cond.notify_all()

    def keep_alive(self) -> None:
        with self._cond:
            self._last_activity = self._now()

    def clear(self) -> float:
        """Drop everything queued (interrupt); returns the seconds dropped."""
        with self._cond:
            dropped = self._buffered + self._scripted
            self._buffer.clear()
            self._script.clear()
            self._buffered = self._scripted = 0
            self.ended = True
            self.epoch += 1
            self._last_activity = self._now()
            self._cond.notify_all()
        return dropped / self.sample_rate

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def check_idle(self) -> bool:
        """Close the queue if it has been idle past `idle_timeout_s`; True once closed that way."""
        with self._cond:
            if (not self._closed and self.idle_timeout_s is not None and not self.buffered
                    and self._now() - self._last_activity > self.idle_timeout_s):
                self.idle_expired = self._closed = True
                self._cond.notify_all()
            return self.idle_expired

    # -- session side ----------------------------------------------------------------------------
    def take(self, n: int) -> np.ndarray:
        """Up to `n` samples of queued speech (streamed first, then scripted); never blocks."""
        with self._cond:
            out: list[np.ndarray] = []
            need = n
            for q, attr in ((self._buffer, "_buffered"), (self._script, "_scripted")):
                while need and q:
                    head = q[0]
                    if head.size <= need:
                        out.append(q.popleft())
                        need -= head.size
                    else:
                        out.append(head[:need])
                        q[0] = head[need:]
                        need = 0
                    setattr(self, attr, getattr(self, attr) - out[-1].size)
            x = np.concatenate(out) if out else np.zeros(0, np.float32)
            self.taken += x.size
            if x.size:
                self._last_activity = self._now()
                self._cond.notify_all()  # room for a blocked push
            return x

    def drop_silence(self, n: int, threshold: float) -> int:
        """Drop leading pieces of `n` samples whose RMS is under `threshold` (a microphone's
        silence while nobody speaks); stops at the first louder piece. Returns samples dropped."""
        dropped = 0
        with self._cond:
            while self.buffered >= n or (self.buffered and self.ended):
                head = self._peek(n)
                if head.size == 0 or float(np.sqrt(np.mean(head.astype(np.float64) ** 2))) >= threshold:
                    break
                dropped += self.take(head.size).size
        return dropped

    def _peek(self, n: int) -> np.ndarray:
        out, need = [], n
        for q in (self._buffer, self._script):
            for piece in q:
                if not need:
                    break
                out.append(piece[:need])
                need -= out[-1].size
        return np.concatenate(out) if out else np.zeros(0, np.float32)

    def wait(self, timeout: float) -> None:
        """Sleep until something is queued, cleared or closed, or `timeout` passes."""
        with self._cond:
            if not self.buffered and not self._closed:
                self._cond.wait(timeout)
