"""Decisions over all stretches at once: duplicates, the identity graph and cross-scene pairs.

- Duplicates: in key order, a stretch that passed the other filters is a duplicate of the nearest
  earlier such stretch (kept) whose `filters.SAMPLES` pHashes are within a mean Hamming distance
  `max_hash_distance` of its own (the same footage given twice, a re-encoded copy, a repeated
  segment). The first one is kept.
- Identities: the kept stretches are the nodes of a graph with an edge wherever two mean dlib
  descriptors are closer than `threshold` (Euclidean); each connected component is one person,
  named `person-NNN` in the order of its first stretch's key. The default 0.5 is stricter than
  dlib's 0.6 for one pair: single linkage chains, so one loose edge would merge two people.
- Pairs: every ordered pair (reference, target) of one person's stretches from different scenes
  (shots), as Avatar V's personality fine-tuning asks (reference and target never share a scene).
"""

from __future__ import annotations

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


def components(desc: np.ndarray, threshold: float) -> list[int]:
    """Connected-component label of each row of descriptors [n, 128] under a distance threshold,
    labels numbered in order of first appearance."""
    n = len(desc)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    d = np.linalg.norm(desc[:, None] - desc[None], axis=-1) if n else np.zeros((0, 0))
    for i in range(n):
        for j in range(i + 1, n):
            if d[i, j] < threshold:
                parent[max(find(i), find(j))] = min(find(i), find(j))
    names: dict[int, int] = {}
    return [names.setdefault(find(i), len(names)) for i in range(n)]


def assign_identities(records: list[dict[str, Any]], threshold: float) -> None:
    """Give every kept record `identity`, and every duplicate its original's."""
    kept = [r for r in records if not r["reasons"]]
    labels = components(np.array([r["descriptor"] for r in kept]).reshape(len(kept), -1), threshold)
    by_key = {}
    for r, lab in zip(kept, labels):
        r["identity"] = f"person-{lab:03d}"
        by_key[r["key"]] = r["identity"]
    for r in records:
        if "duplicate_of" in r:
            r["identity"] = by_key[r["duplicate_of"]]


def cross_scene_pairs(kept: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Every (reference, target) of one identity from different scenes, in key order."""
    return [{"reference": a["key"], "target": b["key"], "identity": a["identity"]}
            for a in kept for b in kept
            if a["identity"] == b["identity"] and a["scene"] != b["scene"]]
