"""Parity of the umT5 text encoder (family `umt5`): Wan2.2's `T5Encoder` + `T5EncoderModel` trim.

The fixture holds a tiny Wan umT5 encoder under the official keys, padded token ids with their mask
(`inputs.ids`, `inputs.mask` `[B, text_len]`) and what `T5EncoderModel.__call__` returned: each
sequence's output trimmed to its true length, stacked here zero-padded back to text_len
(`expected.context` `[B, text_len, dim]`). The weights go through `weights/umt5.load_umt5`, the
loader the real `.pth` takes, and each sequence runs as `encode-text` runs a prompt: its true
tokens alone, no padding and no mask.
"""

from __future__ import annotations

import torch

from avatarstream.errors import InputError
from avatarstream.parity.fixture import Fixture
from avatarstream.weights.umt5 import encode_ids, load_umt5


def run(fx: Fixture) -> dict[str, torch.Tensor]:
    """Our `context` for the fixture's sequences `[B, text_len, dim]`, zero past each true length."""
    if "ids" not in fx.inputs or "mask" not in fx.inputs:
        raise InputError(f"{fx.path}: a umt5 fixture needs inputs.ids and inputs.mask")
    model = load_umt5(fx.weights, fx.config, what=f"{fx.path} weights", dtype=torch.float32)
    ids, mask = fx.inputs["ids"].long(), fx.inputs["mask"] > 0  # [B, T]
    out = torch.zeros(*ids.shape, int(fx.config["dim"]))  # [B, T, dim]
    for row, (seq, valid) in enumerate(zip(ids, mask)):
        n = int(valid.sum())
        out[row, :n] = encode_ids(model, seq[:n]).float()
    return {"context": out}
