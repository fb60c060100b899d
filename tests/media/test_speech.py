"""Speech synthesis used at inference and for the synthetic corpus (media/speech.py)."""

from __future__ import annotations

from avatarstream.media.speech import VOICES


def test_voice_catalogue_covers_languages_and_engines():
    langs = {v.language for v in VOICES}
    assert {"en", "de", "fr", "es", "it"} <= langs
    assert {v.engine for v in VOICES} == {"flite", "espeak"}
