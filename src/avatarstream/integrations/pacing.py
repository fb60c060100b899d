"""One media clock for the avatar's images and speech, for transports that stamp what they are
given with the time they are given it.

    pacer = Pacer(fps=25, rate=30, origin=session.origin)   # origin: wall time of frame 0
    pacer.add(item, now)                 # each Frame / SegmentEnd of the session, in order
    for kind, item in pacer.step(now):   # ("audio", Frame) | ("image", Frame) | ("end", SegmentEnd)
        ...push it downstream now...
    await asleep(pacer.next_time(now) - now)   # or until the next add

Why: Pipecat's live video output (`video_out_is_live=True`) and its WebRTC transport take an
image's time from when it is written, not from the image. aiortc, under `SmallWebRTCTransport`,
counts frames: the k-th image written gets RTP time k / 30 s. A receiver lines audio and video
up by those RTP times (through RTCP sender reports), so the images must reach the transport one
per slot of a fixed grid at exactly its rate (30 fps for SmallWebRTC), never skipping a slot and
never two in one, and the speech at the moment its frame is due. With images sent whenever they
are made, or repeated on a tick of their own, the count drifts from the wall clock and a browser
shows the face hundreds of ms away from the voice.

So: image slots at `origin + k / rate` (a 25 fps model on a 30 fps grid repeats every fifth
frame), each showing the newest frame due by then, or the last one again when none has come in
time (the count stays exact). Speech: an utterance's first frame is released at its media time,
the rest at once as they come, so the transport plays it without gaps; its play-out then anchors
the video (the frame shown is the one being heard). If speech comes late (the transport ran dry
and played silence), the anchor moves to when it really plays and the images follow it; after
the utterance the images return to the media clock. Nothing here waits or touches Pipecat: the
caller pushes what `step` returns and sleeps until `next_time`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from avatarstream.integrations.local import Frame, SegmentEnd

TOLERANCE_S = 0.005  # speech released this late after the previous ran out is still gapless
MAX_BURST_S = 2.0  # after a stall longer than this the slot grid restarts instead of catching up


@dataclass
class _Anchor:
    time: float  # wall time its frame's audio starts playing
    frame: int


class Pacer:
    def __init__(self, fps: int, rate: int, origin: float | None = None,
                 slack_s: float = 0.1, video_delay_s: float | None = None) -> None:
        """fps: the model's frames per second; rate: image slots per second (the transport's
        video_out_framerate); origin: the wall time (monotonic) of frame 0, or None to take it
        from the first frame's arrival plus `slack_s` (frames that come paced, with jitter);
        video_delay_s: how much later than it is pushed an image is stamped, relative to speech
        (default one slot: Pipecat's live video output holds its first image one slot, and the
        transport's frame count starts there)."""
        self.fps, self.rate, self.origin, self.slack_s = fps, rate, origin, slack_s
        self.video_delay_s = 1.0 / rate if video_delay_s is None else video_delay_s
        self._frames: deque[Frame] = deque()  # images not yet due
        self._speech: deque[Frame | SegmentEnd] = deque()  # speech (and ends) not yet released
        self._slot: int | None = None
        self._shown: Frame | None = None
        self._anchor: _Anchor | None = None
        self._last: int | None = None  # the last frame whose audio was released
        self.audio_end = 0.0  # when the speech released so far has been played
        self.skipped_slots = 0

    # -- in ----------------------------------------------------------------------------------------
    def add(self, item: Frame | SegmentEnd, now: float) -> None:
        if isinstance(item, SegmentEnd):
            self._speech.append(item)
            return
        if self.origin is None:
            self.origin = now - item.index / self.fps + self.slack_s
        self._frames.append(item)
        if item.pcm is not None:
            self._speech.append(item)

    @property
    def speech_pending(self) -> bool:
        """Speech audio is held that has not been released yet (segment ends alone do not count)."""
        return any(not isinstance(x, SegmentEnd) for x in self._speech)

    def clear_speech(self, now: float) -> None:
        """An interruption: speech not yet released is dropped with its frames; what was
        released the transport drops itself, so the images go back to the media clock."""
        self._speech = deque(x for x in self._speech if isinstance(x, SegmentEnd))
        self._frames = deque(f for f in self._frames if f.pcm is None)
        self._anchor, self._last = None, None
        self.audio_end = min(self.audio_end, now)

    # -- out ---------------------------------------------------------------------------------------
    def media_time(self, index: int) -> float:
        assert self.origin is not None
        return self.origin + index / self.fps

    def slot_time(self, k: int) -> float:
        assert self.origin is not None
        return self.origin + k / self.rate

    def step(self, now: float) -> list[tuple[str, Frame | SegmentEnd]]:
        """What is due at `now`, in the order to push it: speech first, then images."""
        out: list[tuple[str, Frame | SegmentEnd]] = []
        self._release_speech(now, out)
        self._release_images(now, out)
        return out

    def next_time(self, now: float) -> float:
        """When `step` has something to do next (if nothing is added before)."""
        times = [now + 0.05]
        if self.origin is not None and self._slot is not None:
            times.append(self.slot_time(self._slot))
        elif self._frames:
            times.append(now)
        head = self._speech[0] if self._speech else None
        if isinstance(head, Frame) and not self._continues(head, now):
            times.append(max(self.media_time(head.index), self.audio_end))
        return max(now, min(times))

    def _continues(self, f: Frame, now: float) -> bool:
        """Whether `f`'s speech follows the released speech without a gap."""
        return (self._anchor is not None and self._last is not None and f.index == self._last + 1
                and now <= self.audio_end + TOLERANCE_S)

    def _release_speech(self, now: float, out: list) -> None:
        while self._speech:
            head = self._speech[0]
            if isinstance(head, SegmentEnd):
                out.append(("end", self._speech.popleft()))
                continue
            if self._continues(head, now):
                pass
            elif self._anchor is not None and self._last is not None and head.index == self._last + 1:
                self._anchor = _Anchor(now, head.index)  # came late: the transport played silence
            else:  # an utterance starts: at its media time, after what is still playing
                start = max(self.media_time(head.index), self.audio_end)
                if now < start:
                    return
                self._anchor = _Anchor(max(now, self.audio_end), head.index)
            self._speech.popleft()
            self._last = head.index
            assert self._anchor is not None
            self.audio_end = self._anchor.time + (head.index + 1 - self._anchor.frame) / self.fps
            out.append(("audio", head))

    def _target(self, t: float) -> int:
        """The frame for the slot pushed at wall time t: the one due (being heard, while speech
        plays, else on the media clock) at the middle of the slot as the transport stamps it."""
        t += self.video_delay_s + 0.5 / self.rate
        a = self._anchor
        if a is not None and t < self.audio_end:
            return a.frame + int((t - a.time) * self.fps + 1e-6)
        return int((t - self.media_time(0)) * self.fps + 1e-6)

    def _release_images(self, now: float, out: list) -> None:
        if self.origin is None or (self._shown is None and not self._frames):
            return
        if self._slot is None or now - self.slot_time(self._slot) > MAX_BURST_S:
            if self._slot is not None:
                self.skipped_slots += int((now - self.slot_time(self._slot)) * self.rate)
            self._slot = max(0, int((now - self.origin) * self.rate + 1e-6))
        while self.slot_time(self._slot) <= now:
            target = self._target(self.slot_time(self._slot))
            while self._frames and self._frames[0].index <= target:
                self._shown = self._frames.popleft()
            if self._shown is None:  # the first frame is not due yet
                self._slot += 1
                continue
            out.append(("image", self._shown))
            self._slot += 1
