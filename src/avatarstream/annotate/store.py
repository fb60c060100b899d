"""The judgements, in SQLite (stdlib sqlite3, WAL): one table, its schema version in
`PRAGMA user_version`. Separate from the web page, so that an export needs no server.

A row is one choice as it was made; nothing is overwritten (a second judgement of the same pair
by the same annotator is a new row, and the latest one counts), and an undo deletes the
annotator's last row. `choice` is always in terms of the pair's on-disk left/right; `swapped`
says the page showed the on-disk right video on the left.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from avatarstream.errors import InputError, OutputError

SCHEMA_VERSION = 1
CHOICES = ("left", "right", "tie", "skip")
MAX_ANNOTATOR = 100
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS judgements (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    pair      TEXT NOT NULL,
    choice    TEXT NOT NULL CHECK (choice IN ({", ".join(f"'{c}'" for c in CHOICES)})),
    annotator TEXT NOT NULL CHECK (length(annotator) > 0),
    time      TEXT NOT NULL,
    swapped   INTEGER NOT NULL CHECK (swapped IN (0, 1))
);
CREATE INDEX IF NOT EXISTS judgements_by_annotator ON judgements (annotator, pair);
PRAGMA user_version = {SCHEMA_VERSION};
"""


@dataclass(frozen=True)
class Judgement:
    id: int
    pair: str
    choice: str  # left | right | tie | skip, as on disk
    annotator: str
    time: str  # UTC, ISO 8601
    swapped: bool


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z")


def check_annotator(name: str) -> str:
    """The annotator's name without surrounding blanks; empty or over-long ones are refused."""
    name = (name or "").strip()
    if not name:
        raise InputError("the annotator's name is required")
    if len(name) > MAX_ANNOTATOR or any(ord(c) < 32 for c in name):
        raise InputError(f"the annotator's name must be at most {MAX_ANNOTATOR} printable characters")
    return name


class Store:
    """The annotation database at `path`. `create=False` (the export) refuses a missing file
    rather than making an empty one."""

    def __init__(self, path: str | Path, create: bool = True) -> None:
        self.path = Path(path)
        if not create and not self.path.is_file():
            raise InputError(f"no annotations found: {self.path} does not exist")
        if create and not self.path.parent.is_dir():
            raise OutputError(f"cannot create {self.path}: its folder does not exist")
        try:
            self.db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except sqlite3.Error as e:
            raise InputError(f"cannot open {self.path} as the annotation database: {e}") from None
        try:
            self._open(create)
        except BaseException:
            self.db.close()
            raise

    def _open(self, create: bool) -> None:
        """Check the schema version; create the table (WAL) when allowed."""
        try:
            self.db.execute("PRAGMA busy_timeout = 5000")
            version = self.db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise InputError(f"{self.path} was written by a newer avatarstream (annotation schema "
                                 f"{version}; this one reads {SCHEMA_VERSION})")
            if version == 0 and self.db.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                raise InputError(f"{self.path} is a database of something else, not of annotations")
            if create:
                self.db.execute("PRAGMA journal_mode = WAL")
                self.db.executescript(_SCHEMA)
            elif version != SCHEMA_VERSION:
                raise InputError(f"{self.path} is not an annotation database")
        except sqlite3.DatabaseError as e:  # not SQLite, unwritable, locked
            raise InputError(f"cannot use {self.path} as the annotation database: {e}") from None

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def record(self, pair: str, choice: str, annotator: str, swapped: bool = False,
               time: str | None = None) -> Judgement:
        """Store one choice (on-disk terms) and return it."""
        if choice not in CHOICES:
            raise InputError(f"choice must be one of {', '.join(CHOICES)}, not {choice!r}")
        annotator = check_annotator(annotator)
        time = time or utc_now()
        cur = self.db.execute("INSERT INTO judgements (pair, choice, annotator, time, swapped) "
                              "VALUES (?, ?, ?, ?, ?)", (pair, choice, annotator, time, int(swapped)))
        return Judgement(int(cur.lastrowid or 0), pair, choice, annotator, time, bool(swapped))

    def undo(self, annotator: str) -> Judgement | None:
        """Delete the annotator's last judgement; None when there is none."""
        last = self._rows("WHERE annotator = ? ORDER BY id DESC LIMIT 1", (check_annotator(annotator),))
        if not last:
            return None
        self.db.execute("DELETE FROM judgements WHERE id = ?", (last[0].id,))
        return last[0]

    def judged(self, annotator: str) -> set[str]:
        """The pairs this annotator has judged (any choice, skip included)."""
        rows = self.db.execute("SELECT DISTINCT pair FROM judgements WHERE annotator = ?",
                               (annotator.strip(),))
        return {r[0] for r in rows}

    def all(self) -> list[Judgement]:
        """Every judgement, oldest first."""
        return self._rows("ORDER BY id", ())

    def latest(self, annotator: str | None = None) -> list[Judgement]:
        """The latest judgement of each (pair, annotator), oldest first; one annotator's with
        `annotator`."""
        where, args = ("WHERE annotator = ?", (annotator,)) if annotator is not None else ("", ())
        return self._rows(f"WHERE id IN (SELECT max(id) FROM judgements {where} GROUP BY pair, annotator) "
                          "ORDER BY id", args)

    def _rows(self, tail: str, args: tuple) -> list[Judgement]:
        rows = self.db.execute(f"SELECT id, pair, choice, annotator, time, swapped FROM judgements {tail}", args)
        return [Judgement(r[0], r[1], r[2], r[3], r[4], bool(r[5])) for r in rows]
