"""Seeds and splits of the synthetic domain.

Held-out identities are a reserved tenth of the identity space, chosen by a hash of the identity
seed (`is_heldout_identity`), so no master seed can ever draw one into training. Held-out voices
are marked in the voice catalogue (`media.speech.VOICES`: flite's rms, every Portuguese and
Dutch voice).

| split | identities | voices |
| --- | --- | --- |
| `train` | not held out | not held out |
| `heldout-identity` | held out | training voices (unseen faces, seen voices) |
| `heldout-voice` | not held out, drawn apart from `train` | held out |
"""

from __future__ import annotations

import hashlib

from avatarstream.media.speech import VOICES, Voice, voice_by_id
from avatarstream.errors import InputError

SPLITS = ("train", "heldout-identity", "heldout-voice")
HELDOUT_MODULUS = 10  # one identity in ten is reserved for evaluation


def derive_seed(*parts: object) -> int:
    """A stable 31-bit seed from any parts (blake2b of their reprs; same on every machine)."""
    h = hashlib.blake2b("\x1f".join(repr(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise InputError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    return split


def is_heldout_identity(seed: int) -> bool:
    """True for the reserved part of the identity space (about 10%)."""
    return derive_seed("heldout-identity", int(seed)) % HELDOUT_MODULUS == 0


def identity_seeds(master: int, n: int, split: str = "train") -> list[int]:
    """`n` distinct identity seeds of `split` drawn from `master` (deterministic). Train and
    held-out-voice identities are never held-out identities; held-out-voice draws from its own
    stream so its people differ from a train draw with the same master seed."""
    check_split(split)
    want_heldout = split == "heldout-identity"
    out: list[int] = []
    k = 0
    while len(out) < n:
        s = derive_seed(master, split if split != "train" else "identity", k) % 1_000_000_000
        k += 1
        if is_heldout_identity(s) == want_heldout and s not in out:
            out.append(s)
    return out


def voices_for(split: str, voice: str | None = None) -> list[Voice]:
    """The voices a split may use; with `voice`, just that one, after checking it belongs there."""
    check_split(split)
    allowed = [v for v in VOICES if v.heldout == (split == "heldout-voice")]
    if voice is None:
        return allowed
    v = voice_by_id(voice)
    if v not in allowed:
        if v.heldout:
            raise InputError(f"voice {voice} is held out for evaluation; it cannot be used for the {split} split "
                             f"(use --split heldout-voice)")
        raise InputError(f"voice {voice} is a training voice; the {split} split uses held-out voices only")
    return [v]
