"""Speech with exact phone timings, from the system's flite and espeak-ng.

Two engines, one result: an `Utterance` of float32 mono audio at 16 kHz (speech loudness
normalised so every voice sounds about as loud) and the `Phone`s that cover it from 0 to its
end without gaps, pauses included (`pau` for flite, `_` for espeak-ng).

- flite runs as a command (`flite -psdur -voice NAME -t TEXT -o FILE`): one run writes the wave
  and prints every segment with its end time. The times are the ones the waveform generator
  used, so they line up with the audio; the diphone voices (kal, kal16) only clip the final
  pause short, so the last phone is trimmed to the audio's end.
- espeak-ng runs in-process through ctypes (libespeak-ng.so.1, synchronous output): the synth
  callback hands over audio and phoneme events, each stamped with the sample at which the
  phoneme starts. espeak-ng starts and stops without silence, so 0.2 s of silence is added at
  both ends to match flite's leading and trailing pauses (every utterance of either engine
  starts and ends with about 0.2 s of pause).

Audio from both is resampled to 16 kHz with libswresample (its delay compensated, so times
keep) and scaled so the speech parts have the same RMS for every voice.

Checked on the whole corpus with every voice (`avatarstream.data.corpus`): pause phones are
quiet (99% of their 2.5 ms frames, 20 ms in from the edges, are 25 dB under the speech level),
and where a pause meets a vowel or sonorant the energy crosses that level within 5 ms of the
phone boundary for 90% of 410 edges (median 0 ms; > 20 ms: 0.7%, phrase-final fade-outs).

It lives in `media/` because inference speaks with it too (a live session's text front end,
`media/tts.py`, takes its audio); the synthetic data domain (`data/`) takes audio and phones.
"""

from __future__ import annotations

import _ctypes
import ctypes
import ctypes.util
import re
import shutil
import subprocess
import tempfile
import threading
import wave
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import av
import numpy as np

from avatarstream.errors import InputError

SAMPLE_RATE = 16000
ESPEAK_PAD_S = 0.2  # silence added before and after espeak-ng speech (flite has its own pauses)
TARGET_RMS = 0.1  # loudness of the speech parts after normalising (-20 dBFS)
PEAK = 0.95  # ... unless that would push a sample past this


@dataclass(frozen=True)
class Voice:
    """One synthetic voice: `id` is "engine:name" ("flite:slt", "espeak:de+m2")."""

    id: str
    engine: str  # "flite" | "espeak"
    language: str  # "en", "de", ...
    heldout: bool = False  # reserved for evaluation (the heldout-voice split)

    @property
    def name(self) -> str:
        """The engine's own name of the voice ("slt", "de+m2")."""
        return self.id.split(":", 1)[1]


def _espeak(name: str, language: str, heldout: bool = False) -> Voice:
    return Voice(f"espeak:{name}", "espeak", language, heldout)


VOICES: tuple[Voice, ...] = (
    Voice("flite:slt", "flite", "en"),
    Voice("flite:awb", "flite", "en"),
    Voice("flite:kal16", "flite", "en"),
    Voice("flite:kal", "flite", "en"),
    _espeak("en-us+m1", "en"), _espeak("en-us+f2", "en"),
    _espeak("en+m3", "en"), _espeak("en+f1", "en"),  # "en" is British English
    _espeak("de+m2", "de"), _espeak("de+f3", "de"),
    _espeak("fr+m1", "fr"), _espeak("fr+f2", "fr"),
    _espeak("es+m3", "es"), _espeak("es+f1", "es"),
    _espeak("it+m2", "it"), _espeak("it+f3", "it"),
    # held out: one flite voice, every Portuguese and Dutch voice
    Voice("flite:rms", "flite", "en", heldout=True),
    _espeak("pt+m1", "pt", True), _espeak("pt-br+f2", "pt", True),
    _espeak("nl+m3", "nl", True), _espeak("nl+f1", "nl", True),
)
_BY_ID = {v.id: v for v in VOICES}


def voice_by_id(voice_id: str) -> Voice:
    """The catalogue voice called `voice_id`; InputError if there is none."""
    try:
        return _BY_ID[voice_id]
    except KeyError:
        raise InputError(f"unknown voice {voice_id!r} (see avatarstream.media.speech.VOICES: "
                         f"{', '.join(_BY_ID)})") from None


class Phone(NamedTuple):
    """One phone (or pause) of an utterance; times in seconds from the start of its audio."""

    start: float
    end: float
    symbol: str  # flite: CMU phone ("pau" = pause); espeak: phoneme mnemonic ("_" = pause)
    engine: str  # "flite" | "espeak"


@dataclass
class Utterance:
    """Synthesised speech: `audio` float32 [samples] mono at `sample_rate`, and the `phones`
    that cover it from 0 to `duration` in order, without gaps."""

    text: str
    voice: Voice
    audio: np.ndarray  # [samples] float32 in [-1, 1]
    phones: list[Phone] = field(default_factory=list)
    sample_rate: int = SAMPLE_RATE

    @property
    def duration(self) -> float:
        """Seconds of audio."""
        return len(self.audio) / self.sample_rate


# ----------------------------------------------------------------------------------------- espeak
class _EspeakEventId(ctypes.Union):
    _fields_ = [("number", ctypes.c_int), ("name", ctypes.c_char_p), ("string", ctypes.c_char * 8)]


class _EspeakEvent(ctypes.Structure):
    """espeak_EVENT of speak_lib.h (40 bytes on x86-64)."""

    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
                ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
                ("user_data", ctypes.c_void_p), ("id", _EspeakEventId)]


_SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int,
                                   ctypes.POINTER(_EspeakEvent))
_AUDIO_OUTPUT_SYNCHRONOUS, _POS_CHARACTER, _CHARS_UTF8 = 2, 1, 1
_INIT_PHONEME_EVENTS, _INIT_DONT_EXIT = 0x0001, 0x8000
_EVENT_LIST_TERMINATED, _EVENT_PHONEME = 0, 7
_PARAM_RATE, _DEFAULT_RATE = 1, 175  # words per minute


class _EspeakLib:
    """libespeak-ng in this process. Its state is global, so every synthesis runs under one lock.

    The waveform generator keeps state from one utterance to the next (glottal phase, pitch
    flutter), so the same text would come out a few samples different each time. To be
    deterministic, every synthesis starts from a freshly loaded library (espeak_Terminate,
    dlclose, dlopen, espeak_Initialize: about 4 ms) and a fixed libc rand() seed, which
    espeak-ng uses for its noise.
    """

    _instance: _EspeakLib | None = None
    _create_lock = threading.Lock()

    def __init__(self) -> None:
        self._path = ctypes.util.find_library("espeak-ng") or "libespeak-ng.so.1"
        self._libc = ctypes.CDLL(None)  # the process's libc (already loaded)
        self._libc.srand.argtypes = [ctypes.c_uint]
        self._lock = threading.Lock()
        self._chunks: list[np.ndarray] = []
        self._events: list[tuple[int, str]] = []  # (sample, mnemonic) of each phoneme start
        self._callback = _SYNTH_CALLBACK(self._on_synth)  # kept referenced: the library calls it
        self._lib: ctypes.CDLL | None = None
        self._used = False
        self.sample_rate = 0
        self._load()

    @classmethod
    def get(cls) -> _EspeakLib:
        with cls._create_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _load(self) -> None:
        try:
            lib = ctypes.CDLL(self._path)
        except OSError:
            raise InputError("espeak-ng voices need libespeak-ng.so.1: install espeak-ng "
                             "(apt-get install espeak-ng) or pick a flite voice") from None
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_Synth.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
                                     ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        self.sample_rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 200, None,
                                                 _INIT_PHONEME_EVENTS | _INIT_DONT_EXIT)
        if self.sample_rate <= 0:
            raise InputError("espeak-ng could not start (its data folder is missing?); reinstall espeak-ng")
        lib.espeak_SetSynthCallback(self._callback)
        self._lib, self._used = lib, False

    def _reload(self) -> None:
        """Unload and load the library again: every static variable back to its initial value."""
        assert self._lib is not None
        self._lib.espeak_Terminate()
        _ctypes.dlclose(self._lib._handle)
        self._lib = None
        self._load()

    def _on_synth(self, wav: ctypes.Array, n: int, events: ctypes.Array) -> int:
        if n > 0 and wav:
            self._chunks.append(np.ctypeslib.as_array(wav, (n,)).copy())
        i = 0
        while events[i].type != _EVENT_LIST_TERMINATED:
            e = events[i]
            if e.type == _EVENT_PHONEME:
                self._events.append((e.sample, e.id.string.decode("ascii", "replace")))
            i += 1
        return 0  # go on

    def synth(self, voice: str, text: str, speed: float) -> tuple[np.ndarray, list[tuple[int, str]]]:
        """int16 [samples] at `sample_rate` and the phoneme starts (sample, mnemonic)."""
        data = text.encode("utf-8")
        with self._lock:
            if self._used:
                self._reload()
            lib = self._lib
            assert lib is not None
            self._used = True
            if lib.espeak_SetVoiceByName(voice.encode()) != 0:
                raise InputError(f"espeak-ng has no voice {voice!r}; check `espeak-ng --voices`")
            lib.espeak_SetParameter(_PARAM_RATE, int(round(_DEFAULT_RATE * speed)), 0)
            self._chunks, self._events = [], []
            self._libc.srand(0)
            if lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None) != 0:
                raise InputError(f"espeak-ng could not speak {text[:40]!r} with {voice}")
            audio = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.int16)
            return audio, self._events


def _espeak_speak(voice: Voice, text: str, speed: float) -> tuple[np.ndarray, list[Phone]]:
    """Audio at 16 kHz (with ESPEAK_PAD_S silence at both ends) and its phones."""
    lib = _EspeakLib.get()
    raw, events = lib.synth(voice.name, text, speed)
    audio = to_16k(raw.astype(np.float32) / 32768.0, lib.sample_rate)
    pad = np.zeros(int(round(ESPEAK_PAD_S * SAMPLE_RATE)), np.float32)
    audio = np.concatenate([pad, audio, pad])
    # [(start s, symbol)]: a pause at 0, the phonemes shifted by the pad, a pause after the speech
    # "(en)"-style events mark a language switch, not a phoneme; "_", "_:", "_|", ... are pauses
    starts = [(0.0, "_")] + [(ESPEAK_PAD_S + s / lib.sample_rate, "_" if m.startswith("_") else m)
                             for s, m in events if m and not m.startswith("(")]
    starts.append((ESPEAK_PAD_S + len(raw) / lib.sample_rate, "_"))
    return audio, _phones_from_starts(starts, len(audio) / SAMPLE_RATE, "espeak", "_")


# ------------------------------------------------------------------------------------------ flite
_FLITE_SEGMENT = re.compile(r"^([a-z#]+):(\d+(?:\.\d+)?)$")


def _flite_speak(voice: Voice, text: str, speed: float) -> tuple[np.ndarray, list[Phone]]:
    """Audio at 16 kHz and its phones from one `flite -psdur` run."""
    exe = shutil.which("flite")
    if exe is None:
        raise InputError("flite voices need the flite command: install flite (apt-get install flite) "
                         "or pick an espeak voice")
    with tempfile.TemporaryDirectory(prefix="avatarstream-flite-") as tmp:
        out = Path(tmp) / "speech.wav"
        cmd = [exe, "-psdur", "-voice", voice.name]
        if speed != 1.0:
            cmd += ["--setf", f"duration_stretch={1.0 / speed:.6f}"]
        r = subprocess.run(cmd + ["-t", text, "-o", str(out)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0 or not out.exists():
            raise InputError(f"flite failed on {text[:40]!r} with {voice.id}: {r.stderr.strip()[:200]}")
        with wave.open(str(out), "rb") as w:
            rate = w.getframerate()
            raw = np.frombuffer(w.readframes(w.getnframes()), np.int16)
    audio = to_16k(raw.astype(np.float32) / 32768.0, rate)
    # segments print as "name:end" with the end in seconds; a new utterance restarts the clock
    starts: list[tuple[float, str]] = []
    offset = prev_end = 0.0
    for token in r.stdout.split():
        m = _FLITE_SEGMENT.match(token)
        if m is None:
            continue
        if float(m.group(2)) + offset < prev_end - 1e-6:  # the clock restarted: the text's next utterance
            offset = prev_end
        end = float(m.group(2)) + offset
        starts.append((prev_end, re.sub(r"\d", "", m.group(1))))
        prev_end = end
    starts.append((prev_end, "pau"))
    return audio, _phones_from_starts(starts, len(audio) / SAMPLE_RATE, "flite", "pau")


# ---------------------------------------------------------------------------------------- shared
def _phones_from_starts(starts: list[tuple[float, str]], duration: float, engine: str,
                        pause: str) -> list[Phone]:
    """Phones from (start, symbol) in time order, each ending where the next begins: empty ones
    dropped, neighbouring pauses merged, clipped to [0, duration] and stretched to cover it."""
    phones: list[Phone] = []
    for (start, sym), (nxt, _) in zip(starts, starts[1:] + [(duration, pause)]):
        start, end = min(max(start, 0.0), duration), min(max(nxt, 0.0), duration)
        if end - start <= 1e-6:
            continue
        if phones and sym == pause and phones[-1].symbol == pause:
            phones[-1] = phones[-1]._replace(end=end)
        else:
            phones.append(Phone(start, end, sym, engine))
    if not phones:
        return [Phone(0.0, duration, pause, engine)]
    phones[0] = phones[0]._replace(start=0.0)
    if phones[-1].end < duration:
        if phones[-1].symbol == pause:
            phones[-1] = phones[-1]._replace(end=duration)
        else:
            phones.append(Phone(phones[-1].end, duration, pause, engine))
    return phones


def to_16k(x: np.ndarray, rate: int) -> np.ndarray:
    """float32 [n] at `rate` -> float32 [round(n * 16000 / rate)] at 16 kHz (libswresample,
    its filter delay compensated, so times are kept)."""
    n_out = int(round(len(x) * SAMPLE_RATE / rate))
    if rate == SAMPLE_RATE or len(x) == 0:
        return x.astype(np.float32)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
    frame = av.AudioFrame.from_ndarray(x[None, :].astype(np.float32), format="flt", layout="mono")
    frame.sample_rate = rate
    pieces = [f.to_ndarray()[0] for f in resampler.resample(frame)]
    pieces += [f.to_ndarray()[0] for f in resampler.resample(None)]
    y = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    return np.pad(y[:n_out], (0, max(0, n_out - len(y)))).astype(np.float32)


def _normalise_loudness(x: np.ndarray) -> np.ndarray:
    """Scale the speech parts (20 ms frames within 35 dB of the loudest) to TARGET_RMS RMS,
    keeping the peak at most PEAK."""
    frame = SAMPLE_RATE // 50
    n = len(x) // frame * frame
    if n == 0 or not np.any(x):
        return x.astype(np.float32)
    rms = np.sqrt(np.mean(x[:n].reshape(-1, frame).astype(np.float64) ** 2, axis=1))  # [frames]
    active = rms > rms.max() * 10 ** (-35 / 20)
    gain = TARGET_RMS / max(float(np.sqrt(np.mean(rms[active] ** 2))), 1e-9)
    gain = min(gain, PEAK / float(np.abs(x).max()))
    return np.clip(x * gain, -1.0, 1.0).astype(np.float32)


class SpeechSynthesizer:
    """Speaks text with a catalogue voice. Deterministic: the same text, voice and speed give
    the same audio and phones. The last `cache_size` results are kept, so repeated sentences
    are not synthesised again (each call still gets its own copy of the audio)."""

    def __init__(self, cache_size: int = 128) -> None:
        self.cache_size = max(0, int(cache_size))
        self._cache: OrderedDict[tuple[str, str, float], Utterance] = OrderedDict()
        self._lock = threading.Lock()

    def speak(self, text: str, voice: Voice | str, *, speed: float = 1.0) -> Utterance:
        """The utterance of `text` by `voice` (a Voice, or the id of one in VOICES); `speed`
        0.5-2.0 scales the speaking rate (2.0 = twice as fast)."""
        v = voice if isinstance(voice, Voice) else voice_by_id(voice)
        if v.engine not in ("flite", "espeak"):
            raise InputError(f"voice {v.id} has an unknown engine {v.engine!r}; use flite or espeak")
        text = " ".join(str(text).split())
        if not text:
            raise InputError("nothing to say: the text is empty")
        if not 0.5 <= speed <= 2.0:
            raise InputError(f"speech speed {speed} is out of range; use 0.5 to 2.0")
        key = (text, v.id, float(speed))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            speak = _flite_speak if v.engine == "flite" else _espeak_speak
            audio, phones = speak(v, text, float(speed))
            hit = Utterance(text, v, _normalise_loudness(audio), phones)
            if self.cache_size:
                with self._lock:
                    self._cache[key] = hit
                    while len(self._cache) > self.cache_size:
                        self._cache.popitem(last=False)
        return Utterance(hit.text, hit.voice, hit.audio.copy(), list(hit.phones), hit.sample_rate)
