"""Footage for personality fine-tuning: a folder `avatarstream curate` (or `avatarstream synth`)
wrote, read as clips and cross-scene pairs.

The contract: `ShardReader(DIR)` reads it; every index entry has `identity` and `scene` (strings
or numbers: compared as strings); `DIR/pairs.json` = `{"pairs": [{"reference": KEY, "target": KEY,
"identity": ID}]}` lists (reference, target) clips of one person in two scenes. Without
pairs.json every ordered pair of clips of one identity in different scenes is one. A pair in one
scene, a key the index lacks, or no pair at all is an InputError: personality SFT learns nothing
about a person from a reference in the very scene it must generate (Avatar V §3.3).

Our own model trains on a prepared file (`prepare_footage`: the same format as `train prepare`,
train/data.py, encoded by the base model's own VAE so the latent space is the model's) read by
`FootageData`, which draws references from the pairs. The official families encode clips on the
fly with their own VAE (train/personality_families.py).
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from avatarstream.errors import InputError
from avatarstream.train.data import (FRAME_KEYS, MOTION_KEYS, MOTION_NORM, PREPARED_VERSION, PreparedData,
                                     encode_video, frame_table)

SAMPLE_RATE = 16000
PAIRS_FILE = "pairs.json"
CACHED_CLIPS = 16  # decoded clips kept in memory (a clip of 10 s at 512 px is ~200 MB)


class Footage:
    """The clips and cross-scene pairs of a footage folder. `pairs`: (reference, target) clip
    indices; `frames(i)` uint8 `[F, H, W, 3]`, `wave(i)` float32 `[N]` at 16 kHz, `annotations(i)`."""

    def __init__(self, root: str | Path) -> None:
        from avatarstream.data.shards import ShardReader

        self.root = Path(root)
        if not (self.root / "index.json").is_file():
            raise InputError(f"--footage {self.root}: no index.json (a folder `avatarstream curate` or "
                             "`avatarstream synth` wrote)")
        self.reader = ShardReader(self.root)
        self.entries = self.reader.entries()
        for e in self.entries:
            if "identity" not in e or "scene" not in e:
                raise InputError(f"--footage {self.root}: clip {e.get('key')!r} has no identity/scene in index.json")
            check_inside(self.root, e)
        self.keys = [str(e["key"]) for e in self.entries]
        self.pairs = self._read_pairs()
        self._load = lru_cache(maxsize=CACHED_CLIPS)(self._record)

    def identity(self, i: int) -> str:
        return str(self.entries[i]["identity"])

    def scene(self, i: int) -> str:
        return str(self.entries[i]["scene"])

    def _read_pairs(self) -> list[tuple[int, int]]:
        at = {k: i for i, k in enumerate(self.keys)}
        path = self.root / PAIRS_FILE
        if path.is_file():
            try:
                raw = json.loads(path.read_text())["pairs"]
                pairs = [(at[str(p["reference"])], at[str(p["target"])]) for p in raw]
            except KeyError as e:
                raise InputError(f"{path}: a pair names {e} (not a clip of index.json, or no "
                                 "reference/target)") from None
            except (ValueError, TypeError) as e:
                raise InputError(f'{path}: not {{"pairs": [{{"reference": KEY, "target": KEY}}]}} ({e})') from None
            same = [(self.keys[r], self.keys[t]) for r, t in pairs
                    if self.scene(r) == self.scene(t) or self.identity(r) != self.identity(t)]
            if same:
                raise InputError(f"{path}: pair {same[0]} is not one person in two scenes")
        else:
            pairs = [(r, t) for t in range(len(self.keys)) for r in range(len(self.keys))
                     if self.identity(r) == self.identity(t) and self.scene(r) != self.scene(t)]
        if not pairs:
            raise InputError(f"--footage {self.root}: no cross-scene pair (personality fine-tuning needs one "
                             "person filmed in at least two scenes)")
        return pairs

    def _record(self, i: int) -> Any:
        rec = self.reader.load(self.entries[i])
        if rec.sample_rate != SAMPLE_RATE:
            raise InputError(f"--footage {self.root}: clip {self.keys[i]} has {rec.sample_rate} Hz audio, "
                             f"expected {SAMPLE_RATE} (curate normalises it)")
        return rec

    def forget(self) -> None:
        """Drop the decoded clips (once they are encoded)."""
        self._load.cache_clear()

    def frames(self, i: int) -> np.ndarray:
        return self._load(i).frames

    def wave(self, i: int) -> np.ndarray:
        return self._load(i).audio.astype(np.float32)

    def annotations(self, i: int) -> dict[str, Any]:
        return self._load(i).annotations

    def targets(self) -> list[int]:
        return sorted({t for _, t in self.pairs})

    def references_of(self, target: int) -> list[int]:
        return [r for r, t in self.pairs if t == target]


def check_inside(root: Path, entry: dict[str, Any]) -> None:
    """InputError unless the clip's files (`root/SHARD/KEY.{mkv,wav,json}`) lie inside its shard
    folder inside `root`: a key or shard that is absolute, names `..`, or whose file (or folder) is
    a symbolic link leading out is refused before anything is read."""
    key, shard = entry.get("key"), entry.get("shard")
    where = f"--footage {root}: clip {key!r} (shard {shard!r}) in index.json"
    for v in (key, shard):
        if (not isinstance(v, str) or not v.strip() or "\0" in v or Path(v).is_absolute()
                or ".." in Path(v).parts or "\\" in v):
            raise InputError(f"{where} names a file outside the footage folder; refusing to read it")
    top = root.resolve()
    folder = (root / shard).resolve()
    if not folder.is_relative_to(top):
        raise InputError(f"{where}: its shard folder leads outside the footage folder; refusing to read it")
    for ext in ("mkv", "wav", "json"):
        if not (root / shard / f"{key}.{ext}").resolve().is_relative_to(folder):
            raise InputError(f"{where}: its .{ext} file leads outside its shard folder; refusing to read it")


def resize_frames(frames: np.ndarray, height: int, width: int) -> torch.Tensor:
    """uint8 `[F, H, W, 3]` -> float `[3, F, height, width]` in [-1, 1] (area-resized when needed)."""
    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2).float().div(127.5).sub(1.0)
    if x.shape[2:] != (height, width):
        x = F.interpolate(x.permute(1, 0, 2, 3), size=(height, width), mode="area").permute(1, 0, 2, 3)
    return x


def annotation_table(ann: dict[str, Any], frames: int, size: int) -> tuple[torch.Tensor, bool]:
    """Per-frame `FRAME_KEYS` `[F, K]` and whether it is measured: the renderer's exact
    annotations for synthetic clips; for other footage a neutral table (every motion key at its
    centre, mouth and eyes where a centred head has them) and False: the motion losses are then off."""
    pf = ann.get("per_frame", {})
    if all(k in pf for k in ("yaw", "pitch", "roll", "mouth_x", "mouth_y", "mouth_open")) and "identity" in ann:
        return torch.from_numpy(frame_table(ann)[:frames]), True
    row = torch.zeros(len(FRAME_KEYS))
    for k in MOTION_KEYS:
        row[FRAME_KEYS.index(k)] = MOTION_NORM[k][0]
    for k, v in {"mouth_x": 0.5, "mouth_y": 0.68, "eye_rx": 0.38, "eye_ry": 0.42, "eye_lx": 0.62,
                 "eye_ly": 0.42}.items():
        row[FRAME_KEYS.index(k)] = v * size
    return row.expand(frames, -1).clone(), False


@torch.no_grad()
def prepare_footage(footage: Footage, vae: torch.nn.Module, out: Path, *, lr_size: int, hr_size: int,
                    device: str = "cpu") -> dict[str, Any]:
    """Encode the footage's clips with `vae` (the base model's, its latent statistics already
    folded in: stored as it is) into a prepared file (train/data.py's format, version
    `PREPARED_VERSION`); identities and scenes are numbered (their names kept as `identity_name`,
    `scene_name`). Returns {"clips", "seconds", "measured_motion"}."""
    from safetensors.torch import save_file

    from avatarstream.train.data import scene_description

    ids: dict[str, int] = {}
    scenes: dict[str, int] = {}
    vae = vae.to(device).eval()
    lr_l, hr_l, waves, tables, clips, measured = [], [], [], [], [], True
    lat_off = frame_off = wave_off = 0
    for i, key in enumerate(footage.keys):
        frames = footage.frames(i)
        usable = 1 + 4 * ((frames.shape[0] - 1) // 4)
        if usable < 5:
            continue
        hr_video = resize_frames(frames[:usable], hr_size, hr_size)[None].to(device)
        lr_video = F.interpolate(hr_video, size=(usable, lr_size, lr_size), mode="area")
        hr = encode_video(vae, hr_video)[0].permute(1, 0, 2, 3)
        lr = encode_video(vae, lr_video)[0].permute(1, 0, 2, 3)
        table, ok = annotation_table(footage.annotations(i), usable, hr_size)
        measured &= ok
        samples = int(math.ceil(usable * SAMPLE_RATE / 25))
        wave = np.zeros(samples, np.float32)
        w = footage.wave(i)[:samples]
        wave[: w.shape[0]] = w
        lr_l.append(lr.half().cpu())
        hr_l.append(hr.half().cpu())
        tables.append(table.half())
        waves.append(torch.from_numpy(np.clip(np.round(wave * 32767), -32768, 32767).astype(np.int16)))
        ident, scene = footage.identity(i), footage.scene(i)
        sc = scenes.setdefault(scene, len(scenes))
        clips.append({"key": key, "identity": ids.setdefault(ident, len(ids)), "scene": sc,
                      "identity_name": ident, "scene_name": scene,
                      "prompt": scene_description(int(scene)) if scene.isdigit() else "",
                      "lat_offset": lat_off, "latents": int(lr.shape[0]), "frame_offset": frame_off,
                      "frames": usable, "wave_offset": wave_off, "samples": samples})
        lat_off += lr.shape[0]
        frame_off += usable
        wave_off += samples
    if not clips:
        raise InputError(f"--footage {footage.root}: no clip with at least 5 frames")
    tensors = {"lr": torch.cat(lr_l), "hr": torch.cat(hr_l), "wave": torch.cat(waves), "frames": torch.cat(tables)}
    tensors.update({f"vae.{k}": v.detach().cpu().contiguous() for k, v in vae.state_dict().items()})
    meta = {"version": PREPARED_VERSION, "lr_size": lr_size, "hr_size": hr_size, "fps": 25,
            "sample_rate": SAMPLE_RATE, "frame_keys": list(FRAME_KEYS), "clips": clips,
            "stats": {"folded": False}, "source": str(footage.root), "measured_motion": measured,
            "vae": "vae.* = the base model's VAE as it is"}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"avatarstream": json.dumps(meta)})
    tmp.replace(out)
    return {"clips": len(clips), "seconds": round(frame_off / 25, 2), "measured_motion": measured}


class FootageData(PreparedData):
    """A prepared footage file whose references come from the footage's pairs: `other_scene(i)`
    draws among the clips paired with target i (by key)."""

    def __init__(self, path: str | Path, footage: Footage) -> None:
        super().__init__(path)
        at = {c["key"]: j for j, c in enumerate(self.clips)}
        self.refs: dict[int, list[int]] = {}
        for r, t in footage.pairs:
            kr, kt = footage.keys[r], footage.keys[t]
            if kr in at and kt in at:
                self.refs.setdefault(at[kt], []).append(at[kr])
        self.measured_motion = bool(self.meta.get("measured_motion", False))

    def usable(self, length: int) -> list[int]:
        return [i for i in super().usable(length) if i in self.refs]

    def other_scene(self, i: int, g: torch.Generator) -> tuple[int, bool]:
        cands = self.refs[i]
        return cands[int(torch.randint(len(cands), (1,), generator=g))], True
