"""`avatarstream batch` on Ray Data: the rows to render -> speech -> an actor pool of renderers.

    ray.data.from_items(rows) --map(speak_item: text -> speech, a CPU task)--> map(Renderer, an
    actor pool of `workers`: each loads its model once and renders row after row) --> the driver
    reads the results as they stream (`iter_rows`) and records each in the manifest.

A renderer writes and signs each video as `generate` does, through the same code: the output's
atomic, locked file sink (`publish.base.generate_outputs`: written beside `out`, signed with the
content credentials, renamed over `out` when complete) ended by `publish.base.ending`, and the
engine's `Pipeline` (its invisible watermark in every frame). On a CPU each actor gets
cores // workers cores, and each render the torch threads `generate` would take on them
(`hardware.generation_threads`); with `device="cuda"` each asks Ray for one GPU (`num_gpus=1`), so
Ray places one actor per GPU of the cluster. On a CPU, Ray Data fuses the speech step into the
renderer actors (same resources: moving speech between processes would gain nothing there); with
GPUs it stays a stage of CPU tasks of its own, running ahead of the renders.

Failures: a row whose render raises is returned as failed with its message (the batch goes on);
an error of the machine (not an InputError/ConfigError, which would fail again) is tried again up to
`retries` more times in the same actor. A worker process that dies (kill -9, out of memory) is
restarted by Ray, which runs its row again; the row first checks whether the dead worker had
already put its output in place (`manifest.finished_output`), so a finished video is never
rendered twice.

On a cluster (`address`), every node needs avatarstream installed and must see the input files
and the output folder at the same paths (shared storage); each node signs with the certificate of
AVATARSTREAM_SIGN_CERT/KEY in its environment, else its own local self-signed one.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from avatarstream.batch.jobs import Job
from avatarstream.batch.manifest import finished_output, sha256_file
from avatarstream.errors import AvatarStreamError

log = logging.getLogger(__name__)

# tests: a file the renderers append one JSON line to per row they start, finish or adopt
# ({"event", "out", "pid"}); unset, nothing is written
EVENTS_FOR_TESTS = "AVATARSTREAM_TEST_BATCH_EVENTS"
MAX_AUDIO_SECONDS = 3600.0
PIECE = 3200  # samples of speech handed to the engine at a time (0.2 s at 16 kHz, as AudioReader)

_TTS = None  # one text-to-speech engine per worker process


def speak_item(item: dict[str, Any]) -> dict[str, Any]:
    """The CPU stage: speech for a text row (float32 16 kHz bytes); audio rows pass through. A
    synthesis error travels with the row, which the renderer then reports as failed."""
    global _TTS
    job = json.loads(item["job"])
    if job["text"] is None:
        return item
    try:
        if _TTS is None:
            from avatarstream.media.tts import TextToSpeech

            _TTS = TextToSpeech()
        x = _TTS.speak(job["text"], job["voice"])
        return {**item, "speech": np.asarray(x, np.float32).tobytes()}
    except Exception as e:  # noqa: BLE001 - the row fails, the batch goes on
        return {**item, "error": f"text to speech failed: {e}"}


class Renderer:
    """One actor of the pool: its model loaded once (kept while rows ask for it; rows are sent
    sorted by model), the references of recent rows kept decoded, every row rendered here."""

    def __init__(self, out_dir: str, device: str, workers: int, retries: int) -> None:
        import torch

        self.out_dir = Path(out_dir)
        self.device = device
        self.retries = retries
        # this actor's cores; each render sets its threads from them as `generate` does
        self.cores = max(1, (os.cpu_count() or 1) // max(1, workers)) if device == "cpu" else None
        if self.cores is not None:
            torch.set_num_threads(self.cores)
        self.models: Any = None  # the ModelSet of the last model asked for
        self.lora: str | None = None  # an adapter merged into every model loaded (the server's --lora)
        self.credentials: dict[str, Any] = {}
        self.references: OrderedDict[tuple, Any] = OrderedDict()

    def __call__(self, item: dict[str, Any]) -> dict[str, Any]:
        job = Job(**json.loads(item["job"]))
        t0 = time.perf_counter()
        _event("start", job.out)
        path = self.out_dir / job.out
        _wait_for_writer(path)  # a worker of a killed driver's job, still finishing this row
        sha = finished_output(path, item["prior"] or None)  # Ray runs it again after a crash
        if sha is not None:
            _event("adopt", job.out)
            result = {"status": "done", "sha256": sha, "attempts": 1, "adopted": True}
        elif item["error"]:
            result = {"status": "failed", "error": item["error"], "attempts": 1}
        else:
            for attempt in range(1, self.retries + 2):  # at least once
                result = self._attempt(job, item["speech"], path)
                result["attempts"] = attempt
                if result["status"] == "done" or result.get("user_error"):
                    break
        result["seconds"] = round(time.perf_counter() - t0, 3)
        result["pid"] = os.getpid()
        return {"out": job.out, "result": json.dumps(result)}

    def _attempt(self, job: Job, speech: bytes, path: Path) -> dict[str, Any]:
        try:
            media_s, signed = self.render(job, speech, path)
        except AvatarStreamError as e:
            _remove_partials(path)
            return {"status": "failed", "error": str(e), "user_error": True}
        except Exception as e:  # noqa: BLE001 - the row fails, the actor renders the next one
            log.warning("rendering %s failed", job.out, exc_info=True)
            _remove_partials(path)
            return {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        _event("done", job.out)
        return {"status": "done", "sha256": sha256_file(path), "media_s": round(media_s, 3),
                "signed": signed}

    def _models(self, name: str) -> Any:
        if self.models is None or self.models.name != name:
            from avatarstream.registry import load_model

            self.models = None  # the old one goes before the new one loads (GPU memory)
            self.models = load_model(name, device=self.device, lora=self.lora)
        return self.models

    def _reference(self, path: str, cfg: Any) -> Any:
        from avatarstream.media.reference import load_reference

        k = (path, cfg.out_hw, cfg.ref_pixel_frames)
        if k not in self.references:
            self.references[k] = load_reference(path, size=cfg.out_hw, max_frames=cfg.ref_pixel_frames)
            while len(self.references) > 4:
                self.references.popitem(last=False)
        self.references.move_to_end(k)
        return self.references[k]

    def render(self, job: Job, speech: bytes, path: Path) -> tuple[float, bool]:
        """Render one row to `path` as `generate` writes its --out; (seconds of video, signed)."""
        models = self._models(job.model)
        cfg = row_config(models.config, job)
        reference = self._reference(job.reference, cfg)
        if job.audio is not None:
            from avatarstream.media.audio import AudioReader

            audio: Iterator = iter(AudioReader(job.audio, sample_rate=cfg.sample_rate,
                                               max_seconds=MAX_AUDIO_SECONDS))
        else:
            audio = _pieces(np.frombuffer(speech, np.float32))
        media_s, signed = self.write(dataclasses.replace(models, config=cfg), reference.frames, audio, path)
        return media_s, bool(signed and signed.signed)

    def write(self, models: Any, frames: Any, audio: Iterator, path: Path) -> tuple[float, Any]:
        """Render `frames` speaking `audio` with `models` (its config as is) to `path`, written
        and signed as `generate` writes its --out; (seconds of video, the sink's `Signed`)."""
        from avatarstream.engine.pipeline import Pipeline
        from avatarstream.provenance.credentials import credentials_for
        from avatarstream.publish.base import ending, generate_outputs

        cfg = models.config
        if self.cores is not None:  # the split decode's threads, or the causal decode's core
            import torch

            from avatarstream.hardware import generation_threads

            torch.set_num_threads(generation_threads(cfg.strategy, cfg.decode_overlap, cores=self.cores))
        if models.name not in self.credentials:
            self.credentials[models.name] = credentials_for(models.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        with ending(sinks := generate_outputs(path, credentials=self.credentials[models.name])):
            for s in sinks:
                s.open(cfg.out_hw[1], cfg.out_hw[0], cfg.fps, cfg.sample_rate)
            summary = Pipeline(models).run(frames, audio, sinks, max_audio_seconds=MAX_AUDIO_SECONDS)
        return summary.duration_s, sinks[0].signed


def row_config(base: Any, job: Job) -> Any:
    """The model's PipelineConfig with the row's strategy, seed and size (a size the model cannot
    make: ConfigError)."""
    from avatarstream.engine.config import parse_size

    cfg = dataclasses.replace(base)
    if job.strategy is not None:
        cfg.strategy = job.strategy
    if job.seed is not None:
        cfg.seed = job.seed
    if job.size is not None:
        cfg = cfg.with_size(*parse_size(job.size))
    return cfg


def _pieces(x: np.ndarray) -> Iterator:
    import torch

    for i in range(0, x.size, PIECE):
        yield torch.from_numpy(x[i:i + PIECE].copy())


def _remove_partials(path: Path) -> None:
    """A failed render's partial file (kept by `ending` for a user of generate to look at): the
    batch renders the row again instead, so it goes."""
    for p in path.parent.glob(f"{path.stem}.partial-{os.getpid()}*{path.suffix}"):
        p.unlink(missing_ok=True)


def _wait_for_writer(path: Path, timeout: float = 300.0) -> None:
    """Return once no process holds `path`'s output lock (publish/output.py), or after `timeout`
    (the render then reports the writer). The kernel drops a dead writer's lock at once."""
    import fcntl

    from avatarstream.publish.output import OutputLock

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            fd = os.open(OutputLock(path).path, os.O_RDONLY)
        except OSError:
            return  # no lock file: no writer
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            time.sleep(0.5)
        finally:
            os.close(fd)


def _event(event: str, out: str) -> None:
    target = os.environ.get(EVENTS_FOR_TESTS)
    if target:
        with open(target, "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": event, "out": out, "pid": os.getpid()}) + "\n")


def render_rows(rows: list[tuple[Job, str | None]], out_dir: Path, *, workers: int, retries: int,
                device: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(out, result) of every row, in the order they finish, from Ray Data (inside a
    `ray_session`). Rows are sent sorted by model so an actor seldom loads another."""
    import ray

    items = [{"job": json.dumps(dataclasses.asdict(j)), "prior": prior or "", "speech": b"", "error": ""}
             for j, prior in sorted(rows, key=lambda r: (r[0].model, r[0].row))]
    if not items:
        return
    gpu = {"num_gpus": 1} if device == "cuda" else {}
    # the workers get this process's AVATARSTREAM_* settings (signing certificate, config folder)
    env = {"env_vars": {k: v for k, v in os.environ.items() if k.startswith("AVATARSTREAM_")}}
    ds = (ray.data.from_items(items, override_num_blocks=len(items))
          .map(speak_item, num_cpus=1, runtime_env=env)
          .map(Renderer, fn_constructor_kwargs={"out_dir": str(out_dir), "device": device,
                                                "workers": workers, "retries": retries},
               compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=1, runtime_env=env, **gpu))
    for row in ds.iter_rows():
        yield row["out"], json.loads(row["result"])


def run_batch(jobs: list[Job], out_dir: Path, *, workers: int = 1, retries: int = 1,
              device: str = "cpu", address: str | None = None,
              progress: Callable[[str, dict[str, Any]], None] | None = None,
              start: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Render every job not already done into `out_dir`, recording each in the manifest; the
    counts (done: rendered now, adopted: finished by a killed run, skipped: done before, failed),
    the failed rows' numbers, seconds of video made and wall seconds. `start`
    hears how many rows will be rendered, `progress` of each result as it comes."""
    from avatarstream.batch.manifest import Manifest, remove_leftovers
    from avatarstream.ray_session import ray_session

    t0 = time.perf_counter()
    counts = {"done": 0, "skipped": 0, "failed": 0, "adopted": 0, "media_s": 0.0, "failed_rows": []}
    with Manifest(out_dir) as manifest:
        remove_leftovers(out_dir, [j.out for j in jobs])
        plan = manifest.plan(jobs)
        counts["skipped"], counts["adopted"] = len(plan.skipped), len(plan.adopted)
        counts["to_render"] = len(plan.render)
        by_out = {j.out: j for j, _ in plan.render}
        if start is not None:
            start(len(plan.render))
        if plan.render:
            with ray_session(workers, address, cpus=workers + 1):
                for out, result in render_rows(plan.render, out_dir, workers=workers,
                                               retries=retries, device=device):
                    manifest.record(out, result)
                    if result["status"] == "done":
                        counts["adopted" if result.get("adopted") else "done"] += 1
                        counts["media_s"] += result.get("media_s") or 0.0
                    else:
                        counts["failed"] += 1
                        counts["failed_rows"].append(by_out[out].row)
                    if progress is not None:
                        progress(out, result)
            remove_leftovers(out_dir, by_out)
    counts["failed_rows"].sort()
    counts["wall_s"] = time.perf_counter() - t0
    return counts
