"""The server's renders on Ray (`avatarstream serve --batch-ray ADDRESS`): POST /v1/renders jobs go
to a pool of the batch renderers (run.py's `Renderer`, each loading the server's model once) on a
Ray cluster, instead of taking the server's own device from its live sessions.

    pool = RayRenders.connect(address, model=..., size=..., watermark=..., workers=1)  # ConfigError
    job = pool.create(owner, frames, audio, path)    # queued, not yet sent (record it first)
    pool.start(job)                                   # queued -> running -> done | failed
    job.as_dict()                                     # as the server's local render job answers

The server hands over the avatar's reference frames (its own prepared pixels) and the speech
(float32 16 kHz) through Ray's object store; a renderer writes the MP4 to `path` in the server's
render folder, atomically and signed with content credentials as `generate` writes its --out
(credentials_for(model) with the server's AVATARSTREAM_* environment), so the folder must be the
same path on the Ray nodes (the same machine, or shared storage). A dispatcher thread keeps one
render in flight per renderer and the rest queued (their state `queued`); progress is coarse:
0 until the file is in place, then 1. A renderer process that dies is restarted by Ray, which runs
its render again. The server's process does not render these jobs; its live sessions keep its
device.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from avatarstream.batch.run import Renderer, _event, _pieces, _remove_partials
from avatarstream.errors import AvatarStreamError, ConfigError

log = logging.getLogger(__name__)


class ServerRenderer(Renderer):
    """One renderer of the server's pool: the server's model (size, watermark, adapter) loaded
    at start, then one render request after another."""

    def __init__(self, model: str, device: str, workers: int, size: tuple[int, int] | None,
                 watermark: bool, lora: str | None) -> None:
        super().__init__(out_dir="/", device=device, workers=workers, retries=0)
        self.lora, self.size, self.watermark = lora, size, watermark
        self.name = model
        self._configured()  # the weights now: a model the cluster lacks fails the server's start

    def _configured(self) -> Any:
        import dataclasses

        models = self._models(self.name)
        cfg = models.config if self.size is None else models.config.with_size(*self.size)
        return dataclasses.replace(models, config=dataclasses.replace(cfg, watermark=self.watermark))

    def ready(self) -> int:
        return os.getpid()

    def render_request(self, frames: Any, audio: np.ndarray, path: str) -> dict[str, Any]:
        """Render `frames` [F, 3, H, W] uint8 speaking `audio` to `path`; {media_s, signed (its
        public dict), pid} or {error, user_error}."""
        out = Path(path)
        _event("start", out.name)
        from avatarstream.batch.manifest import remove_leftovers

        remove_leftovers(out.parent, [out.name])  # a render Ray runs again: its dead try's files
        try:
            media_s, signed = self.write(self._configured(), frames, _pieces(audio), out)
        except AvatarStreamError as e:
            _remove_partials(out)
            return {"error": str(e), "user_error": True, "pid": os.getpid()}
        except Exception as e:  # noqa: BLE001 - the render fails, the renderer takes the next one
            log.warning("rendering %s failed", out.name, exc_info=True)
            _remove_partials(out)
            return {"error": f"{type(e).__name__}: {e}", "pid": os.getpid()}
        _event("done", out.name)
        return {"media_s": round(media_s, 3), "pid": os.getpid(),
                "signed": None if signed is None else signed.public_dict()}


@dataclass
class RayRender:
    """One render handed to Ray: the fields and `as_dict` of the server's local `RenderJob`."""

    id: str
    owner: str
    path: Path
    total_frames: int
    frames_in: Any = None  # the reference frames and speech until sent
    audio: np.ndarray | None = None
    state: str = "queued"
    error: str | None = None
    created: float = field(default_factory=time.time)
    started: float | None = None
    finished: float | None = None
    signed: dict | None = None
    pid: int | None = None  # the renderer process that made it
    cancel_requested: bool = False

    @property
    def done(self) -> bool:
        return self.state in ("done", "failed", "cancelled")

    @property
    def frames(self) -> int:
        return self.total_frames if self.state == "done" else 0

    def as_dict(self) -> dict:
        elapsed = ((self.finished or time.time()) - self.started) if self.started else 0.0
        return {"id": self.id, "state": self.state, "frames": self.frames,
                "total_frames": self.total_frames,
                "progress": 1.0 if self.state == "done" else 0.0,
                "elapsed_s": round(elapsed, 3),
                "fps": round(self.frames / elapsed, 2) if elapsed > 0 else 0.0,
                "error": self.error, "output_url": f"/v1/renders/{self.id}/output",
                "content_credentials": self.signed}


class RayRenders:
    """The server's render jobs on a Ray actor pool of `ServerRenderer`s (module doc). The
    interface of live/renders.py's RenderManager that the server uses: create, get, forget,
    remove, `max_seconds`; plus `start`, as the scheduler's add_job is there."""

    def __init__(self, actors: list[Any], *, sample_rate: int, fps: int, max_seconds: float,
                 max_jobs: int = 16, on_finish: Callable[[RayRender], None] | None = None) -> None:
        self.actors = actors
        self.sample_rate, self.fps = sample_rate, fps
        self.max_seconds, self.max_jobs = max_seconds, max_jobs
        self.on_finish = on_finish
        self.jobs: dict[str, RayRender] = {}
        self._queue: deque[RayRender] = deque()
        self._lock = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._dispatch, name="ray-renders", daemon=True)
        self._thread.start()

    @classmethod
    def connect(cls, address: str, *, model: str, device: str = "cpu", workers: int = 1,
                size: tuple[int, int] | None = None, watermark: bool = True,
                lora: str | None = None, sample_rate: int, fps: int,
                max_seconds: float = 600.0, timeout: float = 300.0) -> RayRenders:
        """Join the Ray cluster at `address` and start `workers` renderers with the model loaded;
        ConfigError (one line) when Ray is missing or unreachable, or a renderer cannot start."""
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            raise ConfigError("--batch-ray needs Ray, which is not installed: pip install 'avatarstream[curate]'")
        if workers < 1:
            raise ConfigError(f"--batch-workers must be at least 1, got {workers}")
        import ray

        from avatarstream.ray_session import check_reachable

        if not ray.is_initialized():
            check_reachable(address)
            try:
                ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise ConfigError(f"cannot join the Ray cluster at {address!r}: {e}") from e
        env = {"env_vars": {k: v for k, v in os.environ.items() if k.startswith("AVATARSTREAM_")}}
        gpu = {"num_gpus": 1} if device == "cuda" else {}
        remote = ray.remote(ServerRenderer).options(num_cpus=1, max_restarts=-1, max_task_retries=1,
                                                    runtime_env=env, **gpu)
        actors = [remote.remote(model, device, workers, size, watermark, lora) for _ in range(workers)]
        try:
            ray.get([a.ready.remote() for a in actors], timeout=timeout)
        except Exception as e:  # noqa: BLE001 - the actor's own error, or Ray's timeout
            for a in actors:
                ray.kill(a)
            cause = getattr(e, "cause", None) or e
            raise ConfigError(f"the renderers on the Ray cluster at {address!r} did not start: "
                              f"{str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__}") from e
        return cls(actors, sample_rate=sample_rate, fps=fps, max_seconds=max_seconds)

    # -- the server's side --------------------------------------------------------------------------
    def create(self, owner: str, frames: Any, audio: np.ndarray, path: Path) -> RayRender:
        """A queued render of `audio` (float32 at the model's rate) on `frames`; InputError when it
        is empty, too long, or its key has too many running."""
        from avatarstream.live.renders import admit

        admit(self.jobs, self._lock, owner, audio.size / self.sample_rate, self.max_seconds, self.max_jobs)
        with self._lock:
            spf = self.sample_rate // self.fps
            job_id = secrets.token_hex(12)
            job = RayRender(job_id, owner, Path(path) / f"{job_id}.mp4", -(-audio.size // spf),
                            frames_in=frames, audio=np.asarray(audio, np.float32))
            self.jobs[job_id] = job
        return job

    def start(self, job: RayRender) -> None:
        with self._lock:
            self._queue.append(job)
            self._lock.notify_all()

    def get(self, owner: str, job_id: str) -> RayRender | None:
        job = self.jobs.get(job_id)
        return job if job is not None and job.owner == owner else None

    def forget(self, job: RayRender) -> None:
        with self._lock:
            self.jobs.pop(job.id, None)

    def remove(self, job: RayRender) -> None:
        """Forget the job: a queued one is never sent, a running one's file goes when it ends,
        a finished one's now."""
        with self._lock:
            self.jobs.pop(job.id, None)
            job.cancel_requested = True
            if job in self._queue:
                self._queue.remove(job)
                job.state, job.finished = "cancelled", time.time()
            over = job.done
        if over:
            job.path.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        self._thread.join(10)

    # -- the dispatcher thread -----------------------------------------------------------------------
    def _dispatch(self) -> None:
        import ray

        busy: dict[Any, tuple[Any, RayRender]] = {}  # ObjectRef -> (actor, job)
        while True:
            with self._lock:
                while not self._stop and not busy and not self._queue:
                    self._lock.wait(1.0)
                if self._stop:
                    return
                idle = [a for a in self.actors if all(a is not b for b, _ in busy.values())]
                while idle and self._queue:
                    job, actor = self._queue.popleft(), idle.pop()
                    job.state, job.started = "running", time.time()
                    ref = actor.render_request.remote(job.frames_in, job.audio, str(job.path))
                    job.frames_in = job.audio = None
                    busy[ref] = (actor, job)
            if not busy:
                continue
            ready, _ = ray.wait(list(busy), num_returns=1, timeout=0.5)
            for ref in ready:
                _, job = busy.pop(ref)
                try:
                    result = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - Ray's error: the renderer is gone for good
                    log.warning("render %s failed on Ray", job.id, exc_info=True)
                    result = {"error": f"the renderer failed: {type(e).__name__}"}
                self._finish(job, result)

    def _finish(self, job: RayRender, result: dict[str, Any]) -> None:
        with self._lock:
            job.pid = result.get("pid")
            job.finished = time.time()
            if job.cancel_requested:
                job.state = "cancelled"
                job.path.unlink(missing_ok=True)
            elif "error" in result:
                job.state = "failed"
                job.error = result["error"] if result.get("user_error") else "the render failed"
            else:
                job.state, job.signed = "done", result.get("signed")
        if self.on_finish is not None and not job.cancel_requested:
            try:
                self.on_finish(job)
            except Exception:  # noqa: BLE001 - the job itself is over either way
                log.warning("recording the end of render %s failed", job.id, exc_info=True)
