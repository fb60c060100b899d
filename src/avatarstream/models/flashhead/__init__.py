"""SoulX-FlashHead-1.3B (Pro and Lite): the DiT and its audio projection. Loading the official
checkpoints: `avatarstream.weights.flashhead`."""

from avatarstream.models.flashhead.audio_proj import AudioProjConfig, AudioProjection, latent_windows
from avatarstream.models.flashhead.dit import FlashHeadBlock, FlashHeadConfig, FlashHeadDiT

__all__ = ["AudioProjConfig", "AudioProjection", "FlashHeadBlock", "FlashHeadConfig", "FlashHeadDiT",
           "latent_windows"]
