"""The LTX-Video 0.9 VAE (FlashHead Lite's): whole-chunk decode, deterministic encode.

`LTXVideoVAE` and its `LTXVAEConfig` are in `vae.py`, its layers in `blocks.py`. Loading an
official checkpoint (diffusers names on disk, or the LTX repository's own names) is
`weights/ltx.py:load_ltx_vae`.
"""

from avatarstream.models.ltx.vae import LTXVAEConfig, LTXVideoVAE

__all__ = ["LTXVAEConfig", "LTXVideoVAE"]
