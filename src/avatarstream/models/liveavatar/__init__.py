"""LiveAvatar (Wan2.2-S2V-14B + LoRA): the block-causal streaming DiT, its sink and KV rings.

`LiveAvatarDiT(LiveAvatarConfig.full())` has the official checkpoint's keys and shapes; the
stream is `prefill_sink` once, then `forward_block` per block and Euler step, one `KVRing` per step.
"""

from avatarstream.models.liveavatar.blocks import LiveAvatarBlock, TextKV
from avatarstream.models.liveavatar.config import LiveAvatarConfig
from avatarstream.models.liveavatar.dit import AttentionFn, LiveAvatarDiT, sdpa_attention
from avatarstream.models.liveavatar.ring import KVRing
from avatarstream.models.liveavatar.sink import SinkKV, reference_time

__all__ = ["AttentionFn", "KVRing", "LiveAvatarBlock", "LiveAvatarConfig", "LiveAvatarDiT", "SinkKV",
           "TextKV", "reference_time", "sdpa_attention"]
