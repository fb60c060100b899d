"""Outputs that are never lost: a new file replaces the old one only when it is complete, and one
writer at a time.

Write beside, rename at the end
-------------------------------
`AtomicOutput` hands the writer a *partial* path beside the final one, in the same folder
(`talk.mp4` -> `talk.partial-<pid>.mp4`: the same file system, so the rename is atomic, and the
same extension, so a player opens it while it grows). `commit` syncs the partial to the device,
gives it the old file's permissions and renames it over the final path, then syncs the folder: a
reader of the final path sees the old file or the whole new one, never a mix, even after a power
loss. `keep` leaves a failed run's partial where it is (the caller names it to the user) and
`discard` deletes it; neither touches the final path. Signing (provenance/credentials.py) writes a
copy beside the file it signs (`….signing-<pid>.mp4`) and renames it over that file; a copy left by
a run killed while signing (kill -9) is deleted by the next run that takes the same lock.

One writer per path
-------------------
`OutputLock` holds an exclusive `flock` on a sidecar `<final>.lock` that records the writer's pid.
The kernel drops the lock when its process dies (even by kill -9), so a lock file left by a dead
run is taken over, never waited on; the sidecar is deleted on release (also after Ctrl-C or SIGTERM,
which end a run as an interruption: publish/interrupt.py). A second writer is refused
at once with the first one's pid. `flock` is advisory: other programs writing the same path are
not stopped, only avatarstream runs (and anything that takes the same lock).
"""

from __future__ import annotations

import errno
import fcntl
import glob
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from avatarstream.errors import OutputError

log = logging.getLogger(__name__)


def os_reason(e: BaseException) -> str:
    """What an OS (or FFmpeg) error means to a user ("no space left on device"), without errno
    numbers or a repeated file name."""
    code = getattr(e, "errno", None)
    if code in errno.errorcode:
        reason = os.strerror(code).lower()
        if code == errno.EFBIG:
            reason += " (a file-size limit of this system or process: see `ulimit -f`)"
        return reason
    return str(getattr(e, "strerror", None) or e).rstrip(".")


def final_target(path: str | Path) -> Path:
    """The path a new output replaces: `path`, or the file a symlink at `path` points to."""
    p = Path(path)
    return Path(os.path.realpath(p)) if p.is_symlink() else p


def partial_path(final: Path, clash: Callable[[str], bool] | None = None) -> Path:
    """`<stem>.partial-<tag><suffix>` beside `final`, tag `<pid>`, or `<pid>-2`, `<pid>-3`… when a
    kept one has that name (or `clash(tag)` says the tag is taken otherwise)."""
    pid = os.getpid()
    for n in range(1, 1000):
        tag = f"{pid}" if n == 1 else f"{pid}-{n}"
        p = final.with_name(f"{final.stem}.partial-{tag}{final.suffix}")
        if not p.exists() and not (clash is not None and clash(tag)):
            return p
    raise OutputError(f"cannot write {final}: too many partial outputs beside it; remove them")


def partial_tag(partial: Path) -> str:
    """The tag of a partial path: `talk.partial-123.mp4` -> `123`."""
    return partial.stem.rsplit(".partial-", 1)[-1]


class OutputLock:
    """An exclusive, process-lifetime lock on writing `target` (see the module doc)."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.path = target.with_name(target.name + ".lock")
        self._fd: int | None = None
        self.stale_pid: int | None = None  # the pid a dead run left in the lock file, if any

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise OutputError naming the run that holds it."""
        if self._fd is not None:
            return
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise OutputError(f"cannot write {self.target}: cannot create {self.path} "
                                  f"({os_reason(e)})") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _read_pid(fd)
                os.close(fd)
                who = f"another avatarstream run (pid {pid})" if pid else "another avatarstream run"
                raise OutputError(f"{self.target} is being written by {who}; wait for it to "
                                  "finish or choose another output path") from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # the holder deleted this lock file as we opened it: take the new one
        self.stale_pid = _read_pid(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        """Delete the sidecar, then drop the lock (in that order: no one locks a deleted file)."""
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


@dataclass(frozen=True)
class Kept:
    """What a failed run left: `frames` video frames in `path`, meant to replace `final`."""

    final: Path
    path: Path
    frames: int
    unsigned: str | None = None  # why it carries no content credentials when it should

    def note(self) -> str:
        note = (f"the {self.frames} frames written are kept in {self.path} (playable); "
                f"{self.final} is unchanged")
        if self.unsigned:
            note += f"; {self.path.name} is NOT signed (no content credentials: {self.unsigned})"
        return note


class AtomicOutput:
    """A new file (or playlist) for `final`, written at `partial` and renamed over `final` when
    complete. `reserve` takes the lock (call it early: a second writer is refused before any work);
    `begin` picks the partial path; then exactly one of `commit`, `keep`, `discard`."""

    def __init__(self, final: str | Path) -> None:
        self.final = final_target(final)
        self.lock = OutputLock(self.final)
        self.partial: Path | None = None

    def reserve(self) -> None:
        if self.lock.held:
            return
        self.lock.acquire()
        _remove_dead_signing(self.final)
        dead = self.lock.stale_pid
        if dead is not None and dead != os.getpid():
            stem, suffix = glob.escape(self.final.stem), glob.escape(self.final.suffix)
            left = sorted(self.final.parent.glob(f"{stem}.partial-{dead}*{suffix}"))
            if left:
                log.warning("an earlier run (pid %d) writing %s did not finish; what it wrote is "
                            "in %s", dead, self.final, ", ".join(map(str, left)))

    def begin(self, clash: Callable[[str], bool] | None = None) -> Path:
        self.reserve()
        if self.partial is None:
            self.partial = partial_path(self.final, clash)
        return self.partial

    def commit(self) -> None:
        """Sync the partial, rename it over the final path, sync the folder; release the lock."""
        assert self.partial is not None
        try:
            _fsync_path(self.partial)
            try:
                os.chmod(self.partial, stat.S_IMODE(os.stat(self.final).st_mode))
            except FileNotFoundError:
                pass
            os.replace(self.partial, self.final)
            _fsync_path(self.final.parent)
        except OSError as e:
            raise OutputError(f"cannot replace {self.final} with {self.partial}: {os_reason(e)}") from e
        finally:
            self.lock.release()
        self.partial = None

    def keep(self, frames: int) -> Kept | None:
        """Leave the partial under its name when it holds something (else delete it)."""
        partial, self.partial = self.partial, None
        try:
            if partial is None or not partial.exists():
                return None
            if frames <= 0:
                partial.unlink(missing_ok=True)
                return None
            return Kept(self.final, partial, frames)
        finally:
            self.lock.release()

    def discard(self) -> None:
        if self.partial is not None:
            self.partial.unlink(missing_ok=True)
            self.partial = None
        self.lock.release()


def _remove_dead_signing(final: Path) -> None:
    """Delete the signing copies (`<stem>[.partial-<tag>].signing-<pid><suffix>`) that runs killed
    while signing (kill -9) left beside `final`: unfinished copies of a file that is still there
    (the partial, or `final`). Called under `final`'s lock; a live process's copy is left alone."""
    stem, suffix = glob.escape(final.stem), glob.escape(final.suffix)
    for copy in final.parent.glob(f"{stem}.*signing-*{suffix}"):
        pid = copy.name[: -len(final.suffix) or None].rpartition(".signing-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            log.info("removing %s, an unfinished signing copy of a run (pid %s) that was killed", copy, pid)
            copy.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
