"""Networks of the Wan family under their official state-dict keys (checkpoints load unchanged).

- `vae.py`: the Wan2.1 video VAE (`WanVAE`, `WanVAEConfig`), with whole and streaming decode
  behind the protocol of our own `models/vae.py:CausalVAE`; its layers are in `vae_blocks.py`.

Loading a checkpoint (key mapping, meta-device build) is not done here: models import no weights
code; see `weights/wan.py:load_wan_vae`.
"""
