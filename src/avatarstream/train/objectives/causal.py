"""The shared base of the causal student's objectives (Live Avatar sec. 4.2): diffusion forcing
(`diffusion_forcing.py`) and Self-Forcing DMD (`self_forcing_dmd.py`) both train on windows of
`chunk` latent frames cut into blocks of `block`, each block attending to itself, the previous
`history` blocks and the sink: the reference placed as the engine places it (Rolling RoPE:
`ref_t_position` before the first frame of the block's attention window).
"""

from __future__ import annotations

from typing import Any

import torch

from avatarstream.errors import ConfigError
from avatarstream.train.data import motion_descriptor
from avatarstream.train.objectives.latent import LatentTask


def guidance_scales(value: Any, key: str) -> tuple[float, float] | None:
    """A recipe's guidance list: [] -> None, [audio, reference] -> a pair of scales >= 0."""
    if value in ([], None):
        return None
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in value)):
        raise ConfigError(f"{key} must be [] or [audio_scale, ref_scale] (two numbers >= 0), got {value!r}")
    return float(value[0]), float(value[1])


def sink_positions(blocks: int, block: int, history: int, ref_t: float, rolling: bool) -> list[float]:
    """Temporal RoPE position of the sink for each block (Rolling RoPE: `ref_t` before the first
    frame of the block's attention window; without it: `ref_t`)."""
    return [(max(0, a - history) * block if rolling else 0) + ref_t for a in range(blocks)]


class CausalTask(LatentTask):
    """Shared by df and dmd: windows of whole blocks and their conditions."""

    def __init__(self, recipe: dict[str, Any], device: torch.device) -> None:
        super().__init__(recipe, device)
        c = self.cfg
        if c["block"] < 1 or self.T % c["block"]:
            raise ConfigError(f"{self.stage}: chunk ({self.T}) must be a whole number of blocks of {c['block']}")
        if c["history"] < 0:
            raise ConfigError(f"{self.stage}: history must be >= 0")
        self.blocks = self.T // c["block"]
        self.guidance = guidance_scales(c["guidance"], f"{self.stage}.guidance")

    def uses(self) -> tuple[str, ...]:
        return ("dit", "audio", "text")

    def conditions(self, g: torch.Generator) -> dict[str, Any]:
        """Windows, latents `x0 [B,C,T,h,w]`, motion `m0 [B,T,Dm]`, audio / text tokens, reference
        latents `[B,C,R,h,w]` and validity `[B,R]` (cross-scene with p_cross_scene)."""
        c, B, T = self.cfg, self.recipe["train"]["batch"], self.T
        clips, starts, x0, m0, refs, valids = [], [], [], [], [], []
        for _ in range(B):
            i, p0 = self.window(g)
            clips.append(i)
            starts.append(p0)
            x0.append(self.data.latents(i, p0, T))
            m0.append(motion_descriptor(self.data.table(i), torch.arange(p0, p0 + T), self.motion_dim))
            lat, valid, _, _ = self.reference(g, i, hr=False, p_cross=c["p_cross_scene"])
            refs.append(lat)
            valids.append(valid)
        b: dict[str, Any] = {"clips": clips, "starts": starts}
        b["x0"] = torch.stack(x0).to(self.device)
        b["m0"] = torch.stack(m0).to(self.device)
        with torch.no_grad():
            b["audio"] = self.audio_tokens(self.nets["audio"], clips, starts, torch.zeros(B, dtype=torch.bool))
            b["text"], b["text_mask"] = self.text_tokens(self.nets["text"], g, clips)
        b["ref_lat"] = torch.stack(refs).to(self.device)
        b["ref_valid"] = torch.stack(valids).to(self.device)
        b["anchor"] = self.scene_anchor(clips)
        return b

    def sink_index(self) -> tuple[list[float], list[int]]:
        """Distinct sink positions and, per block, which one it uses."""
        c = self.cfg
        pos = sink_positions(self.blocks, c["block"], c["history"], c["ref_t_position"], c["rolling_rope"])
        distinct = sorted(set(pos), key=pos.index)
        return distinct, [distinct.index(p) for p in pos]
