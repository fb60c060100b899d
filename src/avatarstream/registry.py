"""Model names -> a ModelSet the engine can run.

- `tiny-random`: every network at its tiny() size with fixed random weights (seeded). How the
  engine is tested and benchmarked without trained weights; seconds on a CPU.
- `small-random`: the small() sizes (what we train and bundle), random weights: the real cost of
  the chunk loop at 256x256.
- every bundled weights folder under `avatarstream/weights/` (config.json + the .safetensors),
  named after its folder, and any weights folder `train export` wrote, named by its path.
- `flashhead-pro:DIR`, `flashhead-lite:DIR`: a SoulX-FlashHead-1.3B download in its official
  layout (weights/flashhead_folder.py), which builds its own ModelSet (`ModelSpec.load`).
- `liveavatar:DIR[,context=FILE][,lora=PATH][,wav2vec=PATH]`: a Wan2.2-S2V-14B + LiveAvatar LoRA
  download (weights/liveavatar_model.py), the same way.

Importing this module reads nothing: the bundled folders are found the first time a name is
asked for or the models are listed (`MODELS` scans on first use), and weights are read only by
`load_model`. The folders are read by `avatarstream.weights`, never by the trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, MutableMapping
from pathlib import Path

import torch

from avatarstream.engine.module import Module
from avatarstream.engine.config import ModelSet
from avatarstream.errors import ConfigError
from avatarstream.hardware import bf16_is_fast
from avatarstream.models.audio import AudioConfig, StreamingAudioFeatures
from avatarstream.models.dit import DiTConfig
from avatarstream.models.refiner import RefinerConfig
from avatarstream.models.text import TextConfig
from avatarstream.models.vae import VAEConfig
from avatarstream.weights.folder import load_weights, model_spec
from avatarstream.weights.spec import ModelSpec, small_pipeline, tiny_pipeline

WEIGHTS_DIR = Path(__file__).parent / "weights"
BUNDLED = "avatarstream-small"
# the bundled causal student (its default strategy is `causal`)
BUNDLED_CAUSAL = BUNDLED + "-causal"


class ModelRegistry(MutableMapping[str, ModelSpec]):
    """name -> ModelSpec. The random models are there from the start; the bundled folders (every
    `WEIGHTS_DIR/*/config.json`) are added on first use, so importing the registry costs no
    directory scan and no file read."""

    def __init__(self, specs: dict[str, ModelSpec]) -> None:
        self._specs = dict(specs)
        self._scanned = False

    def _all(self) -> dict[str, ModelSpec]:
        if not self._scanned:  # a folder that fails to read fails every use, as an import once did
            for cfg in sorted(WEIGHTS_DIR.glob("*/config.json")):
                spec = model_spec(cfg.parent)
                card = cfg.parent / "README.md"
                self._specs.setdefault(spec.name, dataclasses.replace(
                    spec, description=f"trained, bundled (model card: {card})" if card.is_file()
                    else spec.description))
            self._scanned = True
        return self._specs

    def __getitem__(self, name: str) -> ModelSpec:
        return self._all()[name]

    def __setitem__(self, name: str, spec: ModelSpec) -> None:
        self._all()[name] = spec

    def __delitem__(self, name: str) -> None:
        del self._all()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())


MODELS = ModelRegistry({
    "tiny-random": ModelSpec("tiny-random", DiTConfig.tiny, RefinerConfig.tiny, VAEConfig.tiny,
                             AudioConfig.tiny, TextConfig.tiny, tiny_pipeline,
                             description="tiny() networks, fixed random weights (engine tests)"),
    "small-random": ModelSpec("small-random", DiTConfig.small, RefinerConfig.small, VAEConfig.small,
                              AudioConfig.small, TextConfig.small, small_pipeline,
                              description="small() networks, random weights (real cost, no quality)"),
})


def default_model(*, causal: bool = False) -> str:
    """The default of `generate`, `serve` and the benchmarks: the bundled trained model if it
    ships, else tiny-random. `causal`: the default of the causal benchmarks (`bench drift`,
    `bench tpp`, the causal column of `bench strategies`) and of `generate --strategy causal`:
    the bundled causal student if it ships, else the plain default."""
    plain = BUNDLED if BUNDLED in MODELS else "tiny-random"
    if causal:
        return BUNDLED_CAUSAL if BUNDLED_CAUSAL in MODELS else plain
    return plain


def available_models() -> list[str]:
    return sorted(MODELS)


def model_spec_for(name: str) -> ModelSpec:
    """The registered model `name`, or a weights folder `train export` wrote (config.json and the
    .safetensors), registered under its path the first time it is asked for, or an official
    download named `flashhead-pro:DIR` / `flashhead-lite:DIR` (weights/flashhead_folder.py) or
    `liveavatar:DIR[,context=FILE]` (weights/liveavatar_model.py)."""
    spec = MODELS.get(name)
    if spec is None and name.startswith("flashhead-"):  # flashhead-pro:DIR, an official download
        from avatarstream.weights.flashhead_folder import flashhead_spec

        spec = flashhead_spec(name)
    if spec is None and name.startswith("liveavatar:"):  # a Wan2.2-S2V-14B + LiveAvatar download
        from avatarstream.weights.liveavatar_model import liveavatar_spec

        spec = liveavatar_spec(name)
    if spec is None and (Path(name) / "config.json").is_file():
        spec = model_spec(Path(name), name=name)
        MODELS[name] = spec
    if spec is None:
        raise ConfigError(f"unknown model {name!r}; available: {', '.join(available_models())}, "
                          "a weights folder made by `avatarstream train export`, or "
                          "flashhead-pro:DIR (a SoulX-FlashHead-1_3B download) or liveavatar:DIR (a "
                          "Wan2.2-S2V-14B + LiveAvatar download)")
    return spec


def resolve_model(name: str | None, *, causal: bool = False) -> str:
    """A command's --model: the name if it is registered (or a weights folder); when none was
    given `default_model(causal=causal)` (`causal`: the causal strategy was asked for:
    `generate --strategy causal`, the causal benchmarks)."""
    if name is None:
        name = default_model(causal=causal)
    model_spec_for(name)
    return name


def load_model(name: str, *, device: str = "cpu", bf16: bool | None = None) -> ModelSet:
    """Build (and load the weights of) a named model. bf16: autocast the transformers in bf16
    (default: on for the small sizes where bf16 is fast on `device`: 2-3x fp32 on CPUs with
    AVX512-bf16, far slower without; `hardware.bf16_is_fast`)."""
    spec = model_spec_for(name)
    if spec.load is not None:  # a family that builds its own modules (an official folder)
        return spec.load(device, bf16)
    torch.manual_seed(spec.seed)
    nets = spec.networks()
    if spec.weights is None:
        for net in nets.values():
            if net is not None:
                _randomize(net, spec.seed)
    else:
        load_weights(spec, nets)  # into the fp32 CPU networks, before they are placed
    if bf16 is None:
        bf16 = name != "tiny-random" and bf16_is_fast(device)
    ac = torch.bfloat16 if bf16 else None
    mods = {k: None if v is None else
            Module(k, v, device=device, autocast_dtype=ac if k in ("dit", "refiner", "vae") else None)
            for k, v in nets.items()}
    audio_model = mods["audio"].model
    return ModelSet(name=name, config=spec.pipeline(),
                    make_audio_stream=lambda: StreamingAudioFeatures(audio_model), **mods)


def _randomize(net: torch.nn.Module, seed: int) -> None:
    """Random weights that make every output depend on its inputs (no zero-initialised heads)."""
    init = getattr(net, "init_random_", None)
    if init is not None:
        init(seed)
