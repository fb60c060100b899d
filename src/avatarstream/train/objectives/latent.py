"""The shared base of the objectives that train on a prepared file's latents (a2v, cfg-distill, sr
and the causal student's df and dmd): windows of latent frames, cross-scene references, the scene
anchor, audio and text conditioning and the mouth/eye loss weights, drawn as the engine will
present them.

Inference contract the latent objectives follow (engine/stages/*.py):
- DiT: latents `[B, C, T, h, w]` at LR, per-frame `sigma [B, T]`, given frames clean with σ = 0,
  motion tokens `[B, T, Dm]` noised with the same σ as their frame, audio tokens
  `[B, T, 4 + 2w, Da]` (`group_per_latent` of the AudioEncoder's per-frame features over the
  clip's timeline positions, zero-extended signal), text tokens of the prompt, chunk RoPE
  positions `arange(T)`, reference = LR latents of the first frames of a reference clip at
  RoPE position −8 (`ref_t_position`) with a validity mask.
- Refiner: `x = (1 − σ) up + σ ε` with `up = upsample2x(lr)`, `x0 = x − σ v`, σ = 0.6, HR
  reference latents, clean motion tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from avatarstream.errors import ConfigError
from avatarstream.models.audio import AudioEncoder, group_per_latent, latent_frame_range
from avatarstream.models.dit import DiTConfig
from avatarstream.models.text import TextEncoder
from avatarstream.train.data import FRAME_KEYS, PreparedData, motion_descriptor, region_weight
from avatarstream.train.nets import GEOMETRY
from avatarstream.train.objectives.base import Task, pick, uniform


def latent_points(table: torch.Tensor, positions: list[int], scale: float) -> torch.Tensor:
    """Mouth/eye points `[T, 6]` of latent frames (mean over their video frames), × scale."""
    cols = [FRAME_KEYS.index(k) for k in ("mouth_x", "mouth_y", "eye_rx", "eye_ry", "eye_lx", "eye_ly")]
    f = table.shape[0]
    out = []
    for p in positions:
        a, b = (0, 1) if p == 0 else (4 * p - 3, 4 * p + 1)
        a, b = min(a, f - 1), min(max(b, a + 1), f)
        out.append(table[a:b, cols].mean(0))
    return torch.stack(out) * scale


class LatentTask(Task):
    """Shared by a2v and sr: prepared data, windows, references, audio/text conditioning."""

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        super().__init__(recipe, device)
        d = recipe["data"]
        if not d["prepared"]:
            raise ConfigError(f"the {self.stage} recipe needs data.prepared (a file made by "
                              "`avatarstream train prepare`)")
        self.data = PreparedData(d["prepared"])
        g = GEOMETRY[recipe["model"]]
        if self.data.lr_size != g["lr_size"] or self.data.hr_size != g["hr_size"]:
            raise ConfigError(f"{d['prepared']} holds {self.data.lr_size}/{self.data.hr_size} px latents; "
                              f"model {recipe['model']} wants {g['lr_size']}/{g['hr_size']}")
        if self.direct:
            self.data.use_hr_as_lr()
        c_model = getattr(DiTConfig, recipe["model"])().in_channels
        if self.data.latent_channels != c_model:
            raise ConfigError(f"{d['prepared']}: {self.data.latent_channels} latent channels, "
                              f"model {recipe['model']} wants {c_model}")
        self.T = self.cfg["chunk"]
        self.clip_ids = self.data.usable(self.T)
        if not self.clip_ids:
            raise ConfigError(f"no clip in {d['prepared']} has {self.T} latent frames (chunk too long)")
        self.motion_dim = getattr(DiTConfig, recipe["model"])().motion_dim

    def window(self, g: torch.Generator) -> tuple[int, int]:
        i = self.clip_ids[pick(g, len(self.clip_ids))]
        return i, pick(g, self.data.clips[i]["latents"] - self.T + 1)

    def reference(self, g: torch.Generator, i: int, hr: bool, p_cross: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
        """Reference of clip i: latents `[C, R, h, w]` of the first R frames of another clip of
        the same identity in another scene (prob p_cross, when one exists; else clip i), a valid
        mask `[R]` keeping a random 1..R prefix, its motion descriptor `[R, Dm]`, cross?"""
        R = self.cfg["ref_frames"]
        j, cross = self.data.other_scene(i, g) if uniform(g) < p_cross else (i, False)
        n = min(R, self.data.clips[j]["latents"])
        keep = 1 + pick(g, n)
        lat = torch.zeros(self.data.latent_channels, R, *self.data.latents(j, 0, 1, hr).shape[-2:])
        lat[:, :n] = self.data.latents(j, 0, n, hr)
        valid = torch.zeros(R, dtype=torch.bool)
        valid[:keep] = True
        mot = torch.zeros(R, self.motion_dim)
        mot[:n] = motion_descriptor(self.data.table(j), torch.arange(n), self.motion_dim)
        return lat, valid, mot, cross

    def scene_anchor(self, clips: list[int]) -> torch.Tensor:
        """`[B, C, h, w]` LR latent of each clip's first frame: the scene frame the engine gives
        the DiT as its anchor (a one-image latent, as the engine encodes the reference's first
        frame or `--scene`), whatever window of the clip is trained."""
        return torch.stack([self.data.latents(i, 0, 1)[:, 0] for i in clips]).to(self.device)

    def audio_tokens(self, audio: AudioEncoder, clips: list[int], starts: list[int], drop: torch.Tensor
                     ) -> torch.Tensor:
        """`[B, T, 4 + 2w, Da]` tokens of latent positions start..start+T−1 of each clip
        (features of the zero-extended waveform, as the engine computes them); rows of `drop`
        (bool `[B]`) zeroed (audio-free condition for CFG)."""
        w = self.cfg["audio_window"]
        out = []
        for i, p0 in zip(clips, starts):
            a = latent_frame_range(p0, w)[0]
            b = latent_frame_range(p0 + self.T - 1, w)[1]
            wave = self.data.wave_of(i)[None].to(self.device)
            feats = audio.frames(wave, a, b)  # [1, b - a, Da]
            out.append(group_per_latent(feats, list(range(p0, p0 + self.T)), w, first_frame=a))
        tok = torch.cat(out)
        return tok * (~drop).to(tok.dtype).to(self.device)[:, None, None, None]

    def text_tokens(self, text: TextEncoder, g: torch.Generator, clips: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        prompts = ["" if uniform(g) < self.cfg["p_empty_text"] else self.data.clips[i]["prompt"] for i in clips]
        return text.encode(prompts)

    def latent_weight(self, clips: list[int], starts: list[int], size: int) -> torch.Tensor:
        """Mouth/eye weight map `[B, 1, T, size, size]` in latent pixels (normalised to mean 1)."""
        scale = size / self.data.hr_size
        pts = torch.stack([latent_points(self.data.table(i), list(range(p0, p0 + self.T)), scale)
                           for i, p0 in zip(clips, starts)])  # [B, T, 6]
        w = region_weight(pts, size, mouth=self.cfg["mouth"], eyes=self.cfg["eyes"],
                          radius=max(0.5, self.cfg["radius"] * size))
        return (w / w.mean()).unsqueeze(1).to(self.device)
