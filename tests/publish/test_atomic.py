"""Outputs that are never lost (issue 30): an atomic MP4 or HLS output replaces the old one only
when complete and is playable while written; a second writer is refused, a dead writer's lock is
taken over; a failed run keeps its frames under the partial name or leaves nothing; a full disk
cuts the file back to its last whole fragment and says "no space left on device"."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import av
import pytest

from avatarstream.errors import OutputError
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.publish.base import end_sinks, ending
from avatarstream.publish.file import FragmentedMP4Sink, FragmentFile
from avatarstream.publish.hls import HLSSink
from publish.test_sinks import FPS, SIZE, SR, decode_frames, moving_frames, tone

OLD = b"the old output, still wanted"


def write_seconds(sink, seconds: range) -> None:  # noqa: ANN001
    for k in seconds:
        sink.write_audio(AudioChunk(tone(k * SR, SR), k * SR, SR))
        sink.write_video(VideoChunk(moving_frames(k * FPS, FPS), k * FPS, FPS))


def leftovers(d: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name not in keep)


def top_level_boxes(path: Path) -> list[tuple[bytes, int]]:
    """(type, size) of the top-level MP4 boxes; asserts they tile the file exactly."""
    data = path.read_bytes()
    boxes, pos = [], 0
    while pos < len(data):
        size, kind = struct.unpack_from(">I4s", data, pos)
        assert size >= 8 and pos + size <= len(data), f"a cut box at byte {pos} of {len(data)}"
        boxes.append((kind, size))
        pos += size
    return boxes


# -- MP4 -----------------------------------------------------------------------------------------
def test_mp4_replaces_the_old_file_only_when_complete(tmp_path):
    out = tmp_path / "talk.mp4"
    out.write_bytes(OLD)
    os.chmod(out, 0o600)
    sink = FragmentedMP4Sink(out, atomic=True)
    sink.open(SIZE, SIZE, FPS, SR)
    assert sink.writing == tmp_path / f"talk.partial-{os.getpid()}.mp4"
    assert (tmp_path / "talk.mp4.lock").read_text().strip() == str(os.getpid())
    write_seconds(sink, range(2))
    assert out.read_bytes() == OLD  # untouched while the new one grows
    copy = tmp_path / "copy.mp4"
    shutil.copyfile(sink.writing, copy)
    assert sink.durable_frames == 25 and decode_frames(copy) >= 25  # the partial plays already
    write_seconds(sink, range(2, 3))
    sink.close()
    assert decode_frames(out) == 75 and sink.writing == out
    assert out.stat().st_mode & 0o777 == 0o600  # the old file's permissions
    assert leftovers(tmp_path, {"talk.mp4", "copy.mp4"}) == []  # no partial, no lock


def test_a_second_writer_is_refused_until_the_first_ends(tmp_path):
    out = tmp_path / "talk.mp4"
    first = FragmentedMP4Sink(out, atomic=True)
    first.reserve()
    second = FragmentedMP4Sink(out, atomic=True)
    with pytest.raises(OutputError, match=f"being written by another avatarstream run \\(pid {os.getpid()}\\)"):
        second.reserve()
    with pytest.raises(OutputError, match="being written"):
        second.open(SIZE, SIZE, FPS, SR)
    first.open(SIZE, SIZE, FPS, SR)
    write_seconds(first, range(1))
    first.close()
    second.open(SIZE, SIZE, FPS, SR)  # free again
    second.abort()
    assert decode_frames(out) == 25 and leftovers(tmp_path, {"talk.mp4"}) == []


def test_the_lock_of_a_killed_writer_is_taken_over(tmp_path, caplog):
    """kill -9 leaves the lock file and a playable partial: the next run writes anyway (the kernel
    dropped the lock), says where the dead run's frames are, and leaves them alone."""
    out = tmp_path / "talk.mp4"
    code = f"""
import json, os, signal
import numpy as np
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.publish.file import FragmentedMP4Sink
sink = FragmentedMP4Sink({str(out)!r}, atomic=True)
sink.open({SIZE}, {SIZE}, {FPS}, {SR})
for k in range(2):
    sink.write_audio(AudioChunk(np.zeros({SR}, np.float32), k * {SR}, {SR}))
    sink.write_video(VideoChunk(np.full(({FPS}, {SIZE}, {SIZE}, 3), 60 * k, np.uint8), k * {FPS}, {FPS}))
print(json.dumps({{"partial": str(sink.writing), "durable": sink.durable_frames}}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr
    dead = json.loads(r.stdout.strip().splitlines()[-1])
    assert (tmp_path / "talk.mp4.lock").exists() and not out.exists()
    sink = FragmentedMP4Sink(out, atomic=True)
    with caplog.at_level("WARNING"):
        sink.reserve()
    assert dead["partial"] in caplog.text and "did not finish" in caplog.text
    sink.open(SIZE, SIZE, FPS, SR)
    write_seconds(sink, range(1))
    sink.close()
    assert decode_frames(out) == 25
    assert decode_frames(Path(dead["partial"])) >= dead["durable"] == 25


def test_a_failed_run_keeps_its_frames_beside_the_old_file(tmp_path):
    out = tmp_path / "talk.mp4"
    out.write_bytes(OLD)
    sink = FragmentedMP4Sink(out, atomic=True)
    with pytest.raises(RuntimeError), ending([sink]):
        sink.open(SIZE, SIZE, FPS, SR)
        write_seconds(sink, range(2))
        raise RuntimeError("a bug after two chunks")
    partial = tmp_path / f"talk.partial-{os.getpid()}.mp4"
    assert out.read_bytes() == OLD
    assert decode_frames(partial) == 50  # keep() let the muxer write the last fragment
    assert leftovers(tmp_path, {"talk.mp4", partial.name}) == []  # the lock is released

    with pytest.raises(OutputError) as e, ending([FragmentedMP4Sink(out, atomic=True)]):
        raise OutputError("the user's mistake")
    assert str(e.value) == "the user's mistake"  # nothing written, nothing to name


@pytest.mark.parametrize("how", ["keep", "abort"])
def test_a_run_that_wrote_no_frame_leaves_nothing(tmp_path, how):
    out = tmp_path / "talk.mp4"
    out.write_bytes(OLD)
    sink = FragmentedMP4Sink(out, atomic=True)
    sink.open(SIZE, SIZE, FPS, SR)
    sink.write_audio(AudioChunk(tone(0, SR), 0, SR))
    assert getattr(sink, how)() is None
    assert out.read_bytes() == OLD and leftovers(tmp_path, {"talk.mp4"}) == []


def test_a_full_disk_keeps_whole_fragments_and_says_so(tmp_path, monkeypatch):
    """ENOSPC in the middle of the third fragment's write: the file is cut back to the end of the
    second, the error names the disk and the file, the kept file decodes to every durable frame."""
    out = tmp_path / "talk.mp4"
    out.write_bytes(OLD)
    write = FragmentFile._os_write
    budget = {"writes": 4}  # ftyp, moov, two fragments; the next is half-written

    def full_disk(fd: int, data: memoryview) -> int:
        budget["writes"] -= 1
        if budget["writes"] < 0:
            write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, data)

    monkeypatch.setattr(FragmentFile, "_os_write", staticmethod(full_disk))
    sink = FragmentedMP4Sink(out, atomic=True)
    sink.open(SIZE, SIZE, FPS, SR)
    with pytest.raises(OutputError) as e:
        write_seconds(sink, range(5))
    assert "no space left on device" in str(e.value) and str(sink.writing) in str(e.value)
    durable = sink.durable_frames
    partial = sink.writing
    with pytest.raises(OutputError) as e2:
        end_sinks([sink], ok=True)  # closing a cut file fails with the same reason, never commits
    assert "no space left on device" in str(e2.value) and "PyAV callback" not in str(e2.value)
    assert f"the {durable} frames written are kept in {partial}" in str(e2.value)
    assert out.read_bytes() == OLD
    assert [k for k, _ in top_level_boxes(partial)][-1] == b"mdat"  # ends on a whole fragment
    assert durable in (25, 50) and decode_frames(partial) == durable


# -- HLS -----------------------------------------------------------------------------------------
def hls_run(d: Path, seconds: int, *, fail: bool = False) -> HLSSink:
    sink = HLSSink(d, segment_seconds=1, atomic=True)
    with pytest.raises(RuntimeError) if fail else _nothing(), ending([sink]):
        sink.open(SIZE, SIZE, FPS, SR)
        write_seconds(sink, range(seconds))
        if fail:
            raise RuntimeError("stopped")
    return sink


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


def test_hls_playlist_is_replaced_when_complete(tmp_path):
    d = tmp_path / "hls"
    hls_run(d, 2)
    old = (d / "index.m3u8").read_text()
    old_segments = sorted(p.name for p in d.glob("segment_*.ts"))
    assert len(old_segments) == 2

    sink = HLSSink(d, segment_seconds=1, atomic=True)
    sink.open(SIZE, SIZE, FPS, SR)
    write_seconds(sink, range(3))
    assert (d / "index.m3u8").read_text() == old  # the old stream plays on, whole
    assert all((d / s).exists() for s in old_segments)
    assert sink.live_playlist.name.startswith(f"index.partial-{os.getpid()}") and sink.durable_frames == 50
    sink.close()
    text = (d / "index.m3u8").read_text()
    assert "#EXT-X-ENDLIST" in text and not any(s in text for s in old_segments)
    assert not any((d / s).exists() for s in old_segments)  # the old stream's segments go with it
    with av.open(str(d / "index.m3u8")) as c:
        assert sum(1 for _ in c.decode(video=0)) == 75
    assert leftovers(d, {"index.m3u8", *(p.name for p in d.glob("segment_*.ts"))}) == []


def test_hls_failed_run_keeps_its_stream_beside_the_old_one(tmp_path):
    d = tmp_path / "hls"
    hls_run(d, 2)
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    sink = hls_run(d, 3, fail=True)
    (kept,) = d.glob(f"index.partial-{os.getpid()}*.m3u8")
    assert {n: (d / n).read_bytes() for n in before} == before  # the old stream untouched
    with av.open(str(kept)) as c:
        assert sum(1 for _ in c.decode(video=0)) == 75
    assert sink.live_playlist == kept and not (d / "index.m3u8.lock").exists()

    after = sorted(p.name for p in d.iterdir())
    hls_run(d, 0, fail=True)  # nothing written: nothing left
    assert sorted(p.name for p in d.iterdir()) == after
