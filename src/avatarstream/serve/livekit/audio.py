"""The agent's own audio, at the room's rate, placed where the session speaks its 16 kHz copy.

The model hears 16 kHz; the room should hear what the agent sent (24 or 48 kHz TTS: a 16 kHz copy
has nothing above 8 kHz). The session decides where each piece of speech goes on its timeline
(bridging pauses, padding to whole frames, cutting on an interrupt), and publishes the 16 kHz
samples there. So the 16 kHz copy is the index, and the original is looked up through it:

- `Run`: the agent's audio between two resampler flushes (one utterance, or the part of one before
  a pause), at one input rate. It makes both copies from the same samples: the 16 kHz one (for the
  session's speech queue) and one at the output rate (the input itself when the rates agree, else
  LiveKit's resampler). Both resamplers are time-aligned (their hold-back delays when samples come
  out, not where they belong), so 16 kHz sample k of a run is output sample k * out_rate / 16000 of
  the same run: 24 kHz -> 1.5 k, 48 kHz -> 3 k. A 16 kHz sample is released to the queue only
  once its output-rate samples exist (the two resamplers hold back different amounts).
- `AgentAudio`: the queue's mirror. Every piece offered to the session's `SpeechQueue` is noted
  (its run, its first 16 kHz index, its samples) in queue order; `cleared` drops what an
  interrupt dropped. The session takes speech and publishes it at once, on its scheduler thread,
  so when an `AudioChunk` is published the queue's `taken` counter has moved by exactly the
  samples it carries (0 for silence the session made: a bridged pause, padding, idle). `place`
  pops that many from the mirror, checks that they are the chunk's samples (bit for bit: the
  session passes speech through unchanged), and returns the run's output-rate samples for it at
  output position start_sample * out_rate / 16000. Consecutive pieces of a run placed back to
  back stay contiguous, so the original is copied sample for sample.
- Anything it cannot vouch for (a published chunk that is not the speech the counter says was
  taken; an output-rate copy that is not there) falls back to the 16 kHz chunk upsampled for that
  span, counted in `fallback_samples` (16 kHz samples). Silence the session made needs nothing:
  the room's timeline is silent wherever nothing is placed.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np
from livekit import rtc

from avatarstream.media.timeline import SampleTimeline
from avatarstream.media.frames import AudioChunk

HIGH = rtc.AudioResamplerQuality.HIGH


def _resampler(src: int, dst: int) -> rtc.AudioResampler | None:
    return None if src == dst else rtc.AudioResampler(src, dst, quality=HIGH)


def _pcm(frames: list[rtc.AudioFrame]) -> np.ndarray:
    if not frames:
        return np.zeros(0, np.int16)
    return np.concatenate([np.frombuffer(f.data, np.int16) for f in frames])


def _push(r: rtc.AudioResampler | None, x: np.ndarray, rate: int) -> np.ndarray:
    """x (int16 mono at `rate`) through `r` (as is when there is none)."""
    return x if r is None else _pcm(r.push(rtc.AudioFrame(x.tobytes(), rate, 1, x.size)))


def to_int16(samples: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] -> int16 (the inverse of reading PCM16 as x / 32768: exact for those)."""
    return np.clip(np.round(samples * 32768.0), -32768, 32767).astype(np.int16)


class Run:
    """One stretch of the agent's audio at one rate, as a 16 kHz copy and an output-rate copy."""

    def __init__(self, rate: int, model_rate: int, out_rate: int) -> None:
        self.rate, self.model_rate, self.out_rate = rate, model_rate, out_rate
        self._to_model = _resampler(rate, model_rate)
        self._to_out = _resampler(rate, out_rate)
        self._lock = threading.Lock()  # the out copy: grown by the loop, read by the scheduler
        self._out: deque[tuple[int, np.ndarray]] = deque()  # (first output index, int16 samples)
        self.out_len = 0
        self.ended = False  # flushed: the out copy is complete
        self._held = np.zeros(0, np.int16)  # 16 kHz samples whose out copy is not there yet
        self.released = 0  # 16 kHz samples handed out: the index of the next one
        # where the run's last placed span ended (scheduler thread): session sample, k, j
        self.next_at: tuple[int, int, int] | None = None

    @property
    def holds_back(self) -> bool:
        """Whether some of what was pushed only comes out at `flush`."""
        return self._to_model is not None or self._to_out is not None

    def push(self, x: np.ndarray) -> tuple[int, np.ndarray]:
        """The agent's int16 samples in; (index in the run, 16 kHz samples) ready for the queue."""
        self._add_out(_push(self._to_out, x, self.rate))
        return self._release(_push(self._to_model, x, self.rate), everything=False)

    def flush(self) -> tuple[int, np.ndarray]:
        """End the run: what the resamplers held back comes out."""
        if self._to_out is not None:
            self._add_out(_pcm(self._to_out.flush()))
        tail = _pcm(self._to_model.flush()) if self._to_model is not None else np.zeros(0, np.int16)
        self.ended = True
        return self._release(tail, everything=True)

    def _add_out(self, x: np.ndarray) -> None:
        if x.size:
            with self._lock:
                self._out.append((self.out_len, x))
                self.out_len += x.size

    def _release(self, x16: np.ndarray, *, everything: bool) -> tuple[int, np.ndarray]:
        held = np.concatenate([self._held, x16])
        # 16 kHz sample k is covered once out samples up to round((k + 1) * ratio) exist (+1
        # spare); the input itself as the out copy is always ahead of its 16 kHz copy
        everything = everything or self._to_out is None
        covered = held.size if everything else max(
            0, min(held.size, (self.out_len - 1) * self.model_rate // self.out_rate - self.released))
        out, self._held = held[:covered], held[covered:]
        k0, self.released = self.released, self.released + out.size
        return k0, out

    def first_out_index(self, k: int) -> int:
        """The output-rate index of 16 kHz sample k: round(k * out_rate / model_rate)."""
        return (2 * k * self.out_rate + self.model_rate) // (2 * self.model_rate)

    def read(self, j0: int, j1: int) -> tuple[np.ndarray, int]:
        """Out samples [j0, j1) (zeros where there are none) and how many were missing.
        Reads go forward: what lies well before j0 is dropped."""
        out = np.zeros(j1 - j0, np.int16)
        with self._lock:
            while self._out and self._out[0][0] + self._out[0][1].size < j0 - 8:
                self._out.popleft()
            for start, x in self._out:
                lo, hi = max(j0, start), min(j1, start + x.size)
                if hi > lo:
                    out[lo - j0 : hi - j0] = x[lo - start : hi - start]
            missing = max(0, j1 - max(j0, self.out_len))
        return out, missing


class AgentAudio:
    """The mirror of a session's speech queue, in the agent's own audio (module doc)."""

    def __init__(self, model_rate: int, out_rate: int | None = None) -> None:
        self.model_rate = model_rate
        self.out_rate = out_rate  # None: the rate of the first audio the agent sends
        self.fallback_samples = 0
        self._lock = threading.Lock()
        self._queued: deque[tuple[Run, int, np.ndarray]] = deque()  # (run, first k, int16 16 kHz)
        self._seen = 0  # the queue's `taken` counter as of the last `place`

    def run(self, rate: int) -> Run:
        """A new run of the agent's audio at `rate` (the first one fixes the output rate)."""
        if self.out_rate is None:
            self.out_rate = rate
        return Run(rate, self.model_rate, self.out_rate)

    def out_index(self, sample: int) -> int:
        """The output-rate position of session sample `sample` (exact at every frame boundary)."""
        return sample * (self.out_rate or self.model_rate) // self.model_rate

    # -- the loop's side: what is offered to the queue ------------------------------------------
    def reserve(self, run: Run, k0: int, x16: np.ndarray) -> None:
        """Note a piece about to be offered to the queue (before: the scheduler may take it at once)."""
        with self._lock:
            self._queued.append((run, k0, x16))

    def cancel(self) -> None:
        """The piece last reserved was not queued."""
        with self._lock:
            self._queued.pop()

    def cleared(self, taken: int) -> None:
        """Interrupt: the queue dropped everything it had not handed out (`taken`, read after the
        clear); only what was taken and is not yet published stays."""
        with self._lock:
            keep = taken - self._seen
            kept: deque[tuple[Run, int, np.ndarray]] = deque()
            while keep > 0 and self._queued:
                run, k0, x = self._queued.popleft()
                kept.append((run, k0, x[:keep]))
                keep -= min(keep, x.size)
            self._queued = kept

    # -- the scheduler's side: what the session publishes ---------------------------------------
    def place(self, chunk: AudioChunk, taken: int) -> tuple[int, np.ndarray] | None:
        """Where the chunk goes on the room's timeline and what is heard there (int16 at the
        output rate); None for silence. `taken`: the queue's counter right after the chunk's
        speech was taken (module doc)."""
        pcm = to_int16(chunk.samples)
        n = pcm.size
        with self._lock:
            delta, self._seen = taken - self._seen, taken
            spans = self._pop(delta)
        if self.out_rate is None:  # nothing was ever pushed: the session's own silence
            return None
        a, b = self.out_index(chunk.start_sample), self.out_index(chunk.start_sample + n)
        if delta >= n:  # the last n taken are this chunk (what came before was not published)
            spans = _last(spans, n)
            if np.array_equal(np.concatenate([x for _, _, x in spans] or [pcm[:0]]), pcm):
                out = self._original(spans, chunk.start_sample)
                if out is not None:
                    return a, out
        if not pcm.any() and delta == 0:
            return None
        self.fallback_samples += n
        return a, self._upsampled(pcm, b - a)

    def _pop(self, n: int) -> list[tuple[Run, int, np.ndarray]]:
        """The next n samples of the mirror, in pieces (under the lock)."""
        out = []
        while n > 0 and self._queued:
            run, k0, x = self._queued.popleft()
            if x.size > n:
                self._queued.appendleft((run, k0 + n, x[n:]))
                x = x[:n]
            out.append((run, k0, x))
            n -= x.size
        return out

    def _original(self, spans: list[tuple[Run, int, np.ndarray]], start: int) -> np.ndarray | None:
        """The runs' output-rate samples for spans that follow one another from session sample
        `start`; None if some are not there."""
        pieces = []
        for run, k0, x in spans:
            end = start + x.size
            length = self.out_index(end) - self.out_index(start)
            cont = run.next_at
            j0 = cont[2] if cont is not None and cont[:2] == (start, k0) else run.first_out_index(k0)
            out, missing = run.read(j0, j0 + length)
            # a flushed run may end a sample short of its 16 kHz copy's span (rounding): silence
            if missing and not (run.ended and missing <= 2 * -(-run.out_rate // run.model_rate)):
                return None
            run.next_at = (end, k0 + x.size, j0 + length)
            pieces.append(out)
            start = end
        return np.concatenate(pieces)

    def _upsampled(self, pcm: np.ndarray, length: int) -> np.ndarray:
        """The 16 kHz chunk at the output rate (LiveKit's resampler), `length` samples."""
        assert self.out_rate is not None
        r = _resampler(self.model_rate, self.out_rate)
        if r is None:
            return pcm
        x = np.concatenate([_push(r, pcm, self.model_rate), _pcm(r.flush())])
        return np.pad(x[:length], (0, max(0, length - x.size)))


def _last(spans: list[tuple[Run, int, np.ndarray]], n: int) -> list[tuple[Run, int, np.ndarray]]:
    """The last n samples of `spans`."""
    out: list[tuple[Run, int, np.ndarray]] = []
    for run, k0, x in reversed(spans):
        if n <= 0:
            break
        if x.size > n:
            k0, x = k0 + x.size - n, x[-n:]
        out.append((run, k0, x))
        n -= x.size
    return out[::-1]


class Timeline(SampleTimeline):
    """The room's audio (int16 at the output rate), kept by sample index until its video frame
    takes it (`media.timeline.SampleTimeline`)."""
