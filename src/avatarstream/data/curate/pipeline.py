"""`curate`: a folder of a user's videos -> training shards, on Ray Data.

Two Ray Data passes, both run by the same code whatever the number of workers (`workers = 1` is
Ray with a concurrency of 1, not a second code path):

1. one task per input video (`normalise_rows`): probe, normalise to 25 fps / 16 kHz mono into
   the work folder, find the shot cuts -> one row per window of a shot (at most `max_frames`);
2. the windows through a pool of `workers` actors (`WindowWorker`, each loads dlib's models once):
   face tracks, stretches, crops, measures and verdicts (`stretch.py`) -> one JSON record per
   stretch; crops of the stretches that pass are written to the work folder.

The driver then sorts the records by key (so the result does not depend on which worker finished
first), decides duplicates, identities and scenes (shots grouped by their background,
`scene_threshold`) over all of them (`graph.py`), moves the kept stretches
into the shards in key order (`ShardWriter`), and writes `manifest.json` and `pairs.json`. Ray is
started for the call (`ray.init(num_cpus=workers)`) and stopped after it, unless it is already
running (then it is used as it is) or `ray_address` names a cluster; a cluster's workers must see
the output folder (shared storage) and have avatarstream installed. The work folder
(`out/.curate-work`, removed at the end) holds the normalised videos, lossless: about 1 MB a second
of 640 x 360 input.

What it writes into `out` (a new folder):

    index.json          ShardReader's index: {"version": 1, "clips": [entry, ...]}, entries in key
                        order with key, shard, identity ("person-NNN"), scene ("scene-NNN": the
                        shots, of any input, with one background), shot_id ("vNNNN-STEM-sNNNN"),
                        split ("train"), size, frames, seconds, source, video, start_frame,
                        end_frame (in the input's 25 fps frames), text ("")
    shard-NNNNN/KEY.mkv the head crops, size x size, 25 fps, lossless (`shards.write_video`)
    shard-NNNNN/KEY.wav the stretch's audio, 16 kHz mono PCM
    shard-NNNNN/KEY.json annotations: key, identity, scene, shot_id, source, video, shot, window, track, start_frame,
                        end_frame, fps, sample_rate, size, frames, seconds, frame_size, quality
                        (the filters' measures), head_motion (summary), per_frame: landmarks
                        [F][68][2] in crop pixels, yaw/pitch/roll (deg), mouth_open, head_x/head_y
                        (face centre / frame size), head_scale (face width / frame height), crop
                        [F][3] (left, top, side in frame pixels), speaking
    pairs.json          {"pairs": [{"reference": KEY, "target": KEY, "identity": ID}, ...]}: one
                        person's stretches, reference and target from different scenes (two
                        shots of one background never pair)
    manifest.json       {"version", "config", "inputs": [per input: source, video, frames, width,
                        height, has_audio, shots [[start, end), ...], trimmed [{reason
                        ("frame_gap" | "too_long"), at_frame, detail}: where the input was cut,
                        `normalise.Bounds`] or status "rejected" with reason "unreadable" and
                        detail], "stretches": [per stretch: key, video, shot, window, track,
                        shot_id, scene (None: no frame of the shot read), background (the window's
                        background descriptor, `background.py`), start, end, frames, status
                        ("kept" | "rejected"), reason (the first of reasons: unreadable, no_face,
                        too_short, face_too_small, blur, extreme_pose, no_speech, av_offset,
                        duplicate), reasons, metrics, identity,
                        duplicate_of, descriptor (dlib's mean 128-d, for stretches that passed)]}

KEY is `vNNNN-STEM-sNNNN-WWWW-tT`: input number and file stem, shot, window of the shot (shots
longer than `max_frames` are read in equal windows, `stretch.windows`), track in the window. A window
without a usable face appears in the manifest under the key `vNNNN-STEM-sNNNN-WWWW`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from avatarstream.data.clip import FPS
from avatarstream.data.curate.graph import assign_identities, assign_scenes, cross_scene_pairs, mark_duplicates
from avatarstream.data.curate.normalise import Bounds
from avatarstream.data.curate.stretch import StretchOptions, windows
from avatarstream.data.shards import ShardWriter
from avatarstream.errors import ConfigError, InputError, OutputError
from avatarstream.ray_session import ray_session

log = logging.getLogger(__name__)

MANIFEST_VERSION = 1
WORK = ".curate-work"


@dataclass(frozen=True)
class CurateConfig:
    """Everything that decides what `curate` writes (`workers` and `ray_address` do not)."""

    max_side: int = 640
    cut_threshold: float = 27.0
    min_shot_frames: int = 15
    identity_threshold: float = 0.5
    scene_threshold: float = 0.75  # background descriptor distance for one scene (graph.py)
    shard_size: int = 64
    stretch: StretchOptions = field(default_factory=StretchOptions)
    bounds: Bounds = field(default_factory=Bounds)  # what one input may become (normalise.py)


def video_name(i: int, path: str) -> str:
    """`vNNNN-stem` with the stem reduced to letters, digits, '-' and '_' (keys are file names)."""
    return f"v{i:04d}-" + re.sub(r"[^A-Za-z0-9_-]+", "_", Path(path).stem)[:40]


def normalise_rows(row: dict[str, Any], work: str, config: CurateConfig) -> list[dict[str, Any]]:
    """Ray task: one input video -> one row per window of each shot (`stretch.windows`), or one row
    saying why it is unreadable."""
    from avatarstream.data.curate.normalise import normalise_video

    try:
        nv = normalise_video(row["source"], row["video"], Path(work), config.max_side, config.cut_threshold,
                             config.min_shot_frames, config.bounds)
    except InputError as e:
        return [{"video": row["video"], "source": row["source"], "error": str(e), "shot": -1, "window": 0}]
    info = {"frames": nv.frames, "width": nv.width, "height": nv.height, "has_audio": nv.has_audio,
            "shots": [list(s) for s in nv.shots], "trimmed": nv.trimmed}
    return [{"video": nv.video, "source": nv.source, "error": "", "shot": k, "window": j, "start": a + u,
             "end": a + v, "video_path": nv.video_path, "audio_path": nv.audio_path, "info": json.dumps(info)}
            for k, (a, b) in enumerate(nv.shots) for j, (u, v) in enumerate(windows(b - a, config.stretch.max_frames))]


class WindowWorker:
    """Ray actor: loads dlib once, turns window rows into stretch records (JSON strings)."""

    def __init__(self, model_dir: str, work: str, config: CurateConfig) -> None:
        from avatarstream.data.curate.faces import DlibFaces

        self.faces = DlibFaces(model_dir)
        self.work = Path(work)
        self.opt = config.stretch

    def __call__(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        from avatarstream.data.curate.normalise import read_audio, read_frames
        from avatarstream.data.curate.stretch import whole_window_record, window_records

        try:
            frames = read_frames(row["video_path"], row["start"], row["end"])
            audio = read_audio(row["audio_path"], row["start"], row["end"])
        except InputError as e:  # the work file of this shot did not read back: say so, go on
            recs = [whole_window_record(row, "unreadable", detail=str(e))]
        else:
            recs = window_records(self.faces, frames, audio, self.opt, row, self.work)
        return [{"key": r["key"], "record": json.dumps(r, sort_keys=True)} for r in recs]


def require_extras() -> None:
    """ConfigError naming the install command when a package of the `curate` or `real` extras is missing."""
    import importlib.util

    missing = [m for m in ("ray", "scenedetect", "imagehash", "dlib") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"curation needs {', '.join(missing)}: pip install 'avatarstream[real,curate]'")


Progress = Callable[[str], None]  # one line of what curate is doing (the CLI prints it on stderr)


def _collect(ds: Any, unit: Callable[[dict[str, Any]], str], total: int, what: str,
             progress: Progress | None) -> list[dict[str, Any]]:
    """Every row of a Ray dataset, with a progress line each time a new `unit` (an input, a
    window) has come back."""
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for row in ds.iter_rows():
        rows.append(row)
        u = unit(row)
        if u not in seen:
            seen.add(u)
            if progress is not None:
                progress(f"{what} {len(seen)}/{total} ({u})")
    return rows


def run_stages(sources: list[str], work: Path, config: CurateConfig, model_dir: str,
               workers: int, progress: Progress | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The two Ray Data passes: (shot rows, stretch records), both sorted."""
    import ray

    items = [{"video": video_name(i, s), "source": s} for i, s in enumerate(sources)]
    if progress is not None:
        progress(f"reading {len(items)} input(s): 25 fps, shot cuts")
    shots = _collect(ray.data.from_items(items, override_num_blocks=len(items)).flat_map(
        normalise_rows, fn_kwargs={"work": str(work), "config": config},
        compute=ray.data.TaskPoolStrategy(size=workers)), lambda r: r["video"], len(items), "read input", progress)
    shots.sort(key=lambda r: (r["video"], r["shot"], r["window"]))
    good = [r for r in shots if not r["error"]]
    rows: list[dict[str, Any]] = []
    if good:
        if progress is not None:
            progress(f"finding faces in {len(good)} window(s) of shots with {workers} worker(s)")
        rows = _collect(ray.data.from_items(good, override_num_blocks=len(good)).flat_map(
            WindowWorker, fn_constructor_kwargs={"model_dir": model_dir, "work": str(work), "config": config},
            compute=ray.data.ActorPoolStrategy(size=workers), num_cpus=1),
            lambda r: re.sub(r"-t\d+$", "", r["key"]), len(good), "window", progress)
    records = sorted((json.loads(r["record"]) for r in rows), key=lambda r: r["key"])
    return shots, records


def curate(videos: list[str | Path], out: str | Path, model_dir: str | Path, config: CurateConfig | None = None,
           *, workers: int = 1, ray_address: str | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Curate `videos` into a shard folder `out` (index.json, shard-*/, manifest.json, pairs.json);
    `model_dir`: dlib's model files (`faces.default_model_dir()`); `progress` gets a line per
    stage, input, window and shard. Returns a summary."""
    config = config or CurateConfig()
    require_extras()
    if workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {workers}")
    if not (config.bounds.max_seconds > 0 and config.bounds.max_gap_s > 0):
        raise ConfigError("--max-input-seconds and --max-frame-gap must be positive")
    sources = [str(Path(v)) for v in videos]
    missing = [s for s in sources if not Path(s).is_file()]
    if not sources or missing:
        raise InputError(f"no such video: {', '.join(missing)}" if missing else "give at least one video")
    out = Path(out)
    if (out / "index.json").exists() or (out / "manifest.json").exists():
        raise OutputError(f"{out} already holds a dataset; curate into a new folder")
    writer = ShardWriter(out, config.shard_size)
    work = out / WORK
    work.mkdir(exist_ok=True)
    try:
        if progress is not None:
            progress(f"starting Ray ({ray_address or f'local, {workers} worker(s)'})")
        with ray_session(workers, ray_address):
            shots, records = run_stages(sources, work, config, str(model_dir), workers, progress)
        summary = finish(out, work, writer, shots, records, config, progress)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return summary


def finish(out: Path, work: Path, writer: ShardWriter, shots: list[dict[str, Any]], records: list[dict[str, Any]],
           config: CurateConfig, progress: Progress | None = None) -> dict[str, Any]:
    """Duplicates, identities, scenes, shards, manifest and pairs (module doc)."""
    if progress is not None:
        progress(f"grouping {len(records)} stretch(es): duplicates, identities, scenes")
    mark_duplicates(records, config.stretch.thresholds.max_hash_distance)
    assign_identities(records, config.identity_threshold)
    assign_scenes(records, config.scene_threshold)
    kept = [r for r in records if not r["reasons"]]
    for pos, r in enumerate(kept):
        shard = writer.shard_of(pos)
        if progress is not None and pos % config.shard_size == 0:
            progress(f"writing {shard} ({min(config.shard_size, len(kept) - pos)} stretch(es))")
        (out / shard).mkdir(exist_ok=True)
        for ext in ("mkv", "wav"):
            os.replace(work / f"{r['key']}.{ext}", out / shard / f"{r['key']}.{ext}")
        ann = dict(r["annotations"], key=r["key"], identity=r["identity"], scene=r["scene"], shot_id=r["shot_id"],
                   source=r["source"], video=r["video"], shot=r["shot"], window=r["window"], track=r["track"],
                   start_frame=r["start"], end_frame=r["end"])
        (out / shard / f"{r['key']}.json").write_text(json.dumps(ann, sort_keys=True))
        writer.add({"key": r["key"], "shard": shard, "identity": r["identity"], "scene": r["scene"],
                    "shot_id": r["shot_id"], "split": "train", "size": config.stretch.size, "frames": r["frames"],
                    "seconds": r["frames"] / FPS, "source": r["source"], "video": r["video"],
                    "start_frame": r["start"], "end_frame": r["end"], "text": ""})
    writer.close()
    pairs = cross_scene_pairs(kept)
    _write_json(out / "pairs.json", {"pairs": pairs})
    _write_json(out / "manifest.json", manifest(shots, records, config))
    rejected: dict[str, int] = {}
    for r in records:
        if r["reasons"]:
            rejected[r["reasons"][0]] = rejected.get(r["reasons"][0], 0) + 1
    trimmed: dict[str, int] = {}
    for s in {s["video"]: s for s in shots if not s["error"]}.values():
        for t in json.loads(s["info"])["trimmed"]:
            trimmed[t["reason"]] = trimmed.get(t["reason"], 0) + 1
    return {"out": str(out), "videos": len({s["video"] for s in shots}), "shots": len({(s["video"], s["shot"]) for s in shots if not s["error"]}),
            "stretches": len(records), "kept": len(kept), "rejected": rejected, "trimmed_inputs": trimmed,
            "identities": len({r["identity"] for r in kept}), "scenes": len({r["scene"] for r in kept}),
            "pairs": len(pairs),
            "kept_seconds": round(sum(r["frames"] for r in kept) / FPS, 2)}


def manifest(shots: list[dict[str, Any]], records: list[dict[str, Any]], config: CurateConfig) -> dict[str, Any]:
    inputs: dict[str, dict[str, Any]] = {}
    for s in shots:
        if s["error"]:
            inputs[s["video"]] = {"video": s["video"], "source": s["source"], "status": "rejected",
                                  "reason": "unreadable", "detail": s["error"]}
        else:
            inputs.setdefault(s["video"], {"video": s["video"], "source": s["source"], "status": "read",
                                           **json.loads(s["info"])})
    stretches = []
    for r in records:
        e = {k: r.get(k) for k in ("key", "video", "shot", "window", "track", "shot_id", "scene", "background",
                                   "start", "end", "frames", "metrics")}
        e.update(status="rejected" if r["reasons"] else "kept", reason=r["reasons"][0] if r["reasons"] else None,
                 reasons=r["reasons"], identity=r.get("identity"))
        if "duplicate_of" in r:
            e["duplicate_of"] = r["duplicate_of"]
        if "descriptor" in r:
            e["descriptor"] = [round(v, 6) for v in r["descriptor"]]
        stretches.append(e)
    return {"version": MANIFEST_VERSION, "config": asdict(config), "inputs": list(inputs.values()),
            "stretches": stretches}


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)
