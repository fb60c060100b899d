"""AppearanceAnchorStage: the global appearance anchor of Avatar V (prefix strategy).

After the first chunk, its last emitted frame joins the reference context of both the DiT and the
refiner as one extra reference frame, so every later chunk attends to how the avatar actually
looked at the start of this video (not only to the reference). Runs once per session.
"""

from __future__ import annotations

import torch

from avatarstream.engine.module import Module
from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage


class AppearanceAnchorStage(Stage):
    name = "appearance_anchor"
    reads = ("lr_latents", "hr_latents")
    writes = ()

    def __init__(self, dit: Module, refiner: Module | None, *, enabled: bool, ref_t_position: float) -> None:
        super().__init__()
        self.dit, self.refiner, self.enabled, self.ref_t_position = dit, refiner, enabled, ref_t_position

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        if not self.enabled or state.anchor_added or rec.plan.id != 0:
            return
        e1 = rec.plan.emit[1]
        lr = rec.lr_latents[:, :, e1 - 1 : e1]  # [1, C, 1, h, w]
        hr = rec.hr_latents[:, :, -1:]  # [1, C, 1, H, W]
        t_pos = torch.full((1,), self.ref_t_position)
        state.dit_reference = state.dit_reference.concat(
            self.dit.call("encode_reference", lr, None, t_pos))
        if self.refiner is not None:
            state.refiner_reference = state.refiner_reference.concat(
                self.refiner.call("encode_reference", hr, None, t_pos))
        state.anchor_added = True
