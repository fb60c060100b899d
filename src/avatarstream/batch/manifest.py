"""The batch manifest: one SQLite row per output, what makes a batch resumable and exactly-once.

`DIR/.batch-manifest.sqlite`, table `rows`:

    out       the video's path under DIR (the primary key: one row of the JOBS file each)
    key       the JOBS row's hash (`Job.key`): a row whose key changed is rendered again
    row       its number in the JOBS file of the last run
    status    pending (sent to render, no result yet) | done | failed
    sha256    of the finished output, as written
    seconds   wall seconds of its render; media_s: seconds of video
    attempts  renders that reached an end (done or failed), over every run
    error     why the last attempt failed
    prior     the file at `out` when the row was sent to render (device, inode, size, mtime), or
              NULL: a file with another identity there later is that render's output
    updated   when the row last changed (Unix time)

Rules (`Manifest.plan`), for each valid row of a run:
- done with the same key and the output still hashing to `sha256`: skipped, never rendered again;
- pending or failed with the same key, and a file at `out` that is not `prior` and verifies as
  ours (`finished_output`: content credentials / watermark say AI-generated): adopted as done.
  This is the render that finished while its driver was killed (after the worker's atomic rename,
  before the driver heard of it): it is not rendered twice. The worker does the same check before
  a render Ray retries after the worker itself was killed;
- anything else is sent to render (again): a new row, an edited one, a failed one, a done one
  whose output was deleted or changed.

Every change is committed at once (a rollback journal, synchronous FULL; no WAL, which needs
shared memory and does not suit an output folder on network storage): a driver killed with kill -9
loses no recorded result. One batch at a time per DIR: the manifest is locked (publish/output.py's
OutputLock, released by the kernel when its process dies).
"""

from __future__ import annotations

import hashlib
import os
import re
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from avatarstream.batch.jobs import Job
from avatarstream.errors import OutputError
from avatarstream.publish.output import OutputLock, os_reason

NAME = ".batch-manifest.sqlite"

SCHEMA = """
CREATE TABLE IF NOT EXISTS rows (
    out TEXT PRIMARY KEY,
    key TEXT NOT NULL,
    row INTEGER,
    status TEXT NOT NULL CHECK (status IN ('pending', 'done', 'failed')),
    sha256 TEXT,
    seconds REAL,
    media_s REAL,
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    prior TEXT,
    updated REAL
)
"""


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(path: str | Path) -> str | None:
    """Which file is at `path` (None: none): an atomic rename puts another inode there."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def finished_output(path: str | Path, prior: str | None) -> str | None:
    """The sha256 of a finished render of ours at `path` that replaced `prior`, else None: the
    file is there, is not the one that was there when the row was sent, and `verify` (content
    credentials or watermark) says it is AI-generated (our outputs are renamed into place only
    once complete and signed, so such a file is a whole render)."""
    fp = fingerprint(path)
    if fp is None or fp == prior:
        return None
    from avatarstream.provenance.verify import verify

    try:
        if not verify(str(path))["ai_generated"]:
            return None
    except Exception:  # noqa: BLE001 - unreadable: not a finished output; it is rendered again
        return None
    return sha256_file(path)


@dataclass
class Plan:
    """What a run does with its valid rows."""

    render: list[tuple[Job, str | None]] = field(default_factory=list)  # (job, prior)
    skipped: list[Job] = field(default_factory=list)  # done before, output verified
    adopted: list[Job] = field(default_factory=list)  # finished by a run that was killed


class Manifest:
    """The manifest of output folder `out_dir`, locked while open (module doc)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.dir = Path(out_dir)
        self.path = self.dir / NAME
        self.lock = OutputLock(self.path)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OutputError(f"cannot make the output folder {self.dir}: {os_reason(e)}") from e
        self.lock.acquire()  # another batch writing into this folder: refused, with its pid
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None)
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute(SCHEMA)
        except sqlite3.Error as e:
            self.lock.release()
            raise OutputError(f"cannot open the batch manifest {self.path}: {e}") from e

    def close(self) -> None:
        self.db.close()
        self.lock.release()

    def __enter__(self) -> Manifest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, out: str) -> dict | None:
        cur = self.db.execute("SELECT * FROM rows WHERE out = ?", (out,))
        row = cur.fetchone()
        return None if row is None else dict(zip([d[0] for d in cur.description], row))

    def rows(self) -> list[dict]:
        cur = self.db.execute("SELECT * FROM rows ORDER BY row")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]

    def plan(self, jobs: Iterable[Job]) -> Plan:
        """Sort this run's rows into skipped, adopted and to render (module doc); the rows to
        render are recorded pending with their `prior` before any is sent."""
        plan = Plan()
        now = time.time()
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for job in jobs:
                path = self.dir / job.out
                rec = self.get(job.out)
                same = rec is not None and rec["key"] == job.key
                if same and rec["status"] == "done" and rec["sha256"] and path.is_file() \
                        and sha256_file(path) == rec["sha256"]:
                    plan.skipped.append(job)
                    continue
                if same and rec["status"] != "done":
                    sha = finished_output(path, rec["prior"])
                    if sha is not None:
                        self._set(job, now, status="done", sha256=sha, error=None,
                                  attempts=rec["attempts"] + 1)
                        plan.adopted.append(job)
                        continue
                prior = fingerprint(path)
                attempts = rec["attempts"] if same else 0
                self._set(job, now, status="pending", prior=prior, attempts=attempts,
                          sha256=None, seconds=None, media_s=None,
                          error=rec["error"] if same else None)
                plan.render.append((job, prior))
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return plan

    def _set(self, job: Job, now: float, **values: object) -> None:
        self.db.execute("INSERT INTO rows (out, key, status) VALUES (?, ?, 'pending') "
                        "ON CONFLICT(out) DO NOTHING", (job.out, job.key))
        values.update(key=job.key, row=job.row, updated=now)
        cols = ", ".join(f"{k} = ?" for k in values)
        self.db.execute(f"UPDATE rows SET {cols} WHERE out = ?", (*values.values(), job.out))  # noqa: S608

    def record(self, out: str, result: dict) -> None:
        """A render's result (from the worker): done with its hash, or failed with its error;
        `attempts` grows by the attempts the worker made."""
        done = result["status"] == "done"
        self.db.execute(
            "UPDATE rows SET status = ?, sha256 = ?, seconds = ?, media_s = ?, error = ?, "
            "attempts = attempts + ?, updated = ? WHERE out = ?",
            ("done" if done else "failed", result.get("sha256") if done else None,
             result.get("seconds"), result.get("media_s"), None if done else result.get("error"),
             int(result.get("attempts", 1)), time.time(), out))


def remove_leftovers(out_dir: Path, outs: Iterable[str]) -> int:
    """Delete what killed renders left beside the outputs of `outs` (partial files, signing
    copies, lock sidecars), taking each output's lock first so a live writer's files are left
    alone; how many files were deleted. Called under the manifest's lock (no other batch runs)."""
    removed = 0
    by_dir: dict[Path, set[str]] = {}
    for out in outs:
        final = out_dir / out
        by_dir.setdefault(final.parent, set()).add(final.name)
    for folder, names in by_dir.items():
        try:
            entries = [e for e in os.listdir(folder) if ".partial-" in e or ".signing-" in e or e.endswith(".lock")]
        except FileNotFoundError:
            continue
        for name in names:
            stem, suffix = re.escape(name[: -len(".mp4")]), re.escape(name[-len(".mp4"):])
            temp = re.compile(rf"{stem}(\.partial-\d+(-\d+)?(\.signing-\d+)?|\.signing-\d+){suffix}")
            mine = [e for e in entries if e == name + ".lock" or temp.fullmatch(e)]
            if not mine:
                continue
            lock = OutputLock(folder / name)
            try:
                lock.acquire()
            except OutputError:
                continue  # someone is writing it: theirs
            try:
                for e in mine:
                    if e != name + ".lock":
                        try:
                            (folder / e).unlink(missing_ok=True)
                            removed += 1
                        except OSError as err:
                            raise OutputError(f"cannot remove {folder / e}: {os_reason(err)}") from err
            finally:
                lock.release()
    return removed
