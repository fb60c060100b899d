"""Model names -> a ModelSet the engine can run.

- `tiny-random`: every network at its tiny() size with fixed random weights (seeded). How the
  engine is tested and benchmarked without trained weights; seconds on a CPU.
- `small-random`: the small() sizes (what we train and bundle), random weights: the real cost of
  the chunk loop at 256x256.
Trained models (safetensors + model card under `weights/NAME/`) are added to MODELS as they land.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from avatarstream.engine.module import Module
from avatarstream.engine.pipeline import ModelSet, PipelineConfig
from avatarstream.errors import ConfigError
from avatarstream.hardware import bf16_is_fast
from avatarstream.models.audio import AudioConfig, AudioEncoder, StreamingAudioFeatures
from avatarstream.models.dit import DiTConfig, VideoRefDiT
from avatarstream.models.refiner import RefinerConfig, SRRefiner
from avatarstream.models.text import TextConfig, TextEncoder
from avatarstream.models.vae import CausalVAE, VAEConfig


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


def _tiny_pipeline() -> PipelineConfig:
    return PipelineConfig(lr_size=32, hr_size=64, latent_channels=4, motion_dim=4, chunk=4,
                          ref_frames=4, steps=4)


def _small_pipeline() -> PipelineConfig:
    return PipelineConfig(lr_size=128, hr_size=256, latent_channels=16, motion_dim=16, chunk=8,
                          ref_frames=16, steps=4)


MODELS: dict[str, ModelSpec] = {
    "tiny-random": ModelSpec("tiny-random", DiTConfig.tiny, RefinerConfig.tiny, VAEConfig.tiny,
                             AudioConfig.tiny, TextConfig.tiny, _tiny_pipeline,
                             description="tiny() networks, fixed random weights (engine tests)"),
    "small-random": ModelSpec("small-random", DiTConfig.small, RefinerConfig.small, VAEConfig.small,
                              AudioConfig.small, TextConfig.small, _small_pipeline,
                              description="small() networks, random weights (real cost, no quality)"),
}


WEIGHTS_DIR = Path(__file__).parent / "weights"
BUNDLED = "avatarstream-small"


def _register_bundled() -> None:
    """Every exported folder under avatarstream/weights/ (config.json + five .safetensors) is a
    model named after its folder."""
    if not WEIGHTS_DIR.is_dir():
        return
    from avatarstream.train.export import model_spec

    for cfg in sorted(WEIGHTS_DIR.glob("*/config.json")):
        spec = model_spec(cfg.parent)
        card = cfg.parent / "README.md"
        MODELS[spec.name] = dataclasses.replace(
            spec, description=f"trained, bundled (model card: {card})" if card.is_file() else spec.description)


_register_bundled()
# The default of `generate`, `serve` and the benchmarks: the bundled trained model once it ships.
DEFAULT_MODEL = BUNDLED if BUNDLED in MODELS else "tiny-random"
# The default of the causal benchmarks (`bench drift`, `bench tpp`, the causal column of `bench
# strategies`): the bundled causal student once it ships (its default strategy is `causal`).
BUNDLED_CAUSAL = BUNDLED + "-causal"
DEFAULT_CAUSAL_MODEL = BUNDLED_CAUSAL if BUNDLED_CAUSAL in MODELS else DEFAULT_MODEL


def available_models() -> list[str]:
    return sorted(MODELS)


def model_spec_for(name: str) -> ModelSpec:
    """The registered model `name`, or a weights folder `train export` wrote (config.json and the
    .safetensors), registered under its path the first time it is asked for."""
    spec = MODELS.get(name)
    if spec is None and (Path(name) / "config.json").is_file():
        from avatarstream.train.export import model_spec

        spec = dataclasses.replace(model_spec(Path(name)), name=name)
        MODELS[name] = spec
    if spec is None:
        raise ConfigError(f"unknown model {name!r}; available: {', '.join(available_models())}, "
                          "or a weights folder made by `avatarstream train export`")
    return spec


def resolve_model(name: str | None, *, causal: bool = False) -> str:
    """A command's --model: the name if it is registered (or a weights folder); when none was
    given DEFAULT_MODEL, or with `causal` (the causal strategy was asked for: `generate
    --strategy causal`, the causal benchmarks) DEFAULT_CAUSAL_MODEL."""
    if name is None:
        name = DEFAULT_CAUSAL_MODEL if causal else DEFAULT_MODEL
    model_spec_for(name)
    return name


def load_model(name: str, *, device: str = "cpu", bf16: bool | None = None) -> ModelSet:
    """Build (and load the weights of) a named model. bf16: autocast the transformers in bf16
    (default: on for the small sizes where bf16 is fast on `device`: 2-3x fp32 on CPUs with
    AVX512-bf16, far slower without; `hardware.bf16_is_fast`)."""
    spec = model_spec_for(name)
    torch.manual_seed(spec.seed)
    nets = {
        "dit": VideoRefDiT(spec.dit()),
        "refiner": None if spec.refiner is None else SRRefiner(spec.refiner()),
        "vae": CausalVAE(spec.vae()),
        "audio": AudioEncoder(spec.audio()),
        "text": TextEncoder(spec.text()),
    }
    if spec.weights is None:
        for net in nets.values():
            if net is not None:
                _randomize(net, spec.seed)
    if bf16 is None:
        bf16 = name != "tiny-random" and bf16_is_fast(device)
    ac = torch.bfloat16 if bf16 else None
    mods = {k: None if v is None else
            Module(k, v, device=device, autocast_dtype=ac if k in ("dit", "refiner", "vae") else None)
            for k, v in nets.items()}
    if spec.weights is not None:
        from avatarstream.train.export import weights_file

        for k, mod in mods.items():
            if mod is not None:
                path = weights_file(spec.weights, k)
                if path is None:
                    raise ConfigError(f"{spec.weights}: no {k}.safetensors (a weights folder made by "
                                      "`avatarstream train export` has one per network)")
                mod.load_safetensors(path)
    audio_model = mods["audio"].model
    return ModelSet(name=name, config=spec.pipeline(),
                    make_audio_stream=lambda: StreamingAudioFeatures(audio_model), **mods)


def _randomize(net: torch.nn.Module, seed: int) -> None:
    """Random weights that make every output depend on its inputs (no zero-initialised heads)."""
    init = getattr(net, "init_random_", None)
    if init is not None:
        init(seed)
