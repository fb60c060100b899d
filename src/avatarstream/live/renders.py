"""Render jobs: non-live use of the same model — an avatar + speech -> an MP4 file, with progress.

A job is a TalkSegment over the whole audio (no pacing: as fast as the machine allows) publishing
into a fragmented MP4 (playable while it is written). The ChunkScheduler runs one of its chunks
whenever no live session has a chunk due, so renders use the spare time and never make a live
session late. States: queued -> running -> done | failed | cancelled; `on_finish` (the server's
job records) hears of each job once, when it reaches one of the last three.

Content credentials: every finished render is signed (provenance/credentials.py: C2PA, made by
avatarstream with this model, AI-generated), with the certificate of AVATARSTREAM_SIGN_CERT/KEY
or the local self-signed one. Signing reads and rewrites the whole file (about 1 s per 50 MB), so
the last step hands the file to a thread of its own (closing the muxer and signing) and leaves the
scheduler: the job is `done` for the scheduler at once and its state turns `done` (and
`on_finish` runs, on that thread) when the signed file is in place. A signing failure keeps the
complete unsigned file; `content_credentials` in the job says which.
"""

from __future__ import annotations

import logging
from typing import Any
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from avatarstream.engine.executor import LocalExecutor
from avatarstream.engine.config import ModelSet
from avatarstream.engine.pipeline import default_stages
from avatarstream.errors import InputError
from avatarstream.provenance.credentials import ContentCredentials, Signed, credentials_for
from avatarstream.media.frames import AudioChunk, VideoChunk
from avatarstream.publish.file import FragmentedMP4Sink
from avatarstream.live.prepared import PreparedReference
from avatarstream.live.segment import TalkSegment
from avatarstream.live.sinks import BackgroundSink

log = logging.getLogger(__name__)


def _pieces(audio: np.ndarray, piece: int, spf: int) -> Iterator[torch.Tensor]:
    x = np.asarray(audio, np.float32).reshape(-1)
    pad = (-x.size) % spf  # whole video frames, as a live utterance
    x = np.concatenate([x, np.zeros(pad, np.float32)])
    for i in range(0, x.size, piece):
        yield torch.from_numpy(x[i : i + piece])


def admit(jobs: dict, lock: Any, owner: str, seconds: float, max_seconds: float, max_jobs: int) -> None:
    """InputError when a render of `seconds` of audio may not start: empty, longer than
    `max_seconds`, or `owner` (an API key) has `max_jobs` not done in `jobs` (checked under `lock`).
    Shared by the server's own renders and those it sends to Ray (batch/remote.py)."""
    if seconds <= 0:
        raise InputError("the audio is empty: give speech to render")
    if seconds > max_seconds:
        raise InputError(f"the audio is {seconds:.0f} s long; renders are limited to {max_seconds:g} s")
    with lock:
        active = [j for j in jobs.values() if j.owner == owner and not j.done]
        if len(active) >= max_jobs:
            raise InputError(f"{len(active)} renders of this key are still running; wait for one to finish")


@dataclass
class RenderJob:
    id: str
    owner: str
    path: Path
    total_frames: int
    state: str = "queued"
    error: str | None = None
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    segment: TalkSegment | None = None
    executor: LocalExecutor | None = None  # the engine's stages, decoded inline
    sink: BackgroundSink | None = None
    cancel_requested: bool = False
    on_finish: Callable[[RenderJob], None] | None = None  # called once, when the job is over
    credentials: ContentCredentials | None = None
    signed: Signed | None = None
    finishing: threading.Thread | None = None  # closing and signing the file, off the scheduler
    _ending: threading.Lock = field(default_factory=threading.Lock)  # finishing vs. discard

    @property
    def done(self) -> bool:
        """No more work for the scheduler (`state` says when the job itself is over)."""
        return self.state in ("done", "failed", "cancelled") or self.finishing is not None

    @property
    def frames(self) -> int:
        return 0 if self.segment is None else self.segment.frames_published

    def as_dict(self) -> dict:
        elapsed = ((self.finished or time.time()) - self.started) if self.started else 0.0
        return {"id": self.id, "state": self.state, "frames": self.frames,
                "total_frames": self.total_frames,
                "progress": round(min(1.0, self.frames / max(1, self.total_frames)), 4),
                "elapsed_s": round(elapsed, 3),
                "fps": round(self.frames / elapsed, 2) if elapsed > 0 else 0.0,
                "error": self.error, "output_url": f"/v1/renders/{self.id}/output",
                "content_credentials": None if self.signed is None else self.signed.public_dict()}

    # -- the scheduler side ----------------------------------------------------------------------
    def step(self) -> None:
        if self.done or self.segment is None:
            return
        if self.cancel_requested:  # handled here, on the thread that writes the sink
            self.state, self.finished = "cancelled", time.time()
            if self.sink is not None:
                self.sink.abort()
            self._finished()
            return
        if self.state == "queued":
            self.state, self.started = "running", time.time()
        rec = self.segment.plan()
        if rec is not None:
            assert self.executor is not None
            self.executor.run([(rec, self.segment.state)])
            self.segment.finish(rec)
        if rec is None or self.segment.done:
            self.finishing = threading.Thread(target=self._finish, name=f"render-{self.id}-finish")
            self.finishing.start()

    def _finish(self) -> None:
        """Close the file and sign it (the finishing thread), then end the job."""
        assert self.sink is not None
        try:
            self.sink.close()
        except Exception as e:  # noqa: BLE001 - the job reports it, as the scheduler would
            if not self.cancel_requested:
                log.warning("render %s failed while closing its file", self.id, exc_info=True)
                self.fail(e)
                return
            log.debug("render %s, deleted while finishing: closing its file: %s", self.id, e)
        if self.credentials is not None and not self.cancel_requested:  # deleted: nothing to sign
            self.signed = self.credentials.sign_in_place(self.path)
        with self._ending:
            removed = self.cancel_requested  # removed while finishing: the file goes too
            self.state, self.finished = ("cancelled" if removed else "done"), time.time()
        if removed:
            self.path.unlink(missing_ok=True)
        self._finished()

    def fail(self, error: BaseException) -> None:
        self.state, self.finished = "failed", time.time()
        self.error = str(error) if isinstance(error, InputError) else "the render failed"
        if self.sink is not None:
            self.sink.abort()
        self._finished()

    def _finished(self) -> None:
        if self.on_finish is not None:
            try:
                self.on_finish(self)
            except Exception:  # noqa: BLE001 - the job itself is over either way
                log.warning("recording the end of render %s failed", self.id, exc_info=True)

    def cancel(self) -> None:
        """Ask the scheduler to stop the job at its next step (it removes the partial file; a
        finishing job removes its file when finished)."""
        self.cancel_requested = True

    def discard(self) -> None:
        """Delete the job's file: now when the job is over, else when it stops (`cancel`)."""
        with self._ending:
            over = self.state in ("done", "failed", "cancelled")
            self.cancel()
        if over:
            self.path.unlink(missing_ok=True)


class _SinkOutlet:
    def __init__(self, sink: BackgroundSink) -> None:
        self.sink = sink

    def put_video(self, frames: np.ndarray, start_frame: int, fps: int) -> None:
        self.sink.write_video(VideoChunk(frames=frames, start_frame=start_frame, fps=fps))

    def put_audio(self, samples: np.ndarray, start_sample: int, sample_rate: int) -> None:
        self.sink.write_audio(AudioChunk(samples=samples, start_sample=start_sample,
                                         sample_rate=sample_rate))


class RenderManager:
    def __init__(self, data_dir: Path, models: ModelSet, *, max_seconds: float = 600.0,
                 max_jobs: int = 16, on_finish: Callable[[RenderJob], None] | None = None,
                 credentials: ContentCredentials | None = None) -> None:
        self.dir = Path(data_dir) / "renders"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.models = models
        self.max_seconds = max_seconds
        self.max_jobs = max_jobs
        self.on_finish = on_finish
        # every render is signed: the given credentials, else the environment's or local ones
        self.credentials = credentials or credentials_for(models.name)
        self.jobs: dict[str, RenderJob] = {}
        self._lock = threading.Lock()

    def create(self, owner: str, prepared: PreparedReference, audio: np.ndarray) -> RenderJob:
        """A queued job for `audio` (float32 16 kHz); InputError when it is empty or too long."""
        c = self.models.config
        admit(self.jobs, self._lock, owner, audio.size / c.sample_rate, self.max_seconds, self.max_jobs)
        job_id = secrets.token_hex(12)
        spf = c.sample_rate // c.fps
        path = self.dir / f"{job_id}.mp4"
        sink = BackgroundSink(FragmentedMP4Sink(path), watermark=c.watermark)
        sink.open(c.out_hw[1], c.out_hw[0], c.fps, c.sample_rate)
        text, mask = self.models.text.call("encode", [""])
        seg = TalkSegment(self.models, prepared, text, mask,
                          _pieces(audio, c.sample_rate // 5, spf), _SinkOutlet(sink), start_frame=0)
        job = RenderJob(job_id, owner, path, -(-audio.size // spf), segment=seg, sink=sink,
                        executor=LocalExecutor(default_stages(self.models, c)),
                        on_finish=self.on_finish, credentials=self.credentials)
        with self._lock:
            self.jobs[job_id] = job
        return job

    def get(self, owner: str, job_id: str) -> RenderJob | None:
        job = self.jobs.get(job_id)
        return job if job is not None and job.owner == owner else None

    def forget(self, job: RenderJob) -> None:
        """Drop a finished job from memory (its record is kept elsewhere); its file stays."""
        with self._lock:
            self.jobs.pop(job.id, None)

    def remove(self, job: RenderJob) -> None:
        """Forget the job: a finished one's file is deleted, a running one is cancelled."""
        with self._lock:
            self.jobs.pop(job.id, None)
        job.discard()
