"""Loading SoulX-FlashHead-1.3B's DiT (`Model_Pro/`, `Model_Lite/`) into `FlashHeadDiT`.

`FLASHHEAD` is the one place the official key names meet ours: the blocks' text-turned-audio
cross-attention is our `audio_attn` (`cross_attn.` -> `audio_attn.`, `norm3.` -> `norm_audio.`),
and the tensors the official forward never reads (`text_embedding.*`, `audio_emb.*`: 12 tensors,
10.4 M parameters in the released files) are dropped by name. Every other key is already ours; any
other difference is an error from `build_loaded` naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from avatarstream.models.flashhead import FlashHeadConfig, FlashHeadDiT
from avatarstream.weights.adapters import KeyRule, StateDictAdapter
from avatarstream.weights.official import build_loaded

FLASHHEAD = StateDictAdapter("flashhead", rules=(
    KeyRule("dit", r"blocks\.(\d+)\.cross_attn\.(.+)", r"blocks.\1.audio_attn.\2"),
    KeyRule("dit", r"blocks\.(\d+)\.norm3\.(.+)", r"blocks.\1.norm_audio.\2"),
    KeyRule("dit", r"text_embedding\..+", None),  # built by the official module, never used
    KeyRule("dit", r"audio_emb\..+", None),  # ditto (an MLP for a 768-wide audio input)
))


def load_flashhead_dit(state: Mapping[str, torch.Tensor], config: FlashHeadConfig, *,
                       dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                       what: str = "FlashHead DiT") -> FlashHeadDiT:
    """The DiT of `config` filled with an official state dict (`read_state` of
    `diffusion_pytorch_model.safetensors`), built on the meta device and assigned in place."""
    ours = FLASHHEAD.state_dict("dit", state)
    net = build_loaded(lambda: FlashHeadDiT(config), ours, what=what, dtype=dtype, device=device)
    return net.eval()  # type: ignore[return-value]
