"""Decisions over all stretches at once: duplicates, the identity graph, scenes and cross-scene pairs.

- Duplicates: in key order, a stretch that passed the other filters is a duplicate of the nearest
  earlier such stretch (kept) whose `filters.SAMPLES` pHashes are within a mean Hamming distance
  `max_hash_distance` of its own (the same footage given twice, a re-encoded copy, a repeated
  segment). The first one is kept.
- Identities: the kept stretches are the nodes of a graph with an edge wherever two mean dlib
  descriptors are closer than `threshold` (Euclidean); each connected component is one person,
  named `person-NNN` in the order of its first stretch's key. The default 0.5 is stricter than
  dlib's 0.6 for one pair: single linkage chains, so one loose edge would merge two people.
- Scenes: shots grouped by what is behind the person. Every window with frames carries its
  background descriptor (`background.py`: the colours with the people masked out, a unit vector);
  the windows are the nodes of a graph with an edge between two windows of one shot and wherever
  two descriptors are closer than `scene_threshold` (Euclidean), across inputs too (two clips
  filmed in one place are one scene). Each connected component is one scene, named `scene-NNN`
  in the order of its first window's key; a shot none of whose windows could be read has none.
  The default 0.75 is about the geometric middle of the tests' margin: one background under pans,
  zooms, blur and other people at most 0.45 apart, different backgrounds at least 1.29. Single linkage
  chains here too, but a chain of similar backgrounds is what one place filmed from several sides
  looks like; the shot id stays in its own field (`shot_id`, `vNNNN-STEM-sNNNN`).
- Pairs: every ordered pair (reference, target) of one person's stretches from different scenes,
  as Avatar V's personality fine-tuning asks (reference and target never share a scene).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def hash_distance(a: list[str], b: list[str]) -> float:
    """Mean Hamming distance of two lists of pHashes (compared position by position)."""
    import imagehash

    k = min(len(a), len(b))
    return float(np.mean([imagehash.hex_to_hash(a[i]) - imagehash.hex_to_hash(b[i]) for i in range(k)]))


def mark_duplicates(records: list[dict[str, Any]], max_distance: float) -> None:
    """Add reason `duplicate` (and `duplicate_of`) to records that repeat an earlier passing one."""
    firsts: list[dict[str, Any]] = []
    for r in records:
        if r["reasons"]:
            continue
        dist = [(hash_distance(f["hashes"], r["hashes"]), f["key"]) for f in firsts]
        near = min(dist, default=(float("inf"), ""))
        r["metrics"]["nearest_hash_distance"] = near[0] if dist else None
        if near[0] <= max_distance:
            r["reasons"] = ["duplicate"]
            r["duplicate_of"] = near[1]
        else:
            firsts.append(r)


ROWS = 512  # rows of the distance matrix held at once by `components`


def components(desc: Sequence[Sequence[float]] | np.ndarray, threshold: float,
               groups: list[str] | None = None) -> list[int]:
    """Connected-component label of each row of descriptors [n, d] under a Euclidean distance
    threshold, labels numbered in order of first appearance; rows with equal `groups` values are
    joined whatever their distance."""
    n = len(desc)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    x = np.asarray(desc, np.float64).reshape(n, -1) if n else np.zeros((0, 1))
    sq = (x * x).sum(1)
    g = None if groups is None else np.unique(np.asarray(groups), return_inverse=True)[1]
    for a in range(0, n, ROWS):  # ROWS x n distances at a time: memory linear in n
        b = min(n, a + ROWS)
        near = np.sqrt(np.maximum(sq[a:b, None] + sq[None] - 2 * x[a:b] @ x.T, 0)) < threshold
        if g is not None:
            near |= g[a:b, None] == g[None]
        for i, j in np.argwhere(np.triu(near, 1 + a)).tolist():  # pairs (a + i, j), j > a + i
            i += a
            parent[max(find(i), find(j))] = min(find(i), find(j))
    names: dict[int, int] = {}
    return [names.setdefault(find(i), len(names)) for i in range(n)]


def assign_identities(records: list[dict[str, Any]], threshold: float) -> None:
    """Give every kept record `identity`, and every duplicate its original's."""
    kept = [r for r in records if not r["reasons"]]
    labels = components([r["descriptor"] for r in kept], threshold)
    by_key = {}
    for r, lab in zip(kept, labels):
        r["identity"] = f"person-{lab:03d}"
        by_key[r["key"]] = r["identity"]
    for r in records:
        if "duplicate_of" in r:
            r["identity"] = by_key[r["duplicate_of"]]


def assign_scenes(records: list[dict[str, Any]], threshold: float) -> None:
    """Give every record its shot's `scene` ("scene-NNN"; None for a shot without a readable
    window). Records in key order, so scenes are numbered by first appearance."""
    windows: dict[tuple[str, int], dict[str, Any]] = {}
    for r in records:
        if r.get("background") is not None:
            windows.setdefault((r["shot_id"], r["window"]), r)
    nodes = list(windows.values())
    labels = components([w["background"] for w in nodes], threshold, [w["shot_id"] for w in nodes])
    scene_of = {w["shot_id"]: f"scene-{lab:03d}" for w, lab in zip(nodes, labels)}
    for r in records:
        r["scene"] = scene_of.get(r["shot_id"])


def cross_scene_pairs(kept: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Every (reference, target) of one identity from different scenes, in key order."""
    return [{"reference": a["key"], "target": b["key"], "identity": a["identity"]}
            for a in kept for b in kept
            if a["identity"] == b["identity"] and a["scene"] != b["scene"]]
