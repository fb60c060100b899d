"""Sizes of LiveAvatar's DiT (Wan2.2-S2V-14B run block-causally, `CausalWanModel_S2V`).

The fields named like the official constructor's keyword arguments take them as they are
(`from_official` reads a `config.json` or a parity fixture's `config`); the few fields after them
are constants the official code hard-codes, named here so nothing in the model is a literal.
Defaults are the released 14B model (`full()`); `tiny()` is the parity fixtures' size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# What the official constructor takes when a config.json leaves a key out (diffusers does not
# save `patch_size`, `cross_attn_norm`, `qk_norm`, `text_dim` or `window_size`).
OFFICIAL_DEFAULTS: dict[str, Any] = {
    "cross_attn_type": "t2v_cross_attn", "cond_dim": 0, "audio_dim": 5120, "num_audio_token": 4,
    "enable_adain": False, "adain_mode": "attn_norm", "audio_inject_layers": [0, 4, 8, 12, 16, 20, 24, 27],
    "zero_init": False, "zero_timestep": False, "enable_motioner": True, "add_last_motion": True,
    "enable_tsm": False, "trainable_token_pos_emb": False, "motion_token_num": 1024,
    "enable_framepack": False, "framepack_drop_mode": "drop", "model_type": "s2v",
    "patch_size": [1, 2, 2], "text_len": 512, "in_dim": 16, "dim": 2048, "ffn_dim": 8192,
    "freq_dim": 256, "text_dim": 4096, "out_dim": 16, "num_heads": 16, "num_layers": 32,
    "window_size": [-1, -1], "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6,
    "slide_motion_frames": False, "local_attn_size": -1,
}


@dataclass(frozen=True, kw_only=True)
class LiveAvatarConfig:
    """Official kwargs (defaults: Wan2.2-S2V-14B as LiveAvatar runs it) plus hard-coded constants."""

    # -- the official constructor's kwargs, alphabetical as a config.json lists them ------------
    adain_mode: str = "attn_norm"
    add_last_motion: bool = True
    audio_dim: int = 1024  # wav2vec2 width
    audio_inject_layers: tuple[int, ...] = (0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39)
    cond_dim: int = 16  # pose latents; 0: no `cond_encoder`
    cross_attn_norm: bool = True
    cross_attn_type: str = "t2v_cross_attn"
    dim: int = 5120
    enable_adain: bool = True  # the global audio token modulates the injector's input
    enable_framepack: bool = True
    enable_motioner: bool = False
    enable_tsm: bool = False
    eps: float = 1e-6
    ffn_dim: int = 13824
    framepack_drop_mode: str = "padd"
    freq_dim: int = 256
    in_dim: int = 16
    local_attn_size: int = -1
    model_type: str = "s2v"
    motion_token_num: int = 1024
    num_audio_token: int = 4  # local audio tokens per latent frame (plus one learned padding token)
    num_heads: int = 40
    num_layers: int = 40
    out_dim: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)
    qk_norm: bool = True
    slide_motion_frames: bool = False
    text_dim: int = 4096
    text_len: int = 512
    trainable_token_pos_emb: bool = False
    window_size: tuple[int, int] = (-1, -1)
    zero_init: bool = True
    zero_timestep: bool = True  # conditioning tokens get t = 0 modulation
    # -- constants of the official code (not constructor arguments) -----------------------------
    audio_layers: int = 25  # wav2vec2 hidden states mixed by `casual_audio_encoder.weights`
    ref_time: int = 30  # the reference latent's RoPE time at placement 0
    motion_frames: int = 73  # video frames of audio left-padding per block (pipeline `motion_frames`)
    framepack_buckets: tuple[int, int, int] = (1, 2, 16)  # latents at 1x, 2x, 4x compression, newest first
    rope_theta: float = 10000.0
    rope_fp16: bool = True  # round RoPE cos/sin to fp16, as the official complex32 table does

    def __post_init__(self) -> None:
        for name in ("patch_size", "window_size", "audio_inject_layers", "framepack_buckets"):
            object.__setattr__(self, name, tuple(int(v) for v in getattr(self, name)))
        unsupported = {
            "model_type": self.model_type == "s2v", "enable_motioner": not self.enable_motioner,
            "enable_framepack": self.enable_framepack, "zero_timestep": self.zero_timestep,
            "enable_adain": self.enable_adain, "adain_mode": self.adain_mode == "attn_norm",
            "qk_norm": self.qk_norm, "cross_attn_norm": self.cross_attn_norm,
            "window_size": self.window_size == (-1, -1), "local_attn_size": self.local_attn_size == -1,
            "add_last_motion": self.add_last_motion, "slide_motion_frames": not self.slide_motion_frames,
        }
        bad = [k for k, ok in unsupported.items() if not ok]
        if bad:  # the official streaming forward asserts on these, or they select unused paths
            raise ValueError(f"LiveAvatar DiT: unsupported setting(s) {', '.join(bad)} "
                             f"({', '.join(f'{k}={getattr(self, k)!r}' for k in bad)})")
        if self.dim % self.num_heads or self.head_dim % 2:
            raise ValueError(f"dim {self.dim} does not split into {self.num_heads} even-width heads")
        if self.patch_size[0] != 1:
            raise ValueError("temporal patch size must be 1 (modulation and audio are per latent frame)")
        if self.dim % 4:
            raise ValueError(f"dim {self.dim}: the audio encoder needs a multiple of 4")
        layers = sorted(set(self.audio_inject_layers))
        if layers != list(self.audio_inject_layers) or not all(0 <= i < self.num_layers for i in layers):
            raise ValueError(f"audio_inject_layers {self.audio_inject_layers}: sorted, distinct, "
                             f"below num_layers {self.num_layers}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def motion_latents(self) -> int:
        """Latent frames the padding makes, dropped from the encoded audio: (73 + 3) // 4 = 19."""
        return (self.motion_frames + 3) // 4

    @classmethod
    def full(cls) -> LiveAvatarConfig:
        """Wan2.2-S2V-14B: width 5120, 40 layers × 40 heads, 12 audio injectors (16.296 B parameters)."""
        return cls()

    @classmethod
    def tiny(cls) -> LiveAvatarConfig:
        """The golden fixture's size: width 64, 2 heads, 2 layers, text 32 → 64 over 16 tokens."""
        return cls(dim=64, num_heads=2, num_layers=2, ffn_dim=128, text_dim=32, text_len=16,
                   audio_dim=16, audio_inject_layers=(0, 1))

    @classmethod
    def from_official(cls, kwargs: dict[str, Any]) -> LiveAvatarConfig:
        """The official constructor's kwargs (a `config.json`, a fixture's `config`). Keys it
        leaves out take the official constructor's defaults, not the 14B ones; keys the
        constructor does not know (diffusers' `_class_name`, ...) are ignored, as it ignores them."""
        names = {f.name for f in dataclasses.fields(cls)}
        merged = {**OFFICIAL_DEFAULTS, **{k: v for k, v in kwargs.items() if k in OFFICIAL_DEFAULTS}}
        return cls(**{k: v for k, v in merged.items() if k in names})
