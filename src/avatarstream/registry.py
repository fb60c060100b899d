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

Any of them with `load_model(name, lora=FILE)` (`generate`/`serve --lora`): a personality adapter
(`train personality`, weights/lora_file.py) merged into the DiT, under the name `NAME+lora-<hash>`.

Importing this module reads nothing: the bundled folders are found the first time a name is
asked for or the models are listed (`MODELS` scans on first use), and weights are read only by
`load_model`. The folders are read by `avatarstream.weights`, never by the trainer.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, MutableMapping
from pathlib import Path

import torch

from avatarstream.engine.module import Module
from avatarstream.engine.config import ModelSet
from avatarstream.errors import ConfigError
from avatarstream.hardware import bf16_is_fast, vae_backend
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


def load_model(name: str, *, device: str = "cpu", bf16: bool | None = None, lora: str | None = None) -> ModelSet:
    """Build (and load the weights of) a named model. bf16: autocast the transformers in bf16
    (default: on for the small sizes where bf16 is fast on `device`: 2-3x fp32 on CPUs with
    AVX512-bf16, far slower without; `hardware.bf16_is_fast`). lora: an adapter file
    `train personality` wrote (weights/lora_file.py), merged into the DiT (`merge_lora`)."""
    spec = model_spec_for(name)
    adapter = _read_adapter(lora)  # a damaged adapter is refused before the model loads (minutes for a real one)
    if spec.load is not None:  # a family that builds its own modules (an official folder)
        return _with_lora(spec.load(device, bf16), lora, adapter)
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
    if hasattr(nets.get("vae"), "set_decode_backend"):  # the causal VAE: eager or a faster backend
        nets["vae"].set_decode_backend(vae_backend())
    mods = {k: None if v is None else
            Module(k, v, device=device, autocast_dtype=ac if k in ("dit", "refiner", "vae") else None)
            for k, v in nets.items()}
    audio_model = mods["audio"].model
    return _with_lora(ModelSet(name=name, config=spec.pipeline(),
                               make_audio_stream=lambda: StreamingAudioFeatures(audio_model), **mods), lora, adapter)


def _read_adapter(lora: str | None) -> tuple | None:
    """`read_lora_file(lora)` (tensors, settings, header), refused when it replaces the base's own adapter."""
    if lora is None:
        return None
    from avatarstream.weights.lora_file import read_lora_file

    adapter = read_lora_file(lora)
    meta = adapter[2]
    if meta.get("replaces"):
        raise ConfigError(f"--lora {lora}: it replaces the base's own adapter ({meta['replaces']}); load it "
                          f"as {meta.get('load', 'the model name with ,lora=FILE')}")
    return adapter


def _with_lora(models: ModelSet, lora: str | None, adapter: tuple | None) -> ModelSet:
    """`models` with the adapter file `lora` merged into its DiT (None: as it is). An adapter that
    replaces LiveAvatar's own is refused here: it is loaded as `liveavatar:DIR,lora=FILE`."""
    if lora is None:
        return models
    from avatarstream.weights.lora_file import merge_adapter

    assert adapter is not None
    tensors, settings, meta = adapter
    if any(p.dtype == torch.float8_e4m3fn for p in models.dit.model.parameters()):
        raise ConfigError(f"--lora {lora}: the DiT is stored in fp8 (,fp8); an adapter merges into its full "
                          "weights only (drop ,fp8)")
    merge_adapter(models.dit.model, tensors, settings, meta, models.name, what=f"--lora {lora}")
    # another name: what is stored per model (a server's prepared references) is not shared
    # between the base and an adapted model, nor between two adapters
    h = hashlib.blake2b(digest_size=6)
    with open(lora, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return dataclasses.replace(models, name=f"{models.name}+lora-{h.hexdigest()}")


def _randomize(net: torch.nn.Module, seed: int) -> None:
    """Random weights that make every output depend on its inputs (no zero-initialised heads)."""
    init = getattr(net, "init_random_", None)
    if init is not None:
        init(seed)
