"""A pairs folder (made by `avatarstream train pairs`): pairs.jsonl and the renders it names.

Every path in pairs.jsonl is relative to the folder and must stay inside it: the annotation page
serves these files and nothing else, so a line cannot make it read an arbitrary file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from avatarstream.errors import InputError

PAIRS_FILE = "pairs.jsonl"
_PATH_KEYS = ("left", "right", "left_record", "right_record")


@dataclass(frozen=True)
class Pair:
    """One line of pairs.jsonl. Paths are as written (relative to the folder); `files` maps each
    of them to its resolved location inside the folder."""

    pair: str
    condition: str
    left: str
    right: str
    left_record: str
    right_record: str
    text: str
    auto: tuple[float, float] | None  # reward totals (left, right), when the line has them
    files: dict[str, Path]

    def video(self, side: str) -> Path:
        """The resolved video of `side` ("left" or "right", as on disk)."""
        return self.files[self.left if side == "left" else self.right]


@dataclass
class PairsFolder:
    root: Path
    pairs: list[Pair]
    by_id: dict[str, Pair] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.by_id = {p.pair: p for p in self.pairs}

    def get(self, pair_id: str) -> Pair | None:
        return self.by_id.get(pair_id)


def _inside(root: Path, rel: Any, where: str, key: str) -> Path:
    """`rel` (a path from a line) resolved inside `root`; an absolute path, a `..` or a link
    that leads out is refused."""
    if not isinstance(rel, str) or not rel.strip():
        raise InputError(f"{where}: \"{key}\" must be a non-empty path relative to the pairs folder")
    posix = PurePosixPath(rel.replace("\\", "/"))
    if posix.is_absolute() or Path(rel).is_absolute() or ".." in posix.parts:
        raise InputError(f"{where}: \"{key}\" ({rel}) leaves the pairs folder; paths must be relative "
                         f"to it, without '..'")
    path = (root / posix).resolve()
    if not path.is_relative_to(root):
        raise InputError(f"{where}: \"{key}\" ({rel}) leads out of the pairs folder (a link)")
    return path


def _auto(value: Any, where: str) -> tuple[float, float] | None:
    if value is None:
        return None
    ok = isinstance(value, dict) and all(
        isinstance(value.get(k), (int, float)) and not isinstance(value.get(k), bool)
        and math.isfinite(value[k]) for k in ("left", "right"))
    if not ok:
        raise InputError(f"{where}: \"auto\" must be {{\"left\": number, \"right\": number}}")
    return float(value["left"]), float(value["right"])


def _pair(root: Path, obj: Any, where: str) -> Pair:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: not a JSON object")
    for key in ("pair", "condition"):
        if not isinstance(obj.get(key), str) or not obj[key]:
            raise InputError(f"{where}: \"{key}\" must be a non-empty string")
    text = obj.get("text", "")
    if text is None:
        text = ""
    if not isinstance(text, str):
        raise InputError(f"{where}: \"text\" must be a string")
    files = {obj[k]: _inside(root, obj.get(k), where, k) for k in _PATH_KEYS}
    for key in ("left", "right"):
        if not files[obj[key]].is_file():
            raise InputError(f"{where}: video not found: {root / obj[key]}")
    return Pair(pair=obj["pair"], condition=obj["condition"], left=obj["left"], right=obj["right"],
                left_record=obj["left_record"], right_record=obj["right_record"], text=text,
                auto=_auto(obj.get("auto"), where), files=files)


def load_pairs(folder: str | Path) -> PairsFolder:
    """Read and check a pairs folder. Every problem is an InputError naming the line."""
    root = Path(folder)
    if not root.is_dir():
        raise InputError(f"pairs folder not found: {root}")
    root = root.resolve()
    path = root / PAIRS_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise InputError(f"{path} not found: is {folder} a pairs folder (avatarstream train pairs)?") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read {path}: {e}") from None
    pairs: list[Pair] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}, line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{where}: not valid JSON ({e.msg})") from None
        pair = _pair(root, obj, where)
        if pair.pair in seen:
            raise InputError(f"{where}: pair \"{pair.pair}\" appears twice")
        seen.add(pair.pair)
        pairs.append(pair)
    if not pairs:
        raise InputError(f"{path} holds no pairs")
    return PairsFolder(root=root, pairs=pairs)
