"""ModelSpec: what one model is before anything is built — the five networks' configs, the
pipeline defaults and, for a trained model, the weights folder and how to read it.

A spec is cheap: configs are factories, nothing is built or read until `networks()` (fresh
networks at the spec's sizes) or the registry's `load_model` (networks + weights + modules).
The pipeline presets live here because both sides of a weights folder need them: the reader
(today's preset under what config.json chose) and `train export` (what it writes).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from avatarstream.engine.config import ModelSet, PipelineConfig
from avatarstream.models.audio import AudioConfig, AudioEncoder
from avatarstream.models.dit import DiTConfig, VideoRefDiT
from avatarstream.models.refiner import RefinerConfig, SRRefiner
from avatarstream.models.text import TextConfig, TextEncoder
from avatarstream.models.vae import CausalVAE, VAEConfig
from avatarstream.weights.adapters import NATIVE, StateDictAdapter


@dataclass(frozen=True)
class ModelSpec:
    name: str
    dit: Callable[[], DiTConfig]
    refiner: Callable[[], RefinerConfig] | None  # None: a direct model (DiT at the output size)
    vae: Callable[[], VAEConfig]
    audio: Callable[[], AudioConfig]
    text: Callable[[], TextConfig]
    pipeline: Callable[[], PipelineConfig]
    weights: Path | None = None  # folder with dit/(refiner)/vae/audio/text .safetensors
    seed: int = 0
    description: str = ""
    adapter: StateDictAdapter = NATIVE  # how `weights` maps onto the networks
    # a family that builds its own ModelSet (an official folder: weights/flashhead_folder.py):
    # load(device, bf16) -> ModelSet, used by the registry's `load_model` instead of `networks()`
    load: Callable[[str, bool | None], ModelSet] | None = None

    def __post_init__(self) -> None:
        if self.load is None and not isinstance(self.pipeline, _NetworkGeometry):
            object.__setattr__(self, "pipeline", _NetworkGeometry(self.pipeline, self.dit, self.refiner))

    def networks(self) -> dict[str, nn.Module | None]:
        """Fresh networks at the spec's sizes (PyTorch's default init, drawn from the global RNG
        in this order: dit, refiner, vae, audio, text); "refiner" is None for a direct model."""
        return {
            "dit": VideoRefDiT(self.dit()),
            "refiner": None if self.refiner is None else SRRefiner(self.refiner()),
            "vae": CausalVAE(self.vae()),
            "audio": AudioEncoder(self.audio()),
            "text": TextEncoder(self.text()),
        }


@dataclass(frozen=True)
class _NetworkGeometry:
    """A spec's `pipeline()`, with the patch sizes of its DiT and refiner: what each side of
    `--size` must be a multiple of is theirs (`PipelineConfig.pixel_multiple`), not a preset's."""

    preset: Callable[[], PipelineConfig]
    dit: Callable[[], DiTConfig]
    refiner: Callable[[], RefinerConfig] | None

    def __call__(self) -> PipelineConfig:
        refiner = 1 if self.refiner is None else math.lcm(*self.refiner().patch[1:])
        return dataclasses.replace(self.preset(), patch_size=math.lcm(*self.dit().patch[1:]),
                                   refiner_patch=refiner)


def tiny_pipeline() -> PipelineConfig:
    return PipelineConfig(lr_size=32, hr_size=64, latent_channels=4, motion_dim=4, chunk=4,
                          ref_frames=4, steps=4, refiner_patch=2)


def small_pipeline() -> PipelineConfig:
    return PipelineConfig(lr_size=128, hr_size=256, latent_channels=16, motion_dim=16, chunk=8,
                          ref_frames=16, steps=4, refiner_patch=2)


def pipeline_preset(model: str) -> Callable[[], PipelineConfig]:
    """The pipeline preset of a model size preset ("tiny" or "small")."""
    return tiny_pipeline if model == "tiny" else small_pipeline
