"""The JOBS file of `avatarstream batch`: one row per video, read from CSV, JSONL or Parquet, and
every row checked before any work.

Columns (names as written, any order):

    reference   an image or video of the person (a path; relative paths are relative to the
                JOBS file's folder, as every path in it)
    audio       the speech, a file - or -
    text        what the person says, spoken by our text to speech (media/tts.py), in
    voice       one of its voices (default: its default voice)
    out         the video's file name under the output folder (`team/alice.mp4`: subfolders are
                made); relative, without `..`, ending in .mp4, one row each
    model, size, strategy, seed   optional, as `generate --model/--size/--strategy/--seed`
    anything else   a template field: `{first_name}` in `text` becomes the row's first_name

A row that breaks a rule is a `BadRow` (its number, 1 for the first row under the header or the
first line, and the reason), reported and skipped; the others become `Job`s. A file that cannot
be read at all, or lacks a column every row needs, is a user error (InputError / ConfigError).

Each job's `key` is a hash of what decides its video (its paths, the text after substitution,
voice, model, size, strategy, seed and out): the manifest re-renders a row whose key changed.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import string
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from avatarstream.errors import ConfigError, InputError

KNOWN = ("reference", "audio", "text", "voice", "out", "model", "size", "strategy", "seed")
STRATEGIES = ("prefix", "interp", "causal")
FORMATS = {".csv": "csv", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
RESERVED = ".batch"  # the manifest and its lock live under names starting with this in DIR


@dataclass(frozen=True)
class Job:
    """One valid row: absolute input paths, the text with its fields substituted."""

    row: int
    out: str  # relative POSIX path under the output folder
    reference: str
    model: str
    audio: str | None = None
    text: str | None = None
    voice: str | None = None
    size: str | None = None
    strategy: str | None = None
    seed: int | None = None
    inputs: str = ""  # the input files' sizes and modification times (`stamp`)

    @property
    def key(self) -> str:
        """What decides the video, hashed: an edited row, or an input file replaced at the same
        path, gets another key (and is rendered again)."""
        fields = {k: v for k, v in asdict(self).items() if k != "row"}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "key": self.key}


def stamp(*paths: str | None) -> str:
    """Size and modification time of each input file: a file re-recorded at the same path changes it."""
    parts = []
    for p in paths:
        if p is not None and os.path.isfile(p):
            st = os.stat(p)
            parts.append(f"{st.st_size}:{st.st_mtime_ns}")
    return ";".join(parts)


@dataclass(frozen=True)
class BadRow:
    row: int
    reason: str

    def __str__(self) -> str:
        return f"row {self.row}: {self.reason}"


def read_rows(path: str | Path) -> list[dict[str, Any] | str]:
    """The rows of a JOBS file as dicts (a JSONL line that is no JSON object: its reason as a
    string, made a bad row by `check_rows`). InputError / ConfigError when the file itself is wrong."""
    p = Path(path)
    fmt = FORMATS.get(p.suffix.lower())
    if fmt is None:
        raise ConfigError(f"{p}: unknown JOBS format {p.suffix or '(no extension)'!r}; give a .csv, "
                          f".jsonl or .parquet file")
    if not p.is_file():
        raise InputError(f"the JOBS file {p} does not exist" if not p.exists() else
                         f"the JOBS file {p} is not a file")
    try:
        if fmt == "csv":
            with open(p, newline="", encoding="utf-8-sig") as f:
                return [_csv_row(r) for r in csv.DictReader(f)]
        if fmt == "jsonl":
            with open(p, encoding="utf-8") as f:
                return [_json_row(line) for line in f if line.strip()]
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ConfigError("Parquet JOBS files need pyarrow: pip install 'avatarstream[curate]' "
                              "(or give a CSV or JSONL file)") from e
        return pq.read_table(p).to_pylist()
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise InputError(f"cannot read the JOBS file {p}: {e}") from e
    except Exception as e:  # pyarrow's errors (ArrowInvalid...) for a damaged Parquet file
        if fmt == "parquet" and type(e).__module__.startswith("pyarrow"):
            raise InputError(f"cannot read the JOBS file {p} as Parquet: {e}") from e
        raise


def _csv_row(r: dict) -> dict[str, Any] | str:
    if None in r:  # DictReader puts the cells past the header's under the key None
        return f"{len(r[None])} more cell(s) than the header has columns"
    return r


def _json_row(line: str) -> dict[str, Any] | str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg})"
    return obj if isinstance(obj, dict) else "not a JSON object"


def _value(v: Any) -> str | None:
    """A cell as text; empty cells, nulls and NaN (pandas' missing value) are None."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    s = str(v).strip()
    return s or None


def load_jobs(path: str | Path, *, default_model: str,
              max_audio_seconds: float = 3600.0) -> tuple[list[Job], list[BadRow], int]:
    """(jobs, bad rows, number of rows) of a JOBS file; paths relative to its folder."""
    p = Path(path)
    rows = read_rows(p)
    jobs, bad = check_rows(rows, base=p.resolve().parent, default_model=default_model,
                           max_audio_seconds=max_audio_seconds)
    return jobs, bad, len(rows)


def check_rows(rows: list[dict[str, Any] | str], *, base: Path, default_model: str,
               max_audio_seconds: float = 3600.0) -> tuple[list[Job], list[BadRow]]:
    """Every row checked (`Checker`); rows sharing an `out` are all bad (which one was meant is
    not ours to guess)."""
    dicts = [r for r in rows if isinstance(r, dict)]
    columns = {k for r in dicts for k in r}
    for need, what in (("reference", "the person's image or video"), ("out", "the video's file name")):
        if dicts and need not in columns:
            raise ConfigError(f"the JOBS file has no `{need}` column ({what}); its columns: "
                              f"{', '.join(sorted(map(str, columns)))}")
    if dicts and not columns & {"audio", "text"}:
        raise ConfigError("the JOBS file has neither an `audio` nor a `text` column: give each row "
                          "its speech file or its text")
    checker = Checker(base, default_model, max_audio_seconds)
    jobs: list[Job] = []
    bad: list[BadRow] = []
    for i, r in enumerate(rows, start=1):
        try:
            if isinstance(r, str):
                raise InputError(r)
            jobs.append(checker.job(i, r))
        except (InputError, ConfigError) as e:
            bad.append(BadRow(i, str(e)))
    by_out: dict[str, list[int]] = {}
    for j in jobs:
        by_out.setdefault(j.out, []).append(j.row)
    dup = {o: rs for o, rs in by_out.items() if len(rs) > 1}
    bad += [BadRow(j.row, f"out {j.out} is the out of rows {', '.join(map(str, dup[j.out]))}; give "
                   "each row its own") for j in jobs if j.out in dup]
    jobs = [j for j in jobs if j.out not in dup]
    bad.sort(key=lambda b: b.row)
    return jobs, bad


class Checker:
    """Turns one row into a Job or raises the reason it is bad (InputError / ConfigError).
    Model specs and size checks are kept per (model, size): 5,000 rows ask for few."""

    def __init__(self, base: Path, default_model: str, max_audio_seconds: float) -> None:
        self.base = base
        self.default_model = default_model
        self.max_audio_seconds = max_audio_seconds
        self._sizes: dict[tuple[str, str | None], None] = {}

    def _path(self, value: str | None, column: str) -> str:
        if value is None:
            raise InputError(f"`{column}` is empty")
        p = Path(value).expanduser()
        p = p if p.is_absolute() else self.base / p
        if not p.exists():
            raise InputError(f"{column} {value} not found (paths are relative to the JOBS file's folder)")
        if not p.is_file():
            raise InputError(f"{column} {value} is not a file")
        return str(p)

    def job(self, row: int, r: dict[str, Any]) -> Job:
        v = {str(k): _value(x) for k, x in r.items()}
        out = check_out(v.get("out"))
        reference = self._path(v.get("reference"), "reference")
        audio, text, voice = v.get("audio"), v.get("text"), v.get("voice")
        if (audio is None) == (text is None):
            raise InputError("give either `audio` or `text`, not both" if audio else
                             "no speech: give `audio` (a file) or `text`")
        if audio is not None:
            if voice is not None:
                raise InputError("`voice` is for `text` rows; this row has `audio`")
            audio = self._audio(audio)
        else:
            text = substitute(text or "", {k: x for k, x in v.items() if k not in KNOWN})
            voice = check_text(text, voice)
        model = v.get("model") or self.default_model
        size, strategy, seed = v.get("size"), v.get("strategy"), v.get("seed")
        self._check_model(model, size)
        if strategy is not None and strategy not in STRATEGIES:
            raise ConfigError(f"strategy {strategy!r}: give one of {', '.join(STRATEGIES)}")
        return Job(row=row, out=out, reference=reference, model=model, audio=audio, text=text,
                   voice=voice, size=size, strategy=strategy, seed=None if seed is None else _seed(seed),
                   inputs=stamp(reference, audio))

    def _audio(self, value: str) -> str:
        from avatarstream.media.audio import AudioReader

        path = self._path(value, "audio")
        AudioReader(path, max_seconds=self.max_audio_seconds)  # opens it: unreadable -> InputError
        return path

    def _check_model(self, model: str, size: str | None) -> None:
        if (model, size) in self._sizes:
            return
        from avatarstream.engine.config import parse_size
        from avatarstream.registry import model_spec_for

        cfg = model_spec_for(model).pipeline()  # an unknown model: ConfigError naming the known ones
        if size is not None:
            cfg.with_size(*parse_size(size))  # a size the model cannot make: ConfigError, nearest sizes
        self._sizes[(model, size)] = None


def check_out(value: str | None) -> str:
    """`out` as a safe relative POSIX path under the output folder, or InputError."""
    if value is None:
        raise InputError("`out` is empty: give the video's file name")
    p = PurePosixPath(value.replace("\\", "/"))
    if p.is_absolute() or value.startswith("~") or (len(value) > 1 and value[1] == ":"):
        raise InputError(f"out {value}: give a file name under the output folder, not an absolute path")
    if ".." in p.parts:
        raise InputError(f"out {value}: `..` would write outside the output folder")
    if p.suffix.lower() != ".mp4":
        raise InputError(f"out {value}: the video is an MP4; end the name in .mp4")
    if p.parts[0].startswith(RESERVED) or any(part.startswith(".") for part in p.parts):
        raise InputError(f"out {value}: hidden names (starting with '.') are not outputs")
    if any(".partial-" in part or ".signing-" in part for part in p.parts):
        raise InputError(f"out {value}: names with .partial- or .signing- are our temporary files")
    return p.as_posix()


def substitute(text: str, fields: dict[str, str | None]) -> str:
    """`text` with each `{name}` replaced by the row's `name` ({{ and }}: literal braces). A field
    the row lacks or leaves empty is an InputError (no video says "Hi ,")."""
    parts: list[str] = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as e:
        raise InputError(f"text: {e} (write {{{{ and }}}} for literal braces)") from None
    for literal, name, spec, conv in parsed:
        parts.append(literal)
        if name is None:
            continue
        if not name.isidentifier() or spec or conv:
            raise InputError(f"text: {{{name}}} is not a field name (a column's name, e.g. {{first_name}})")
        if name not in fields:
            raise InputError(f"text uses {{{name}}} but the JOBS file has no `{name}` column")
        if fields[name] is None:
            raise InputError(f"text uses {{{name}}} but this row's `{name}` is empty")
        parts.append(str(fields[name]))
    return "".join(parts)


def check_text(text: str, voice: str | None) -> str | None:
    """The voice of a text row, checked with the text (what TextToSpeech would refuse)."""
    from avatarstream.media.speech import voice_by_id
    from avatarstream.media.tts import MAX_CHARS

    if not text.strip():
        raise InputError("`text` is empty")
    if len(text) > MAX_CHARS:
        raise InputError(f"text is {len(text)} characters long; at most {MAX_CHARS} a row")
    if voice == "piper":
        raise InputError("voice piper: batch speaks with the built-in voices (see `voice` in docs/batch.md)")
    if voice is not None:
        voice_by_id(voice)
    return voice


def _seed(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise InputError(f"seed {value!r}: give a whole number") from None
