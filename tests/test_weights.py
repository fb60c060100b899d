"""Reading weights folders (avatarstream.weights): old config.json files keep loading through the
native adapter, shared files are hash-checked, and a state-dict adapter maps a foreign format
onto our networks key for key (checked on the meta device)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from avatarstream.errors import InputError
from avatarstream.models.dit import DiTConfig, VideoRefDiT
from avatarstream.weights import (KeyRule, StateDictAdapter, load_exported, model_spec, tiny_pipeline,
                                  weights_file)


def _folder(path: Path, config: dict, nets: tuple[str, ...] = ("dit", "refiner", "vae", "audio", "text")) -> Path:
    """A weights folder of tiny networks (seeded default init) with `config` as its config.json."""
    from safetensors.torch import save_file

    from avatarstream.registry import MODELS

    torch.manual_seed(0)
    built = MODELS["tiny-random"].networks()
    path.mkdir(parents=True)
    for name in nets:
        save_file({k: v.contiguous() for k, v in built[name].state_dict().items()}, str(path / f"{name}.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_old_config_without_sizes_or_pipeline_loads_with_the_presets(tmp_path):
    """A config.json from before the sizes and inference defaults were stored ({"model": "tiny"})
    gives the tiny presets, and its files load strictly into them."""
    from safetensors.torch import load_file

    from avatarstream.models.refiner import RefinerConfig
    from avatarstream.models.vae import VAEConfig

    f = _folder(tmp_path / "old", {"model": "tiny"})
    spec = model_spec(f)
    assert spec.dit() == DiTConfig.tiny() and spec.refiner() == RefinerConfig.tiny()
    assert spec.vae() == VAEConfig.tiny() and spec.pipeline() == tiny_pipeline()
    nets = load_exported(f)
    assert set(nets) == {"dit", "refiner", "vae", "audio", "text"}
    saved = load_file(str(f / "vae.safetensors"))
    assert all(torch.equal(v, saved[k]) for k, v in nets["vae"].state_dict().items())


def test_stored_configs_keep_their_variant_and_only_the_chosen_pipeline_defaults(tmp_path):
    """A stored DiT config without a field added since (`anchor`) keeps the dataclass default
    (the variant its weights are), JSON lists become tuples, and of the stored pipeline only the
    inference defaults an export chooses override today's preset (not its geometry); no refiner
    file: a direct model."""
    dit = {k: v for k, v in dataclasses.asdict(DiTConfig.tiny()).items() if k != "anchor"}
    cfg = {"model": "tiny", "configs": {"dit": json.loads(json.dumps(dit))},
           "pipeline": {"steps": 2, "strategy": "causal", "chunk": 99, "audio_scale": None}}
    spec = model_spec(_folder(tmp_path / "f", cfg, nets=("dit", "vae", "audio", "text")))
    d = spec.dit()
    assert d.anchor is False and DiTConfig.tiny().anchor is True
    assert d.patch == (1, 2, 2) and isinstance(d.patch, tuple)
    p = spec.pipeline()
    assert (p.steps, p.strategy) == (2, "causal")
    assert (p.chunk, p.audio_scale) == (tiny_pipeline().chunk, tiny_pipeline().audio_scale)
    assert spec.refiner is None


def test_shared_files_are_hash_checked(tmp_path):
    """A network stored in another folder (`"shared"`) is found through the relative path, and
    is refused once that file changed or went missing."""
    from avatarstream.weights import file_sha256

    a = _folder(tmp_path / "a", {"model": "tiny"})
    text = a / "text.safetensors"
    b = _folder(tmp_path / "b", {"model": "tiny", "shared": {"text": {
        "file": "../a/text.safetensors", "sha256": file_sha256(text)}}}, nets=("dit", "refiner", "vae", "audio"))
    assert weights_file(b, "text") == text.resolve()
    assert "text" in load_exported(b)
    data = bytearray(text.read_bytes())
    data[-1] ^= 1
    text.write_bytes(bytes(data))
    with pytest.raises(InputError, match="has changed since the export"):
        weights_file(b, "text")
    text.unlink()
    with pytest.raises(InputError, match="which is missing"):
        weights_file(b, "text")
    assert weights_file(b, "nothing") is None


def test_adapter_maps_a_foreign_state_dict_key_for_key():
    """A foreign layout of the tiny DiT (blocks called layers, the q projection stored per head
    `[heads, head_dim, dim]`, one tensor we have no use for) maps back onto our keys and shapes exactly;
    rules that send two tensors to one key are refused. On the meta device: no memory, no init."""
    with torch.device("meta"):
        ours = VideoRefDiT(DiTConfig.tiny()).state_dict()
    heads = DiTConfig.tiny().heads
    foreign = {}
    for k, v in ours.items():
        k = k.replace("blocks.", "layers.", 1)
        foreign[k] = v.unflatten(0, (heads, -1)) if k.endswith("self_attn.q.weight") else v  # [H, hd, D]
    foreign["rope.cache"] = torch.empty(3, device="meta")
    adapter = StateDictAdapter("foreign", rules=(
        KeyRule("dit", r"rope\..*", None),
        KeyRule("dit", r"layers\.(\d+)\.self_attn\.q\.weight", r"blocks.\1.self_attn.q.weight",
                lambda t: t.flatten(0, 1)),  # [H, hd, D] -> [H*hd, D]
        KeyRule("dit", r"layers\.(.*)", r"blocks.\1"),
    ))
    got = adapter.state_dict("dit", foreign)
    assert list(got) == list(ours)
    assert all(got[k].shape == v.shape for k, v in ours.items())
    assert adapter.state_dict("vae", {"layers.0.x": torch.empty(1)}).keys() == {"layers.0.x"}  # other nets: as stored
    clash = StateDictAdapter("clash", rules=(KeyRule("dit", r"layers\.(.*)", r"blocks.\1"),))
    with pytest.raises(InputError, match="two stored dit tensors"):
        clash.state_dict("dit", {"layers.0.a": torch.empty(1), "blocks.0.a": torch.empty(1)})
