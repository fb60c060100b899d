"""Synthetic talking-head domain with exact ground truth (issue 4): procedurally drawn people
(`Identity`, a seed) in scenes (`Scene`), speaking real synthetic speech (espeak-ng, flite) with
phoneme-timed visemes, talking styles, held-out identity / voice splits, and dataset shards.

Training and evaluation data only: nothing in the inference path imports this package. Names are
resolved lazily, so importing one submodule (say `splits`) does not load the renderer."""

from __future__ import annotations

from importlib import import_module
from typing import Any

_WHERE = {
    "Clip": "clip", "ClipSpec": "clip", "render_reference": "clip",
    "FaceState": "features", "DatasetConfig": "generate", "clip_specs": "generate",
    "Identity": "identity", "AvatarRenderer": "render", "Scene": "scene",
    "ShardReader": "shards", "ShardWriter": "shards",
    "derive_seed": "splits", "identity_seeds": "splits", "is_heldout_identity": "splits", "voices_for": "splits",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(import_module(f"avatarstream.data.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'avatarstream.data' has no attribute {name!r}")
