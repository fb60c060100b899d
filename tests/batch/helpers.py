"""Helpers of the batch tests."""

from __future__ import annotations

import csv
import sqlite3
from pathlib import Path


def manifest_rows(out_dir: Path) -> dict[str, dict]:
    """The manifest, read as another process would (no lock taken)."""
    db = sqlite3.connect(f"file:{out_dir / '.batch-manifest.sqlite'}?mode=ro", uri=True)
    try:
        db.row_factory = sqlite3.Row
        return {r["out"]: dict(r) for r in db.execute("SELECT * FROM rows")}
    finally:
        db.close()


def write_csv(path: Path, header: list[str], rows: list[list[object]]) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path
