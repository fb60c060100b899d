"""AvatarStore: uploaded references, prepared once, kept across sessions and restarts.

Metadata lives in SQLite (`avatars.sqlite` in the data folder); the reference frames (decoded,
cropped and resized to the model's resolution: [F, 3, H, W] uint8) in a safetensors file named by
the avatar's id, and, per model, the encoded reference (VAE latents -> DiT and refiner K/V
caches: live/prepared.py) in `{id}.{model}.ref.safetensors`. The encoding runs once, at upload
for the server's model (so a reference with nothing usable is refused right there) or at the
first session of another model, and is then loaded by every session, across restarts. Ids are
generated here (random hex), never taken from a client as a path. An avatar belongs to the API key that created it: a lookup with another key finds
nothing (the server answers 404, so ids of others cannot even be confirmed).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import av
import torch
from safetensors.torch import load_file, save_file

from avatarstream.engine.config import ModelSet
from avatarstream.errors import InputError
from avatarstream.media.image import check_pixels, decoder_options
from avatarstream.media.reference import load_reference
from avatarstream.live.prepared import (PreparedReference, load_prepared, prepare_reference,
                                         save_prepared)
from avatarstream.serve.limits import Limits

log = logging.getLogger(__name__)

_ID = re.compile(r"^[0-9a-f]{24}$")
_MODEL = re.compile(r"[^A-Za-z0-9._-]")

# Accepted upload types -> file suffix load_reference understands.
UPLOAD_TYPES = {
    "image/png": ".png", "image/jpeg": ".jpg", "image/webp": ".webp",
    "video/mp4": ".mp4", "video/quicktime": ".mov", "video/webm": ".webm",
    "video/x-matroska": ".mkv",
}


class UnsupportedUploadError(InputError):
    """The upload's Content-Type is not an image or video type the server reads (HTTP 415)."""


@dataclass(frozen=True)
class Avatar:
    id: str
    created: float
    frames: int
    size: int | str  # the side of square frames, or "WIDTHxHEIGHT"
    is_image: bool
    content_type: str

    def as_dict(self) -> dict:
        return {"id": self.id, "created": self.created, "frames": self.frames, "size": self.size,
                "is_image": self.is_image, "content_type": self.content_type}


def upload_type(content_type: str, accepted: dict[str, str], what: str) -> str:
    """The media type of an upload's Content-Type header (parameters such as `; codecs=` dropped,
    lower case), which must be a key of `accepted`; else UnsupportedUploadError naming the types
    that are, so the client can resend with one of them."""
    ctype = content_type.split(";")[0].strip().lower()
    if ctype not in accepted:
        raise UnsupportedUploadError(f"unsupported {what} type {content_type!r}; send one of "
                                     f"{', '.join(sorted(accepted))} as the Content-Type")
    return ctype


def key_fingerprint(api_key: str) -> str:
    """What the store keeps of an API key (never the key itself)."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def public_message(e: InputError, path: Path) -> str:
    """The message of an error about the server's own copy of an upload at `path`, without
    the path (a client learns nothing of the server's folders)."""
    message = str(e).replace(f"reference {path}", "the uploaded reference")
    return message.replace(str(path), "the upload")


def save_atomic(write: Callable[[Path], None], path: Path) -> None:
    """`write(tmp)` beside `path`, then rename: a crash never leaves a partial file at `path`."""
    tmp = path.with_name(path.name + ".partial")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class AvatarStore:
    def __init__(self, data_dir: str | Path, *, size: int | tuple[int, int], max_frames: int,
                 limits: Limits | None = None, models: ModelSet | None = None) -> None:
        self.dir = Path(data_dir) / "avatars"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.size, self.max_frames = size, max_frames
        self.limits = limits or Limits()
        self.models = models
        self._lock = threading.Lock()
        self._prepare_lock = threading.Lock()
        self.encodes = 0  # reference encodings run by this process (the rest were loaded)
        self._db = sqlite3.connect(str(Path(data_dir) / "avatars.sqlite"), check_same_thread=False)
        with self._db:
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS avatars (id TEXT PRIMARY KEY, owner TEXT NOT NULL, "
                "created REAL NOT NULL, frames INTEGER NOT NULL, size INTEGER NOT NULL, "
                "is_image INTEGER NOT NULL, content_type TEXT NOT NULL)")
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """Files a killed server left behind: uploads being decoded (`*.upload.*`), partial
        writes (`*.partial`, `*.tmp`), and the files of an avatar whose row was never written."""
        with self._lock:
            ids = {r[0] for r in self._db.execute("SELECT id FROM avatars")}
        stale = [f for f in self.dir.iterdir() if f.is_file() and (
            ".upload." in f.name or f.name.endswith((".partial", ".tmp")) or f.name[:24] not in ids)]
        for f in stale:
            f.unlink(missing_ok=True)
        if stale:
            log.info("removed %d file(s) left by interrupted uploads", len(stale))

    def close(self) -> None:
        self._db.close()

    def create(self, api_key: str, data: bytes, content_type: str) -> Avatar:
        """Check the upload, prepare the reference frames once, store them; raises InputError."""
        ctype = upload_type(content_type, UPLOAD_TYPES, "upload")
        if not data:
            raise InputError("the upload is empty; send the reference image or video as the body")
        if len(data) > self.limits.max_bytes:
            raise InputError(f"the upload is {len(data)} bytes; the limit is "
                             f"{self.limits.max_bytes} bytes")
        # What it would cost is read from the headers, before anything is decoded: an image's
        # pixels here, a video's length and frame size (and the decoder's own bound) below.
        check_pixels(data, self.limits.max_pixels, what="the uploaded reference")
        avatar_id = secrets.token_hex(12)
        tmp = self.dir / f"{avatar_id}.upload{UPLOAD_TYPES[ctype]}"
        try:
            tmp.write_bytes(data)
            try:
                if ctype.startswith("video/"):
                    self._check_duration(tmp)
                ref = load_reference(tmp, size=self.size, max_frames=self.max_frames,
                                     max_pixels=self.limits.max_pixels)
            except InputError as e:
                raise InputError(public_message(e, tmp)) from e
            prepared = None
            if self.models is not None:
                prepared = prepare_reference(self.models, ref.frames)  # InputError if blank
                self.encodes += 1
            frames = ref.frames.contiguous()
            save_atomic(lambda p: save_file({"frames": frames}, str(p)),
                        self.dir / f"{avatar_id}.safetensors")
            if prepared is not None:  # written atomically too
                save_prepared(prepared, self._prepared_path(avatar_id, prepared.model))
        finally:
            tmp.unlink(missing_ok=True)
        size = self.size if isinstance(self.size, int) else f"{self.size[1]}x{self.size[0]}"  # (H, W)
        avatar = Avatar(avatar_id, time.time(), int(ref.frames.shape[0]), size, ref.is_image, ctype)
        with self._lock, self._db:
            self._db.execute("INSERT INTO avatars VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (avatar.id, key_fingerprint(api_key), avatar.created, avatar.frames,
                              avatar.size, int(avatar.is_image), avatar.content_type))
        return avatar

    def _check_duration(self, path: Path) -> None:
        try:
            # the probe decodes a frame or two: bounded as the loader's own decoding is
            with av.open(str(path), options=decoder_options(self.limits.max_pixels)) as c:
                seconds = c.duration / 1e6 if c.duration else 0.0
        except (av.FFmpegError, OSError, ValueError) as e:
            reason = getattr(e, "strerror", None) or e.__class__.__name__
            raise InputError(f"the upload is not a readable video ({reason})") from e
        if seconds > self.limits.max_seconds:
            raise InputError(f"the reference video is {seconds:.1f} s long; the limit is "
                             f"{self.limits.max_seconds:g} s (a few seconds are enough)")

    def get(self, api_key: str, avatar_id: str) -> Avatar | None:
        """The avatar if it exists and belongs to `api_key`, else None."""
        if not _ID.match(avatar_id):
            return None
        with self._lock:
            row = self._db.execute(
                "SELECT id, created, frames, size, is_image, content_type FROM avatars "
                "WHERE id = ? AND owner = ?", (avatar_id, key_fingerprint(api_key))).fetchone()
        if row is None:
            return None
        return Avatar(row[0], row[1], row[2], row[3], bool(row[4]), row[5])

    def frames(self, avatar: Avatar) -> torch.Tensor:
        """The reference frames [F, 3, H, W] uint8."""
        return load_file(str(self.dir / f"{avatar.id}.safetensors"))["frames"]

    def _prepared_path(self, avatar_id: str, model: str) -> Path:
        return self.dir / f"{avatar_id}.{_MODEL.sub('_', model)}.ref.safetensors"

    def prepared(self, avatar: Avatar, models: ModelSet) -> PreparedReference:
        """The avatar's reference encoded for `models`: loaded, or encoded once and stored."""
        path = self._prepared_path(avatar.id, models.name)
        with self._prepare_lock:
            if path.is_file():
                try:
                    return load_prepared(path)
                except ValueError:
                    pass  # written by an older version: encode again below
            prepared = prepare_reference(models, self.frames(avatar))
            self.encodes += 1
            save_prepared(prepared, path)
            return prepared

    def count(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM avatars").fetchone()[0])
