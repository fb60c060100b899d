"""LiveAvatar downloads (weights/liveavatar_folder.py, weights/check_liveavatar.py): `models check`
on a full-size folder written as headers only (the DiT's 1260 keys are the official list,
tests/fixtures/real-models/s2v14b_keys.json, so the counts are independent of our module), a tiny
random folder loaded with its LoRA merged, and broken folders refused with one message naming the
file and key, before any tensor is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file, save_file

from avatarstream.errors import ConfigError, InputError
from avatarstream.models.liveavatar import LiveAvatarConfig
from avatarstream.models.wav2vec2 import Wav2Vec2Config
from avatarstream.weights import liveavatar_folder as laf
from avatarstream.weights.check import check_folder, describe
from avatarstream.weights.liveavatar_folder import (load_liveavatar_dit, locate, official_config_json, parse_name,
                                                    write_official_folder)
from avatarstream.weights.lora import LIVEAVATAR_LORA, target_modules
from avatarstream.weights.official import read_state

from .test_check import sparse_safetensors, wan_folder, wav2vec2_folder

KEYS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "real-models" / "s2v14b_keys.json").read_text())


def meta_download(root: Path, keys: dict = KEYS, lora_pairs: int | None = None) -> Path:
    """A full-size download of headers and holes: the DiT in 4 bf16 shards + index, the LoRA's 896
    tensors, the Wan2.1 VAE .pth (stride-0 tensors) and wav2vec2-large (docs/real-models.md, LiveAvatar's table)."""
    base = root / laf.BASE_DIR
    names = list(keys)
    weight_map = {}
    for i in range(4):
        shard = f"diffusion_pytorch_model-{i + 1:05d}-of-00004.safetensors"
        part = names[i * 315:(i + 1) * 315]
        sparse_safetensors(base / shard, {k: keys[k] for k in part}, dtype="BF16")
        weight_map |= dict.fromkeys(part, shard)
    (base / laf.INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (base / "config.json").write_text(json.dumps(official_config_json(LiveAvatarConfig.full())))
    lora = {}
    for module, (o, i) in list(target_modules(KEYS, LIVEAVATAR_LORA).items())[:lora_pairs]:
        lora[f"base_model.model.{module}.lora_A.weight"] = [128, i]
        lora[f"base_model.model.{module}.lora_B.weight"] = [o, 128]
    sparse_safetensors(root / laf.LORA_DIR / laf.LORA_FILE, lora, dtype="BF16")
    wan_folder(base)
    wav2vec2_folder(base / laf.W2V_DIR, Wav2Vec2Config.large())
    return root


def by_family(report: dict) -> dict[str, dict]:
    return {n["family"]: n for n in report["networks"]}


def test_full_size_download_through_the_cli(tmp_path: Path) -> None:
    """Issue 29's counts: 16.296 B DiT parameters in 1260 tensors, 896 LoRA tensors = 448 pairs; the
    plans at 720x400 with docs/real-models.md "Memory plans"' ring (11.1 GB a step), sink (2.3 GB) and DiT (32.6 GB)."""
    root = meta_download(tmp_path / "ckpt")
    r = run_cli("models", "check", str(root), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    n = by_family(report)
    dit, lora = n["liveavatar-dit"], n["liveavatar-lora"]
    assert (dit["tensors"], dit["parameters"], dit["released"], dit["dtypes"]) == (1260, 16_295_755_609, True, {"BF16": 1260})
    assert round(dit["parameters"] / 1e9, 3) == 16.296 and dit["used_tensors"] == 1260
    assert (lora["tensors"], lora["lora"]["pairs"], lora["lora"]["expected_pairs"], lora["lora"]["scale"]) == (896, 448, 448, 0.5)
    assert round(lora["parameters"] / 1e6, 1) == 676.3  # docs/real-models.md, LiveAvatar's table
    assert n["wav2vec2"]["variant"] == "large" and n["wan-vae"]["released"]
    m = report["models"]["liveavatar"]
    assert m["assumed"] == [] and m["geometry"]["size"] == "720x400"
    assert round(m["geometry"]["ring_bytes"] / 1e9, 1) == 11.1 and round(m["geometry"]["sink_bytes"] / 1e9, 1) == 2.3
    assert round(m["weight_bytes"]["bf16"] / 1e9, 1) == 33.5  # DiT 32.6 + VAE 0.25 + wav2vec2 0.63
    assert m["gpu_bytes"]["fp8"] < m["gpu_bytes"]["bf16"]
    assert {k: p["fits"] for k, p in m["plans"].items()} == {"1x80GB": True, "2x80GB": True, "4+1": True}
    text = describe(check_folder(root))
    assert "1260 tensors, 16.2958 B parameters" in text and "448 of 448 targeted linears" in text
    assert "4 + 1 x 80 GB: 4 x DiT rank" in text and "one 24GB card" in text


def test_each_folder_of_the_download(tmp_path: Path) -> None:
    """Pointed at Wan2.2-S2V-14B/ or LiveAvatar/, the check finds the other beside it."""
    root = meta_download(tmp_path / "ckpt")
    for sub in (laf.BASE_DIR, laf.LORA_DIR):
        report = check_folder(root / sub)
        assert report["ok"], report["problems"]
        assert {"liveavatar-dit", "liveavatar-lora", "wan-vae", "wav2vec2"} <= set(by_family(report))
    assert locate(root / laf.LORA_DIR) == locate(root) == locate(root / laf.BASE_DIR)


def test_broken_full_size_downloads(tmp_path: Path) -> None:
    """447 LoRA pairs, a missing shard, a missing key, a wrong shape: each named."""
    root = meta_download(tmp_path / "a", lora_pairs=447)
    [p] = check_folder(root)["problems"]
    assert "LiveAvatar/liveavatar.safetensors: 1 of the 448 targeted modules have no LoRA pair" in p
    root = meta_download(tmp_path / "b", keys={k: v for k, v in KEYS.items() if k != "blocks.39.ffn.2.bias"})
    [p] = check_folder(root)["problems"]
    assert "1 tensor(s) of the LiveAvatar DiT missing: 'blocks.39.ffn.2.bias'" in p
    root = meta_download(tmp_path / "c", keys=dict(KEYS, **{"blocks.3.self_attn.q.weight": [5120, 5121]}))
    problems = check_folder(root)["problems"]
    assert any(p.startswith("Wan2.2-S2V-14B/diffusion_pytorch_model-00001-of-00004.safetensors: "
                            "'blocks.3.self_attn.q.weight' has shape [5120, 5121]") for p in problems), problems
    (root / laf.BASE_DIR / "diffusion_pytorch_model-00003-of-00004.safetensors").unlink()
    problems = check_folder(root)["problems"]
    assert "Wan2.2-S2V-14B/diffusion_pytorch_model-00003-of-00004.safetensors: missing (download it again)" in problems


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_official_folder(tmp_path_factory.mktemp("la") / "ckpt")


def test_tiny_folder_loads_with_the_lora_merged(tiny: Path) -> None:
    """Every targeted weight = base + 0.5·B@A (fp32, ≤ 1e-6), everything else exactly the file's; bf16
    by default; the same network from ROOT, either folder, or lora= given."""
    report = check_folder(tiny)
    assert report["ok"], report["problems"]
    assert len(list((tiny / laf.BASE_DIR).glob("diffusion_pytorch_model-0000?-of-00004.safetensors"))) == 4
    folder = parse_name(f"liveavatar:{tiny}")
    net = load_liveavatar_dit(folder, dtype=torch.float32)
    base, lora = read_state(folder.index), load_file(str(folder.lora))
    targets = target_modules({k: tuple(v.shape) for k, v in base.items()}, LIVEAVATAR_LORA)
    assert len(targets) == 28  # 2 layers x (8 attention + 2 FFN) + 2 injectors x 4
    worst = 0.0
    for key, got in net.state_dict().items():
        want = base[key].float()
        module = key.rsplit(".", 1)[0]
        if module in targets and key.endswith(".weight"):
            a, b = (lora[f"base_model.model.{module}.lora_{ab}.weight"].float() for ab in "AB")
            want = want + 0.5 * b @ a
            assert not torch.equal(got, base[key].float())
        worst = max(worst, (got - want).abs().max().item())
    assert worst <= 1e-6, worst
    assert next(load_liveavatar_dit(folder).parameters()).dtype == torch.bfloat16
    other = parse_name(f"liveavatar:{tiny / laf.BASE_DIR},lora={folder.lora}")
    assert other == folder == parse_name(f"liveavatar:{tiny / laf.LORA_DIR}")


def test_names(tiny: Path, tmp_path: Path) -> None:
    assert parse_name("flashhead-pro:x") is None
    with pytest.raises(ConfigError, match="unknown option 'steps=3'"):
        parse_name(f"liveavatar:{tiny},steps=3")
    with pytest.raises(InputError, match="liveavatar.safetensors is missing"):
        parse_name(f"liveavatar:{tiny},lora={tmp_path / 'liveavatar.safetensors'}")


def copy_tiny(tiny: Path, to: Path) -> laf.LiveAvatarFolder:
    import shutil

    shutil.copytree(tiny, to)
    return parse_name(f"liveavatar:{to}")


def test_bad_files_refused_before_loading(tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrong shape in a shard, a stray tensor in the LoRA, a lost shard: one InputError naming the
    file and key; no tensor is read (read_state is never called)."""
    def no_read(path: object) -> None:
        raise AssertionError(f"read {path} before the check refused the folder")

    f = copy_tiny(tiny, tmp_path / "a")
    shard = f.base / "diffusion_pytorch_model-00002-of-00004.safetensors"
    state = load_file(str(shard))
    key = next(k for k, v in state.items() if v.dim() == 2)
    state[key] = torch.zeros(state[key].shape[0], state[key].shape[1] + 1, dtype=state[key].dtype)
    save_file(state, str(shard))
    monkeypatch.setattr(laf, "read_state", no_read)
    with pytest.raises(InputError, match=rf"diffusion_pytorch_model-00002-of-00004\.safetensors: '{key}' has shape"):
        load_liveavatar_dit(f)
    f = copy_tiny(tiny, tmp_path / "b")
    save_file(load_file(str(f.lora)) | {"blocks.0.ffn.0.weight": torch.zeros(128, 64)}, str(f.lora))
    with pytest.raises(InputError, match=r"not LoRA A/B weights: 'blocks\.0\.ffn\.0\.weight'"):
        load_liveavatar_dit(f)
    f = copy_tiny(tiny, tmp_path / "c")
    (f.base / "diffusion_pytorch_model-00004-of-00004.safetensors").unlink()
    with pytest.raises(InputError, match=r"diffusion_pytorch_model-00004-of-00004\.safetensors: missing"):
        load_liveavatar_dit(f)


def test_not_enough_gpu_memory(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the plan's memory is compared with the GPU's free memory before any tensor is read."""
    folder = parse_name(f"liveavatar:{tiny}")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (100 << 20, 80 << 30))
    monkeypatch.setattr(laf, "read_state", lambda path: pytest.fail(f"read {path}"))
    with pytest.raises(ConfigError, match=r"needs about 1\.\d GB on cuda for this plan at 64x64 .* it has 0\.1 GB free"):
        load_liveavatar_dit(folder, device="cuda")
    laf.require_memory(folder, "cpu")  # the CPU: nothing to check
    with pytest.raises(ConfigError, match="at 720x400"):  # a TPP DiT rank at LiveAvatar's size
        laf.require_memory(folder, "cuda", free_bytes=lambda d: 1 << 30, height=400, width=720, rings=1, with_vae=False)


def test_beside_a_flashhead_download(tiny: Path, tmp_path: Path) -> None:
    """A folder holding both downloads: each model pairs with its own wav2vec2 and VAE (FlashHead's
    wav2vec2-base, LiveAvatar's wav2vec2-large), and both pass."""
    import shutil

    from avatarstream.weights.flashhead_folder import write_official_folder as write_flashhead

    shutil.copytree(tiny, tmp_path / "ckpt")
    write_flashhead(tmp_path / "SoulX-FlashHead-1_3B", "pro")
    report = check_folder(tmp_path)
    assert report["ok"], report["problems"]
    assert set(report["models"]) == {"flashhead-pro", "liveavatar"}
    assert report["models"]["liveavatar"]["networks"]["audio"] == "ckpt/Wan2.2-S2V-14B/wav2vec2-large-xlsr-53-english"
