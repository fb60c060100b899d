"""Training data: synthetic shards -> arrays the recipes sample from.

Two sources:

- **Pixels** (`PixelClips`, the `vae` recipe): clips decoded from `avatarstream synth` shards,
  frames `[F, S, S, 3]` uint8 held in memory, with per-frame face points (mouth centre from the
  annotations, eye centres projected from the annotated head pose; training data only).
- **Prepared file** (`prepare`, `PreparedData`; the `a2v` and `sr` recipes): one safetensors file
  that a GPU machine can take instead of the shards. Per clip it holds the VAE latents (means) of
  the whole clip at LR (`lr_size` px, area-downsampled as the engine's ReferenceStage does) and
  HR (`hr_size` px), the waveform (int16), per-frame annotations (`FRAME_KEYS`) and identity /
  scene ids + a scene description. Latents and annotations are float16. Size per clip
  (`clip_bytes`): `(1 + k) · C · (h² + 4h²) · 2` bytes of latents + `2 · samples` of audio +
  `F · len(FRAME_KEYS) · 2` of annotations; for the small model (C = 16, h = 16) a 4-second
  clip (101 frames, 26 latent frames) is 26·16·1280·2 ≈ 1.06 MB + 128 kB audio + 4 kB ≈ 1.2 MB,
  so ~50 four-second clips (≈ 3.3 minutes of video) fit in 64 MiB. Latents are stored
  normalised per channel (unit scale, what flow matching wants), and the file also holds the VAE
  they were made with, with those statistics folded in (`vae.*`, `train/vae_init.py` `fold_latent_stats`):
  the VAE `train export` bundles, so inference encodes and decodes in the same normalised space.
  A VAE that already has them folded in (an exported model's, a prepared file's) is kept as it is
  (`prepare(fold=False)`), so a model's own latent space is reproduced exactly.

Motion descriptor (`motion_descriptor`, the target of the DiT's motion stream): per latent frame
j, the mean over the video frames it encodes (frame 0 for j = 0, frames 4j−3..4j after) of the
normalised annotations in `MOTION_KEYS` order — mouth open, width, round, head yaw, pitch, roll,
smile, blink, brow, gaze x, gaze y, teeth — each `(v − centre) / scale` (`MOTION_NORM`, ≈ unit
range); truncated or zero-padded to `motion_dim` (tiny: 4 = mouth open/width/round + yaw;
small: 16 = the 12 keys + 4 zeros).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from avatarstream.errors import InputError
from avatarstream.train.vae_init import fold_latent_stats

FRAME_KEYS = ("mouth_open", "mouth_width", "mouth_round", "yaw", "pitch", "roll", "smile", "blink",
              "brow", "gaze_x", "gaze_y", "teeth", "mouth_x", "mouth_y", "eye_rx", "eye_ry",
              "eye_lx", "eye_ly", "speaking")
MOTION_KEYS = ("mouth_open", "mouth_width", "mouth_round", "yaw", "pitch", "roll", "smile", "blink",
               "brow", "gaze_x", "gaze_y", "teeth")
MOTION_NORM = {"mouth_open": (0.3, 0.3), "mouth_width": (0.0, 0.4), "mouth_round": (0.3, 0.3),
               "yaw": (0.0, 2.0), "pitch": (1.0, 2.0), "roll": (0.0, 1.3), "smile": (0.0, 0.3),
               "blink": (0.1, 0.3), "brow": (0.3, 0.3), "gaze_x": (0.0, 0.3), "gaze_y": (0.0, 0.1),
               "teeth": (0.3, 0.3)}
PREPARED_VERSION = 2


# ---------------------------------------------------------------------------------------------
# annotations -> per-frame arrays


def face_points(ann: dict[str, Any]) -> np.ndarray:
    """Per-frame `[F, 6]` float32 pixel coordinates at the clip's size: mouth (x, y), right eye
    (x, y), left eye (x, y). Eyes are projected from the annotated pose with the clip's rig (the
    renderer's own geometry; used for training-loss weights only, never at inference)."""
    from avatarstream.data.features import FaceState
    from avatarstream.data.identity import Identity
    from avatarstream.data.render import AvatarRenderer
    from avatarstream.data.scene import Scene

    pf = ann["per_frame"]
    r = AvatarRenderer(Identity.from_seed(int(ann["identity"])), Scene.from_seed(int(ann["scene"])),
                       int(ann["size"]))
    u, v, z = r.rig.eye
    out = np.zeros((int(ann["frames"]), 6), np.float32)
    for i in range(out.shape[0]):
        pose = r.pose(FaceState(yaw=float(pf["yaw"][i]), pitch=float(pf["pitch"][i]),
                                roll=float(pf["roll"][i])))
        out[i, 0], out[i, 1] = float(pf["mouth_x"][i]), float(pf["mouth_y"][i])
        out[i, 2:4] = pose.project(u, v, z)
        out[i, 4:6] = pose.project(-u, v, z)
    return out


def frame_table(ann: dict[str, Any]) -> np.ndarray:
    """Per-frame annotations `[F, len(FRAME_KEYS)]` float32 (points in pixels at the clip size)."""
    pf = ann["per_frame"]
    pts = face_points(ann)
    cols = []
    for k in FRAME_KEYS:
        if k in ("mouth_x", "mouth_y", "eye_rx", "eye_ry", "eye_lx", "eye_ly"):
            j = {"mouth_x": 0, "mouth_y": 1, "eye_rx": 2, "eye_ry": 3, "eye_lx": 4, "eye_ly": 5}[k]
            cols.append(pts[:, j])
        else:
            cols.append(np.asarray(pf[k], np.float32))
    return np.stack(cols, 1).astype(np.float32)


def scene_description(scene_seed: int) -> str:
    """A short text prompt describing a synthetic scene (background kind, light side, framing)."""
    from avatarstream.data.scene import Scene

    s = Scene.from_seed(int(scene_seed))
    side = "left" if s.light_azimuth < 0 else "right"
    size = "close-up" if s.scale > 1.0 else "medium shot"
    return f"{s.background} background, light from the {side}, {size}"


def motion_descriptor(table: torch.Tensor, positions: torch.Tensor, motion_dim: int) -> torch.Tensor:
    """table `[F, len(FRAME_KEYS)]` per-frame annotations, positions `[T]` latent indices ->
    `[T, motion_dim]` (see the module docstring)."""
    f = table.shape[0]
    cols = [FRAME_KEYS.index(k) for k in MOTION_KEYS]
    centre = torch.tensor([MOTION_NORM[k][0] for k in MOTION_KEYS], dtype=torch.float32)
    scale = torch.tensor([MOTION_NORM[k][1] for k in MOTION_KEYS], dtype=torch.float32)
    norm = (table[:, cols].float() - centre) / scale  # [F, K]
    out = []
    for p in positions.tolist():
        a, b = (0, 1) if p == 0 else (4 * p - 3, 4 * p + 1)
        a, b = min(a, f - 1), min(max(b, a + 1), f)
        out.append(norm[a:b].mean(0))
    d = torch.stack(out)  # [T, K]
    if d.shape[1] >= motion_dim:
        return d[:, :motion_dim].contiguous()
    return F.pad(d, (0, motion_dim - d.shape[1]))


def region_weight(points: torch.Tensor, size: int, *, mouth: float, eyes: float,
                  radius: float) -> torch.Tensor:
    """Loss weight map `[B, T, size, size]` = 1 + mouth·g(mouth) + eyes·(g(eye_r) + g(eye_l)),
    g a Gaussian of std `radius` (pixels of this map) around each point. points `[B, T, 6]` in
    this map's pixel coordinates (x, y pairs: mouth, right eye, left eye)."""
    ax = torch.arange(size, dtype=torch.float32, device=points.device) + 0.5
    w = torch.ones(*points.shape[:2], size, size, device=points.device)
    for j, amp in ((0, mouth), (2, eyes), (4, eyes)):
        if amp == 0:
            continue
        gx = torch.exp(-0.5 * ((ax - points[..., j, None]) / radius) ** 2)  # [B, T, S]
        gy = torch.exp(-0.5 * ((ax - points[..., j + 1, None]) / radius) ** 2)
        w = w + amp * gy[..., :, None] * gx[..., None, :]
    return w


# ---------------------------------------------------------------------------------------------
# pixels (vae recipe)


@dataclass
class PixelClip:
    frames: np.ndarray  # [F, S, S, 3] uint8
    points: np.ndarray  # [F, 6] float32 pixels (mouth, right eye, left eye)
    identity: int
    scene: int
    key: str = ""


def load_pixel_clips(shards: str | Path, max_clips: int | None = None) -> list[PixelClip]:
    """Decode every clip of a synthetic dataset into memory (S² · 3 bytes a frame: ~20 MB for a
    4-second 256 px clip)."""
    from avatarstream.data.shards import ShardReader

    reader = ShardReader(shards)
    clips = []
    for e in reader.entries()[: max_clips or None]:
        rec = reader.load(e)
        if rec.frames.shape[0] < 5:
            continue
        clips.append(PixelClip(rec.frames, face_points(rec.annotations), int(e["identity"]), int(e["scene"]),
                              str(e["key"])))
    if not clips:
        raise InputError(f"{shards}: no clip with at least 5 frames")
    return clips


# ---------------------------------------------------------------------------------------------
# prepared file (a2v / sr recipes)


def clip_bytes(latent_channels: int, lr_latent: int, seconds: float, sample_rate: int = 16000,
               fps: int = 25) -> int:
    """Bytes one clip takes in a prepared file (float16 latents at LR and HR = 2× LR, int16 audio,
    float16 annotations)."""
    frames = int(round(seconds * fps))
    t = 1 + (frames - 1) // 4
    lat = t * latent_channels * (lr_latent ** 2 + (2 * lr_latent) ** 2) * 2
    return lat + 2 * int(round(seconds * sample_rate)) + frames * len(FRAME_KEYS) * 2


@torch.no_grad()
def encode_video(vae: torch.nn.Module, video: torch.Tensor, *, chunk: int = 8) -> torch.Tensor:
    """Whole-clip latent means by streaming encode (bounded memory): video `[1, 3, 1+4k, H, W]`
    -> `[1, C, 1+k, H/8, W/8]` (equal to `vae.encode(video)[0]`)."""
    cache = vae.new_cache("encode")
    outs = [vae.encode_step(video[:, :, :1 + 4 * chunk], cache)[0]]
    for a in range(1 + 4 * chunk, video.shape[2], 4 * chunk):
        outs.append(vae.encode_step(video[:, :, a:a + 4 * chunk], cache)[0])
    return torch.cat(outs, 2)


def prepare(shards: str | Path, vae: torch.nn.Module, out: str | Path, *, lr_size: int, hr_size: int,
            max_clips: int | None = None, device: str = "cpu", progress: bool = False,
            fold: bool = True) -> dict[str, Any]:
    """Pre-encode a synthetic dataset into one training file (see the module docstring).

    fold=False: `vae` already has latent statistics folded in (an exported model's VAE, or a
    prepared file's): it is stored as it is and the latents as it encodes them, so a DiT trained
    on the file works in exactly the latent space of the model the VAE came from (folding again
    would shift it by the new statistics' small departure from 0 and 1). The statistics are still
    measured and recorded.

    Returns a summary (clips, bytes, bytes per clip, seconds, latent statistics)."""
    from safetensors.torch import save_file

    from avatarstream.data.shards import ShardReader

    reader = ShardReader(shards)
    entries = reader.entries()[: max_clips or None]
    vae = vae.to(device).eval()
    lr_l, hr_l, waves, tables, clips = [], [], [], [], []
    lat_off = frame_off = wave_off = 0
    it = entries
    if progress:
        from tqdm import tqdm
        it = tqdm(entries, desc="encoding clips", unit="clip")
    for e in it:
        rec = reader.load(e)
        n = rec.frames.shape[0]
        usable = 1 + 4 * ((n - 1) // 4)
        if usable < 5:
            continue
        if rec.frames.shape[1] != hr_size:
            raise InputError(f"{shards}: clips are {rec.frames.shape[1]} px, the model wants {hr_size} px "
                             f"(make them with `avatarstream synth --size {hr_size}`)")
        video = torch.from_numpy(rec.frames[:usable]).permute(3, 0, 1, 2).float().div(127.5).sub(1.0)
        hr_video = video[None].to(device)  # [1, 3, F, H, W]
        lr_video = F.interpolate(hr_video, size=(usable, lr_size, lr_size), mode="area")
        hr = encode_video(vae, hr_video)[0].permute(1, 0, 2, 3)  # [T, C, H/8, W/8]
        lr = encode_video(vae, lr_video)[0].permute(1, 0, 2, 3)  # [T, C, h/8, w/8]
        table = torch.from_numpy(frame_table(rec.annotations)[:usable])
        samples = int(math.ceil(usable * rec.sample_rate / 25))
        wave = np.zeros(samples, np.float32)
        wave[: min(samples, rec.audio.shape[0])] = rec.audio[:samples]
        wave_i16 = torch.from_numpy(np.clip(np.round(wave * 32767), -32768, 32767).astype(np.int16))
        lr_l.append(lr.half().cpu())
        hr_l.append(hr.half().cpu())
        tables.append(table.half())
        waves.append(wave_i16)
        clips.append({"key": e["key"], "identity": int(e["identity"]), "scene": int(e["scene"]),
                      "prompt": scene_description(int(e["scene"])), "lat_offset": lat_off,
                      "latents": int(lr.shape[0]), "frame_offset": frame_off, "frames": usable,
                      "wave_offset": wave_off, "samples": samples})
        lat_off += lr.shape[0]
        frame_off += usable
        wave_off += samples
    if not clips:
        raise InputError(f"{shards}: no clip with at least 5 frames")
    lr_raw, hr_raw = torch.cat(lr_l).float(), torch.cat(hr_l).float()
    # Per-channel statistics of the raw latents (LR and HR pooled: one VAE, one latent space),
    # folded into the VAE so that its latents are unit-scale from here on (`fold_latent_stats`).
    both = torch.cat([lr_raw.transpose(0, 1).flatten(1), hr_raw.transpose(0, 1).flatten(1)], 1)
    mean, std = both.mean(1), both.std(1).clamp_min(1e-3)
    folded = copy.deepcopy(vae).cpu().float()
    if fold:
        fold_latent_stats(folded, mean, std)
    else:
        measured = mean, std
        mean, std = torch.zeros_like(mean), torch.ones_like(std)

    def norm(t: torch.Tensor) -> torch.Tensor:
        return ((t - mean[None, :, None, None]) / std[None, :, None, None]).half()

    tensors = {"lr": norm(lr_raw), "hr": norm(hr_raw), "wave": torch.cat(waves),
               "frames": torch.cat(tables)}
    tensors.update({f"vae.{k}": v.detach().contiguous() for k, v in folded.state_dict().items()})
    lrf = tensors["lr"].float()
    stats = {"lr_mean": round(float(lrf.mean()), 4), "lr_std": round(float(lrf.std()), 4),
             "hr_std": round(float(tensors["hr"].float().std()), 4),
             "raw_std": round(float(both.std()), 4),
             "channel_mean": [round(float(v), 4) for v in (mean if fold else measured[0])],
             "channel_std": [round(float(v), 4) for v in (std if fold else measured[1])],
             "folded": fold}
    meta = {"version": PREPARED_VERSION, "lr_size": lr_size, "hr_size": hr_size, "fps": 25,
            "sample_rate": 16000, "frame_keys": list(FRAME_KEYS), "clips": clips, "stats": stats,
            "source": str(shards),
            "vae": ("vae.* = the encoding VAE with the latent statistics folded in" if fold else
                    "vae.* = the encoding VAE as given (its latent statistics were already folded in)")}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"avatarstream": json.dumps(meta)})
    tmp.replace(out)
    size = out.stat().st_size
    seconds = sum(c["frames"] for c in clips) / 25
    return {"out": str(out), "clips": len(clips), "bytes": size, "bytes_per_clip": size // len(clips),
            "bytes_per_second": int(size / seconds), "seconds": round(seconds, 2),
            "identities": len({c["identity"] for c in clips}),
            **{k: v for k, v in stats.items() if not k.startswith("channel_")}}


class PreparedData:
    """A prepared file in memory. Latents as float32 `lr [N, C, h, w]`, `hr [N, C, H, W]` (all
    clips' latent frames concatenated), `wave [S]` float32, `frames [Nf, K]` float32 and `clips`
    (offset table). `other_scene(i, g)` picks a clip of the same identity in another scene."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = Path(path)
        if not path.is_file():
            raise InputError(f"no prepared training file at {path} (make it with `avatarstream train prepare`)")
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("avatarstream", "{}"))
        if meta.get("version") != PREPARED_VERSION:
            raise InputError(f"{path} is not a prepared training file of version {PREPARED_VERSION}")
        t = load_file(str(path))
        self.vae_state = {k[4:]: v for k, v in t.items() if k.startswith("vae.")}
        self.meta = meta
        self.clips: list[dict[str, Any]] = meta["clips"]
        self.lr = t["lr"].float()
        self.hr = t["hr"].float()
        self.wave = t["wave"].float() / 32768.0
        self.frames = t["frames"].float()
        self.lr_size, self.hr_size = int(meta["lr_size"]), int(meta["hr_size"])
        by_id: dict[int, list[int]] = {}
        for i, c in enumerate(self.clips):
            by_id.setdefault(c["identity"], []).append(i)
        self._by_id = by_id

    def use_hr_as_lr(self) -> None:
        """Serve the HR latents where the LR ones are asked for (a `direct` DiT's data)."""
        self.lr, self.lr_size = self.hr, self.hr_size

    @property
    def latent_channels(self) -> int:
        return int(self.lr.shape[1])

    def usable(self, length: int) -> list[int]:
        """Clips with at least `length` latent frames."""
        return [i for i, c in enumerate(self.clips) if c["latents"] >= length]

    def other_scene(self, i: int, g: torch.Generator) -> tuple[int, bool]:
        """(clip index, cross-scene?) of a reference clip for clip i: same identity, another scene
        when the data has one (else clip i itself)."""
        c = self.clips[i]
        cands = [j for j in self._by_id[c["identity"]] if self.clips[j]["scene"] != c["scene"]]
        if not cands:
            return i, False
        return cands[int(torch.randint(len(cands), (1,), generator=g))], True

    def latents(self, i: int, start: int, length: int, hr: bool = False) -> torch.Tensor:
        """`[C, length, h, w]` latent frames [start, start+length) of clip i (LR or HR)."""
        c = self.clips[i]
        src = self.hr if hr else self.lr
        a = c["lat_offset"] + start
        return src[a:a + length].permute(1, 0, 2, 3)

    def table(self, i: int) -> torch.Tensor:
        """Per-frame annotations `[F, K]` of clip i."""
        c = self.clips[i]
        return self.frames[c["frame_offset"]:c["frame_offset"] + c["frames"]]

    def wave_of(self, i: int) -> torch.Tensor:
        """`[N]` float32 waveform of clip i."""
        c = self.clips[i]
        return self.wave[c["wave_offset"]:c["wave_offset"] + c["samples"]]
