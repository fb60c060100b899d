"""An interrupt that lands between the scheduler starting an utterance and its first packet
(`bench server-soak` met it: one session in 240 ended with "the audio is empty (zero samples)")
cuts the utterance to one silent frame; the session goes on."""

from __future__ import annotations

import numpy as np
import torch

from avatarstream.live.segment import UtteranceAudio
from avatarstream.live.speech import SpeechQueue


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_an_utterance_interrupted_before_its_first_packet_is_one_silent_frame():
    clock = _Clock()
    q = SpeechQueue(now=clock)
    q.offer(np.ones(16000, np.float32))  # speech: the scheduler starts an utterance on it
    u = UtteranceAudio(q, start_sample=0, origin=clock.t, lead_s=0.2, now=clock)
    q.clear()  # the client's interrupt, before the utterance took anything
    out = list(u)
    assert u.interrupted and u.finished and u.speech == 0
    assert sum(x.numel() for x in out) == u.samples == 640  # one frame, not none
    assert all(torch.all(x == 0) for x in out)

