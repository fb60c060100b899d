"""Preference lines for Diffusion-DPO, from people's judgements or from the reward scores.

One line per decisive judgement:
    {"pair", "condition", "chosen", "rejected", "chosen_video", "rejected_video", "annotator",
     "time", "source"}
`chosen`/`rejected` are the render records (left_record/right_record) and `*_video` the renders,
as pairs.jsonl names them (relative to the pairs folder). Ties and skips carry no preference and
are only counted. The file is written whole or not at all (a temporary file, then a rename).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from avatarstream.annotate.pairs import Pair, PairsFolder
from avatarstream.annotate.store import CHOICES, Store, utc_now
from avatarstream.errors import ConfigError, OutputError

_EPS = 1e-9  # score differences are sums of floats: 0.43 - 0.41 is a margin of 0.02


def preference(pair: Pair, winner: str, annotator: str, time: str, source: str) -> dict[str, Any]:
    """The line saying `winner` ("left" or "right", as on disk) of `pair` was preferred."""
    loser = "right" if winner == "left" else "left"
    return {"pair": pair.pair, "condition": pair.condition,
            "chosen": getattr(pair, f"{winner}_record"), "rejected": getattr(pair, f"{loser}_record"),
            "chosen_video": getattr(pair, winner), "rejected_video": getattr(pair, loser),
            "annotator": annotator, "time": time, "source": source}


def with_folder(lines: list[dict[str, Any]], folder: PairsFolder, out: str | Path) -> list[dict[str, Any]]:
    """Each line with "pairs": the pairs folder relative to `out`'s folder, so the file's record
    paths resolve wherever it is written (`train dpo` reads them as pairs / chosen)."""
    rel = os.path.relpath(Path(folder.root).resolve(), Path(out).resolve().parent)
    return [{**line, "pairs": rel} for line in lines]


def write_jsonl(out: str | Path, lines: list[dict[str, Any]]) -> Path:
    """Write `lines` to `out` atomically: a reader sees the old file or the whole new one."""
    out = Path(out)
    if not out.parent.is_dir():
        raise OutputError(f"cannot write {out}: its folder does not exist")
    if out.is_dir():
        raise OutputError(f"cannot write {out}: it is a folder")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as e:
        raise OutputError(f"cannot write in {out.parent}: {e.strerror or e}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def export_human(folder: PairsFolder, db: str | Path, out: str | Path,
                 annotator: str | None = None) -> dict[str, Any]:
    """The people's decisive judgements (the latest of each annotator on each pair) -> `out`.
    Returns the summary: counts by choice, lines per annotator, judgements of unknown pairs."""
    with Store(db, create=False) as store:
        latest = store.latest(annotator.strip() if annotator else None)
    choices: Counter[str] = Counter({c: 0 for c in CHOICES})
    judged: Counter[str] = Counter()
    exported: Counter[str] = Counter()
    lines, unknown = [], 0
    for j in latest:
        pair = folder.get(j.pair)
        if pair is None:  # judged in an older pairs.jsonl; its files are no longer described
            unknown += 1
            continue
        choices[j.choice] += 1
        judged[j.annotator] += 1
        if j.choice in ("left", "right"):
            lines.append(preference(pair, j.choice, j.annotator, j.time, "human"))
            exported[j.annotator] += 1
    write_jsonl(out, with_folder(lines, folder, out))
    return {"out": str(out), "exported": len(lines), "choices": dict(choices),
            "annotators": {a: {"judged": judged[a], "exported": exported[a]} for a in sorted(judged)},
            "pairs": len(folder.pairs), "unknown_pairs": unknown}


def export_auto(folder: PairsFolder, out: str | Path, margin: float = 0.02) -> dict[str, Any]:
    """Preferences from the reward totals: of every pair whose `auto` scores differ by at least
    `margin`, the higher one is chosen (annotator "reward", source "auto") -> `out`."""
    if not margin >= 0:
        raise ConfigError(f"--margin must be >= 0, not {margin}")
    time = utc_now()
    lines, close, unscored = [], 0, 0
    for pair in folder.pairs:
        if pair.auto is None:
            unscored += 1
            continue
        left, right = pair.auto
        if abs(left - right) + _EPS < margin or left == right:
            close += 1
            continue
        lines.append(preference(pair, "left" if left > right else "right", "reward", time, "auto"))
    write_jsonl(out, with_folder(lines, folder, out))
    return {"out": str(out), "exported": len(lines), "below_margin": close, "unscored": unscored,
            "pairs": len(folder.pairs), "margin": margin}
