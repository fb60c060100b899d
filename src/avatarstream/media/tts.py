"""The text front end of a live session: text -> speech the avatar then speaks.

Built in: the espeak-ng and flite voices of `avatarstream.media.speech` (the same synthesiser the
synthetic data domain uses; here only its audio is taken, never its phone annotations, so nothing
of the renderer reaches the model). Optional: a piper neural voice (`pip install
'avatarstream[piper]'`, and a voice model `.onnx` given to the server with --piper-voice), whose
id is "piper".

Leading silence is trimmed to 20 ms so the avatar starts speaking when the speech does, and every
result is float32 mono at 16 kHz.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

from avatarstream.errors import InputError

DEFAULT_VOICE = "espeak:en-us+f2"
SAMPLE_RATE = 16000
MAX_CHARS = 2000

log = logging.getLogger(__name__)


def trim_leading_silence(x: np.ndarray, *, threshold: float = 0.01, keep_s: float = 0.02,
                         sample_rate: int = SAMPLE_RATE) -> np.ndarray:
    loud = np.flatnonzero(np.abs(x) > threshold)
    if not loud.size:
        return x
    start = max(0, int(loud[0]) - round(keep_s * sample_rate))
    return x[start:]


class TextToSpeech:
    def __init__(self, *, piper_voice: str | Path | None = None, max_chars: int = MAX_CHARS) -> None:
        self.max_chars = max_chars
        self.piper_voice = Path(piper_voice) if piper_voice else None
        self._piper = None
        self._lock = threading.Lock()
        self._synth = None

    def voices(self) -> list[dict]:
        from avatarstream.media.speech import VOICES

        out = [{"id": v.id, "engine": v.engine, "language": v.language} for v in VOICES]
        if self.piper_voice is not None:
            out.append({"id": "piper", "engine": "piper", "language": "?"})
        return out

    def warm(self) -> None:
        """Load the built-in engine now (the server's start-up), not on the first request: its
        first synthesis would add to that session's time to first frame."""
        try:
            self.speak("Hello.")
        except Exception:  # noqa: BLE001 - a missing engine is reported by the request that needs it
            log.warning("text to speech is not available", exc_info=True)

    def speak(self, text: str, voice: str | None = None) -> np.ndarray:
        """Speech for `text` (float32 [N] at 16 kHz). InputError for empty/too long text or an
        unknown voice."""
        if not isinstance(text, str) or not text.strip():
            raise InputError("nothing to say: the text is empty")
        if len(text) > self.max_chars:
            raise InputError(f"the text is {len(text)} characters long; the limit is "
                             f"{self.max_chars} (send it in parts)")
        voice = voice or DEFAULT_VOICE
        if voice == "piper":
            x = self._speak_piper(text)
        else:
            from avatarstream.media.speech import SpeechSynthesizer, voice_by_id

            v = voice_by_id(voice)
            with self._lock:
                if self._synth is None:
                    self._synth = SpeechSynthesizer(cache_size=16)
            x = self._synth.speak(text, v).audio
        return trim_leading_silence(np.asarray(x, np.float32))

    def _speak_piper(self, text: str) -> np.ndarray:
        if self.piper_voice is None:
            raise InputError("the piper voice is not configured on this server (start it with "
                             "--piper-voice MODEL.onnx)")
        try:
            from piper import PiperVoice
        except ImportError:
            raise InputError("piper is not installed: pip install 'avatarstream[piper]'") from None
        from avatarstream.media.speech import to_16k

        with self._lock:
            if self._piper is None:
                self._piper = PiperVoice.load(str(self.piper_voice))
            chunks = list(self._piper.synthesize(text))
        if not chunks:
            raise InputError("piper produced no audio for this text")
        x = np.concatenate([np.asarray(c.audio_float_array, np.float32).reshape(-1) for c in chunks])
        return to_16k(x, int(chunks[0].sample_rate))
