"""Checkpoint surgery: weights of one DiT shape moved onto another before training starts.

`lift_patch_state` starts an output-resolution (`direct`) DiT from an LR DiT's weights; the
loader (`train/checkpoints.py load_init`) applies it. Training-time only: nothing at inference
reshapes weights.
"""

from __future__ import annotations

import torch

PATCH_KEYS = ("patch_embedding.weight", "anchor_embedding.weight")  # conv [D, C, 1, ph, pw]
HEAD_KEYS = ("head.head.weight", "head.head.bias")  # rows ordered (ph, pw, C) (the DiT's unpatchify)


def lift_patch_state(state: dict[str, torch.Tensor], shapes: dict[str, torch.Size]
                     ) -> dict[str, torch.Tensor]:
    """Weights of a DiT with spatial patch p moved to a DiT with patch k·p (same width and
    depth; `shapes`: the new net's parameter shapes), so that on latents k× the size

        new(nearest_upsample_k(x)) == nearest_upsample_k(old(x))

    exactly: the patch and anchor embeddings spread each old tap over its k×k block at 1/k²
    (a k×k block of equal values embeds as the old single value did), the head repeats each
    old output over its block. With k·p patches the token count per frame is the old one's at
    k× the resolution, so a DiT trained on the LR latents starts on the HR latents as itself
    applied to the pooled picture (tests/test_surgery.py proves the identity). Other keys pass
    through; a shape no rule explains is left for the loader to report."""
    out = dict(state)
    for key in PATCH_KEYS:
        if key in state and key in shapes and state[key].shape != shapes[key]:
            w = state[key]  # [D, C, 1, p, p]
            k = shapes[key][-1] // w.shape[-1]
            if k * w.shape[-1] == shapes[key][-1] and w.shape[:3] == shapes[key][:3]:
                out[key] = w.repeat_interleave(k, -2).repeat_interleave(k, -1) / (k * k)
    for key in HEAD_KEYS:
        if key in state and key in shapes and state[key].shape != shapes[key]:
            w = state[key]  # [p*p*C, ...]
            p2, n2 = w.shape[0], shapes[key][0]
            pk = PATCH_KEYS[0]
            if pk not in state or pk not in shapes:
                continue
            c = state[pk].shape[1]
            p, q = state[pk].shape[-1], shapes[pk][-1]
            if q % p or p * p * c != p2 or q * q * c != n2:
                continue
            k = q // p
            w = w.reshape(p, p, c, *w.shape[1:])
            out[key] = w.repeat_interleave(k, 0).repeat_interleave(k, 1).reshape(n2, *w.shape[3:])
    return out
