"""PocketSphinx in a process of its own, for bot.py's speech-to-text service.

PocketSphinx's decoder holds Python's GIL while it decodes (about 0.4 s for a short sentence on
this CPU). In the agent's process that would stop the event loop, and with it the WebRTC
sending: the browser's audio jitter buffer then grows by the stall and its A/V sync chases it
for seconds. So the decoder runs here, one process, one decoder, started once (spawn: nothing
of the agent's threads or model is copied)."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor
from functools import lru_cache

RATE = 16000
_decoder = None


def decode(pcm: bytes) -> str:
    """PCM16 mono at 16 kHz -> the decoder's best hypothesis ("" for none). In the worker."""
    global _decoder
    if _decoder is None:
        from pocketsphinx import Decoder

        _decoder = Decoder(samprate=RATE, loglevel="FATAL")
    _decoder.start_utt()
    _decoder.process_raw(pcm, full_utt=True)
    _decoder.end_utt()
    hyp = _decoder.hyp()
    return "" if hyp is None else hyp.hypstr.strip()


@lru_cache(maxsize=1)
def pool() -> ProcessPoolExecutor:
    """The one worker process (made on first use, its decoder loaded at once)."""
    p = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
    warm: Future = p.submit(decode, bytes(2 * RATE // 10))
    warm.add_done_callback(lambda f: f.exception())  # a failure shows on the first real decode
    return p
