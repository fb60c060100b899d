"""Render jobs kept across restarts: one row per job in the server's SQLite store.

A job's row is written when it is accepted and again when it ends (done, failed, cancelled); the
finished job then leaves memory and is answered from its row, its MP4 from `renders/{id}.mp4`.
A server that stopped while jobs were queued or running finds their rows at the next start and
marks them failed, keeping whatever frames were written (the MP4 is fragmented: what is there
plays).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from avatarstream.provenance.credentials import public_credentials

if TYPE_CHECKING:
    from avatarstream.live.renders import RenderJob

DB_NAME = "avatars.sqlite"  # the store the avatars live in (serve/avatars.py)


class RenderRecords:
    def __init__(self, data_dir: str | Path) -> None:
        self.dir = Path(data_dir) / "renders"
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(Path(data_dir) / DB_NAME), check_same_thread=False)
        with self._lock, self._db:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS renders (id TEXT PRIMARY KEY, owner TEXT NOT NULL, "
                "state TEXT NOT NULL, created REAL NOT NULL, info TEXT NOT NULL)")
        self._mark_interrupted()

    def close(self) -> None:
        self._db.close()

    def path(self, job_id: str) -> Path:
        return self.dir / f"{job_id}.mp4"

    def _mark_interrupted(self) -> None:
        with self._lock, self._db:
            rows = self._db.execute(
                "SELECT id, info FROM renders WHERE state IN ('queued', 'running')").fetchall()
            for job_id, info in rows:
                kept = self.path(job_id).is_file()
                d = {**json.loads(info), "state": "failed", "error": (
                    "the server stopped before this render finished; " +
                    ("the frames written until then are at output_url" if kept
                     else "nothing was written"))}
                self._db.execute("UPDATE renders SET state = ?, info = ? WHERE id = ?",
                                 (d["state"], json.dumps(d), job_id))

    def add(self, job: RenderJob) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT INTO renders VALUES (?, ?, ?, ?, ?)",
                             (job.id, job.owner, job.state, job.created, json.dumps(job.as_dict())))

    def finish(self, job: RenderJob) -> None:
        """Record the job's end (a job removed meanwhile stays removed)."""
        with self._lock, self._db:
            self._db.execute("UPDATE renders SET state = ?, info = ? WHERE id = ?",
                             (job.state, json.dumps(job.as_dict()), job.id))

    def get(self, owner: str, job_id: str) -> dict | None:
        """The job as GET /v1/renders/{id} answers it, if `owner` made it."""
        with self._lock:
            row = self._db.execute("SELECT info FROM renders WHERE id = ? AND owner = ?",
                                   (job_id, owner)).fetchone()
        return None if row is None else public(json.loads(row[0]))

    def remove(self, job_id: str, *, file: bool = True) -> None:
        """Forget the job and delete its file (file=False: a job still in memory owns its file
        and deletes it itself when it stops; live/renders.py `RenderJob.discard`)."""
        with self._lock, self._db:
            self._db.execute("DELETE FROM renders WHERE id = ?", (job_id,))
        if file:
            self.path(job_id).unlink(missing_ok=True)


def public(info: dict) -> dict:
    """A stored job as a client sees it, filtered when answered (not only when stored): a record
    written before the filter existed held the signing certificate's path."""
    cc = info.get("content_credentials")
    return {**info, "content_credentials": public_credentials(cc) if isinstance(cc, dict) else None}
