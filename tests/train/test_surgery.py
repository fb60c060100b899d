"""Starting weights of another shape (`train/surgery.py`, `train/checkpoints.py load_init`): the
DiT that starts from them computes what the network they were trained in computed (tiny
configs, fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from avatarstream.models.dit import DiTConfig, VideoRefDiT
from avatarstream.models.transformer import DiTCondition
from avatarstream.train.checkpoints import load_init
from avatarstream.train.surgery import lift_patch_state

B, T, R = 2, 3, 4
TOL = 1e-5


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, DiTCondition]:
    """x `[B, 4, T, 4, 4]`, sigma `[B, T]` (frame 0 given), reference latents, t_pos, condition."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, 4, T, 4, 4, generator=g)
    sigma = torch.rand(B, T, generator=g)
    sigma[:, 0] = 0.0
    ref = torch.randn(B, 4, R, 4, 4, generator=g)
    g = torch.Generator().manual_seed(0)
    cond = DiTCondition(motion=torch.randn(B, T, 4, generator=g), audio=torch.randn(B, T, 6, 16, generator=g),
                        text=torch.randn(B, 5, 16, generator=g),
                        text_mask=torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool),
                        t_pos=torch.arange(T, dtype=torch.float32))
    return x, sigma, ref, torch.full((R,), -8.0), cond


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max())


def test_zero_started_anchor_reproduces_the_model_without_one() -> None:
    """Weights trained before the anchor input load with it at zero (`load_init`): the network
    then computes exactly what the anchor-less network computed."""
    old = VideoRefDiT(dataclasses.replace(DiTConfig.tiny(), anchor=False)).eval()
    old.init_random_(3)
    new = VideoRefDiT(DiTConfig.tiny()).eval()
    new.init_random_(9)
    load_init(new, old.state_dict(), "test")
    x, sigma, ref, tp, cond = _inputs()
    cond.anchor = torch.randn(B, 4, 4, 4)
    with torch.no_grad():
        a = old(x, sigma, cond, old.encode_reference(ref, None, tp))
        b = new(x, sigma, cond, new.encode_reference(ref, None, tp))
    assert _diff(a.velocity, b.velocity) == 0.0 and _diff(a.motion_velocity, b.motion_velocity) == 0.0
    bad = {k: v for k, v in old.state_dict().items() if not k.startswith("head.")}
    with pytest.raises(Exception, match="do not fit"):
        load_init(new, bad, "test")


def test_lifted_patch_dit_is_the_lr_dit_on_the_pooled_picture() -> None:
    """`lift_patch_state`: a DiT with 2x the spatial patch, started from an LR DiT's weights, run
    on 2x nearest-upsampled latents (generation, reference and scene anchor) gives the LR DiT's
    velocity nearest-upsampled and the same motion velocity (tolerance 1e-5): an output-
    resolution (`direct`) DiT starts as the LR DiT it was lifted from."""
    old = VideoRefDiT(DiTConfig.tiny()).eval()
    old.init_random_(0)
    new = VideoRefDiT(dataclasses.replace(DiTConfig.tiny(), patch=(1, 4, 4))).eval()
    shapes = {k: v.shape for k, v in new.state_dict().items()}
    lifted = lift_patch_state(old.state_dict(), shapes)
    assert lifted["patch_embedding.weight"].shape == shapes["patch_embedding.weight"]
    new.load_state_dict(lifted, strict=True)
    x, sigma, ref, t_ref, cond = _inputs()
    anchor = torch.randn(B, 4, 4, 4, generator=torch.Generator().manual_seed(5))

    def up(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(2, -2).repeat_interleave(2, -1)

    with torch.no_grad():
        a = old(x, sigma, dataclasses.replace(cond, anchor=anchor), old.encode_reference(ref, None, t_ref))
        b = new(up(x), sigma, dataclasses.replace(cond, anchor=up(anchor)),
                new.encode_reference(up(ref), None, t_ref))
    assert b.velocity.shape[-1] == 2 * a.velocity.shape[-1]
    assert _diff(b.velocity, up(a.velocity)) <= TOL
    assert _diff(b.motion_velocity, a.motion_velocity) <= TOL
    # not a tautology: a picture that is not blockwise constant gives another answer
    with torch.no_grad():
        c = new(up(x) + 0.5 * torch.randn_like(up(x)), sigma, dataclasses.replace(cond, anchor=up(anchor)),
                new.encode_reference(up(ref), None, t_ref))
    assert _diff(c.velocity, up(a.velocity)) > 1e-2
