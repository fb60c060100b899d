"""Phones -> visemes -> a per-frame mouth-shape track, with coarticulation.

`viseme_of` maps a flite phone (CMU set: "aa", "p", "pau", ...) or an espeak-ng phoneme
mnemonic ("a:", "O~", "tS", "_", ... for every corpus language) to one of `VISEMES`.
Diphthongs ("ay", "aI", "oU", ...) glide: their second half aims at the second vowel's shape.

`mouth_track` blends the viseme targets with a dominance model of coarticulation (Cohen &
Massaro, "Modeling coarticulation in synthetic visual speech", 1993): every segment pulls the
mouth towards its target with a strength that is full inside the segment and decays
exponentially with the distance outside it; each frame is the dominance-weighted mean of all
targets. Lip closures (p, b, m) and lip-teeth contacts (f, v) dominate the opening; tongue
consonants (t, k, ...) barely do, so the lips follow the neighbouring vowels through them.
Rests: pauses of REST_PAUSE_S or more pull the mouth shut, and a rest envelope brings it to
exactly neutral within REST_CLOSE_S of the nearest speech.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol, Sequence

import numpy as np

REST_PAUSE_S = 0.15  # a pause this long is a rest (mouth closes); shorter ones are word gaps
REST_CLOSE_S = 0.15  # within this distance of speech the rest envelope goes from 1 to 0


@dataclass(frozen=True)
class Viseme:
    """A mouth shape: targets in FaceState units (open 0..1, width -1..1, round 0..1, teeth 0..1)."""

    name: str
    open: float
    width: float
    round: float
    teeth: float
    vowel: bool = False


VISEMES: tuple[Viseme, ...] = (
    Viseme("sil", 0.0, 0.0, 0.0, 0.0),  # 0: rest, lips together, neutral
    Viseme("PBM", 0.0, 0.0, 0.1, 0.0),  # 1: lips pressed shut
    Viseme("FV", 0.06, 0.1, 0.0, 0.9),  # 2: lower lip under the upper teeth
    Viseme("TH", 0.15, 0.1, 0.0, 0.7),  # 3: tongue between the teeth
    Viseme("SZ", 0.08, 0.4, 0.0, 1.0),  # 4: teeth together, lips spread
    Viseme("SH", 0.15, -0.35, 0.65, 0.8),  # 5: sh, ch, j: lips pushed out
    Viseme("KG", 0.3, 0.1, 0.0, 0.3),  # 6: back of the tongue (k, g, ng, h): lips follow vowels
    Viseme("TDN", 0.2, 0.15, 0.0, 0.6),  # 7: tip of the tongue (t, d, n, l)
    Viseme("R", 0.2, -0.25, 0.5, 0.3),  # 8: English r, slightly rounded
    Viseme("W", 0.08, -0.7, 1.0, 0.0),  # 9: w: small round opening
    Viseme("AA", 0.9, 0.25, 0.0, 0.3, vowel=True),  # 10: open vowels (father, cat, but)
    Viseme("E", 0.55, 0.4, 0.0, 0.5, vowel=True),  # 11: mid front vowels (bed, day)
    Viseme("I", 0.35, 0.75, 0.0, 0.6, vowel=True),  # 12: spread close vowels (see, sit)
    Viseme("O", 0.6, -0.4, 0.75, 0.1, vowel=True),  # 13: rounded mid vowels (go, law, French eu)
    Viseme("U", 0.3, -0.6, 0.95, 0.0, vowel=True),  # 14: rounded close vowels (food, German ü)
    Viseme("AX", 0.4, 0.1, 0.0, 0.3, vowel=True),  # 15: relaxed central vowels (about, bird)
)
_V = {v.name: i for i, v in enumerate(VISEMES)}

# Dominance of each viseme over (open, width, round, teeth) and how fast it decays outside its
# segment (multiplies the sharpness rate): [visemes, 4], [visemes]
_ALPHA = np.array([
    [2.0, 2.0, 2.0, 2.0],  # sil (rest pauses; word gaps use _GAP_ALPHA)
    [8.0, 1.5, 0.5, 3.0],  # PBM
    [4.0, 1.0, 0.5, 4.0],  # FV
    [1.5, 0.7, 0.5, 2.0],  # TH
    [1.5, 1.0, 0.5, 3.0],  # SZ
    [1.2, 2.0, 2.5, 2.0],  # SH
    [0.4, 0.3, 0.3, 0.4],  # KG
    [0.5, 0.4, 0.3, 0.8],  # TDN
    [0.6, 1.0, 1.2, 0.5],  # R
    [1.5, 2.5, 3.0, 1.0],  # W
] + [[1.3, 1.0, 1.0, 1.0]] * 6)  # vowels: they win the opening over tongue consonants
_DECAY = np.array([1.0, 2.0, 2.0, 1.5, 1.5, 1.2, 1.0, 1.0, 1.0, 1.2] + [1.0] * 6)
_GAP_ALPHA = 0.5  # a short pause between words half-closes the mouth at most

# flite (CMU phone set, stress removed) -> viseme, diphthongs -> (start, end)
_FLITE: dict[str, str | tuple[str, str]] = {
    "aa": "AA", "ae": "AA", "ah": "AA", "ao": "O", "aw": ("AA", "U"), "ax": "AX", "axr": "AX", "ay": ("AA", "I"),
    "b": "PBM", "ch": "SH", "d": "TDN", "dh": "TH", "eh": "E", "el": "TDN", "em": "PBM", "en": "TDN", "er": "AX",
    "ey": ("E", "I"), "f": "FV", "g": "KG", "hh": "KG", "ih": "I", "iy": "I", "jh": "SH", "k": "KG", "l": "TDN",
    "m": "PBM", "n": "TDN", "ng": "KG", "ow": ("O", "U"), "oy": ("O", "I"), "p": "PBM", "r": "R", "s": "SZ",
    "sh": "SH", "t": "TDN", "th": "TH", "uh": "U", "uw": "U", "v": "FV", "w": "W", "y": "KG", "z": "SZ",
    "zh": "SH", "dx": "TDN", "nx": "TDN", "q": "KG",
}
_FLITE_SILENCE = {"pau", "h#", "brth", "sil", ""}

# espeak-ng mnemonics: a vowel letter starts a vowel (two vowel letters: a diphthong), else the
# consonant is looked up by its first two letters, then its first letter. Marks after the
# letters (":" long, "~" nasal, "#", "-", digits: variants) do not change the mouth.
_ESPEAK_VOWEL = {"a": "AA", "A": "AA", "V": "AA", "&": "AX", "e": "E", "E": "E", "i": "I", "I": "I",
                 "o": "O", "O": "O", "0": "O", "u": "U", "U": "U", "y": "U", "8": "U", "Y": "O", "W": "O",
                 "@": "AX", "3": "AX"}
_ESPEAK_CONSONANT2 = {"tS": "SH", "dZ": "SH", "ts": "SZ", "dz": "SZ", "pf": "PBM", "n^": "TDN", "l^": "TDN",
                      "J^": "KG", "r-": "TDN", "**": "TDN", "R2": "TDN"}
_ESPEAK_CONSONANT = {"p": "PBM", "b": "PBM", "m": "PBM", "B": "FV", "f": "FV", "v": "FV", "T": "TH", "D": "TH",
                     "s": "SZ", "z": "SZ", "C": "SZ", "S": "SH", "Z": "SH", "k": "KG", "g": "KG", "N": "KG",
                     "x": "KG", "X": "KG", "h": "KG", "Q": "KG", "G": "KG", "R": "KG", "j": "KG", "c": "KG",
                     "t": "TDN", "d": "TDN", "n": "TDN", "l": "TDN", "L": "TDN", "J": "TDN", "*": "TDN",
                     "r": "R", "w": "W"}
_ESPEAK_FALLBACK = "KG"  # transitions (";", "!") and anything unknown: lips follow the neighbours


class PhoneLike(Protocol):
    start: float
    end: float
    symbol: str
    engine: str


@lru_cache(maxsize=4096)
def _visemes_of(symbol: str, engine: str) -> tuple[int, int]:
    """(viseme at the start, viseme at the end) of a phone; equal unless it glides."""
    if engine == "flite":
        sym = "".join(c for c in symbol.lower() if not c.isdigit())
        if sym in _FLITE_SILENCE:
            return 0, 0
        v = _FLITE.get(sym, _ESPEAK_FALLBACK)
        a, b = (v, v) if isinstance(v, str) else v
        return _V[a], _V[b]
    if not symbol or symbol.startswith("_"):
        return 0, 0
    letters = [c for c in symbol if c in _ESPEAK_VOWEL]
    if symbol[0] in _ESPEAK_VOWEL:
        vowels = [_ESPEAK_VOWEL[c] for c in letters if c not in "038" or c == symbol[0]]
        return _V[vowels[0]], _V[vowels[-1]]
    name = _ESPEAK_CONSONANT2.get(symbol[:2]) or _ESPEAK_CONSONANT.get(symbol[0], _ESPEAK_FALLBACK)
    return _V[name], _V[name]


def viseme_of(phone: PhoneLike) -> int:
    """Index in VISEMES of a flite phone or espeak-ng phoneme (its start, for diphthongs);
    0 for pauses and silence."""
    return _visemes_of(phone.symbol, phone.engine)[0]


@dataclass
class MouthTrack:
    """Per-frame mouth shape: float32 [frames] targets in FaceState units, `speaking` bool
    [frames] (in speech or a short gap between words) and the `viseme` index int [frames] of
    the phone at each frame's centre."""

    open: np.ndarray
    width: np.ndarray
    round: np.ndarray
    teeth: np.ndarray
    speaking: np.ndarray
    viseme: np.ndarray


def _segments(phones: Sequence[PhoneLike]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Segments to blend: start [S], end [S], viseme [S], alpha [S, 4]. Diphthongs are split in
    two; the time before the first and after the last phone is rest."""
    far = 1e9
    rows: list[tuple[float, float, int, np.ndarray]] = []
    t = -far
    for p in sorted(phones, key=lambda q: q.start):
        if p.start > t + 1e-6:  # an uncovered stretch is silence
            rows.append((t, p.start, 0, _ALPHA[0]))
        a, b = _visemes_of(p.symbol, p.engine)
        if a == 0:
            alpha = _ALPHA[0] if p.end - p.start >= REST_PAUSE_S else np.full(4, _GAP_ALPHA)
            rows.append((p.start, p.end, 0, alpha))
        elif a == b:
            rows.append((p.start, p.end, a, _ALPHA[a]))
        else:
            mid = 0.5 * (p.start + p.end)
            rows += [(p.start, mid, a, _ALPHA[a]), (mid, p.end, b, _ALPHA[b])]
        t = max(t, p.end)
    rows.append((t, far, 0, _ALPHA[0]))
    start = np.array([r[0] for r in rows])
    end = np.array([r[1] for r in rows])
    vis = np.array([r[2] for r in rows], np.int64)
    alpha = np.stack([r[3] for r in rows])
    return start, end, vis, alpha


def _speech_intervals(phones: Sequence[PhoneLike]) -> list[tuple[float, float]]:
    """Stretches of speech, word gaps shorter than REST_PAUSE_S included."""
    spans: list[tuple[float, float]] = []
    for p in sorted(phones, key=lambda q: q.start):
        if viseme_of(p) == 0:
            continue
        if spans and p.start - spans[-1][1] < REST_PAUSE_S:
            spans[-1] = (spans[-1][0], max(spans[-1][1], p.end))
        else:
            spans.append((p.start, p.end))
    return spans


def mouth_track(phones: Sequence[PhoneLike], frames: int, fps: float, *, sharpness: float = 0.5,
                amplitude: float = 1.0) -> MouthTrack:
    """The mouth shape at the centre of each of `frames` video frames at `fps`, from `phones`
    (times in seconds on the same clock). `sharpness` 0 = lazy, smooth articulation, 1 = crisp;
    `amplitude` scales the opening (~0.6 mumbling to ~1.2 wide)."""
    frames = int(frames)
    t = (np.arange(frames) + 0.5) / fps  # [F] frame centres, seconds
    start, end, vis, alpha = _segments(phones)
    rate = 16.0 + 56.0 * float(np.clip(sharpness, 0.0, 1.0))  # 1/s: dominance decay outside a segment
    dist = np.maximum(0.0, np.maximum(start[None, :] - t[:, None], t[:, None] - end[None, :]))  # [F, S]
    decay = np.exp(-rate * _DECAY[vis][None, :] * dist)  # [F, S]
    targets = np.array([[v.open, v.width, v.round, v.teeth] for v in VISEMES])[vis]  # [S, 4]
    weight = decay[:, :, None] * alpha[None, :, :]  # [F, S, 4]
    shape = (weight * targets[None]).sum(1) / np.maximum(weight.sum(1), 1e-12)  # [F, 4]

    # rest envelope: 1 in speech, down to 0 at REST_CLOSE_S from it (raised cosine)
    spans = _speech_intervals(phones)
    if spans:
        s0 = np.array([s for s, _ in spans])
        s1 = np.array([e for _, e in spans])
        d_speech = np.maximum(0.0, np.maximum(s0[None] - t[:, None], t[:, None] - s1[None])).min(1)  # [F]
    else:
        d_speech = np.full(frames, np.inf)
    env = 0.5 * (1.0 + np.cos(np.pi * np.clip(d_speech / REST_CLOSE_S, 0.0, 1.0)))  # [F]
    shape *= env[:, None]

    inside = (start[None] <= t[:, None]) & (t[:, None] < end[None])  # [F, S]
    viseme = vis[np.argmax(inside, axis=1)] if frames else np.zeros(0, np.int64)
    return MouthTrack(
        open=np.clip(shape[:, 0] * amplitude, 0.0, 1.0).astype(np.float32),
        width=np.clip(shape[:, 1], -1.0, 1.0).astype(np.float32),
        round=np.clip(shape[:, 2], 0.0, 1.0).astype(np.float32),
        teeth=np.clip(shape[:, 3], 0.0, 1.0).astype(np.float32),
        speaking=d_speech == 0.0,
        viseme=viseme.astype(np.int64),
    )
