"""`avatarstream models check DIR` on full-size folders in the official layout, written without
gigabytes: each safetensors file is its real header followed by a sparse hole (the check reads
headers only, so it never touches the hole), the `.pth` holds stride-0 tensors of the full shapes
(one element of data each). The DiT and LTX key lists are the official ones
(tests/fixtures/real-models/*.json, built with the official classes), so the counts checked here
are independent of our modules. Then broken folders, each one clear message."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import run_cli

from avatarstream.errors import InputError
from avatarstream.models.wan.vae import WanVAE
from avatarstream.models.wav2vec2 import Wav2Vec2, Wav2Vec2Config
from avatarstream.weights.check import check_folder, describe
from avatarstream.weights.headers import ITEMSIZE

KEYS = Path(__file__).resolve().parents[1] / "fixtures" / "real-models"
PRO_KEYS = json.loads((KEYS / "flashhead_pro_keys.json").read_text())
LITE_KEYS = json.loads((KEYS / "flashhead_lite_keys.json").read_text())
LTX_KEYS = json.loads((KEYS / "ltx_vae_diffusers_keys.json").read_text())
# Model_*/config.json: the official constructor's kwargs as diffusers' ConfigMixin stores them
PRO_CONFIG = {"_class_name": "WanModelAudioProject", "dim": 1536, "in_dim": 32, "ffn_dim": 8960, "out_dim": 16,
              "text_dim": 4096, "freq_dim": 256, "eps": 1e-06, "vae_stride": [4, 8, 8], "patch_size": [1, 2, 2],
              "num_heads": 12, "num_layers": 30, "has_image_input": False}
LITE_CONFIG = dict(PRO_CONFIG, in_dim=256, out_dim=128, vae_stride=[8, 32, 32], patch_size=[1, 1, 1])
LTX_CONFIG = {"_class_name": "AutoencoderKLLTXVideo", "_diffusers_version": "0.32.0.dev0",
              "latent_channels": 128, "patch_size": 4, "patch_size_t": 1}
W2V_CONFIG = {"model_type": "wav2vec2", "architectures": ["Wav2Vec2ForCTC"], "hidden_size": 768,
              "num_hidden_layers": 12, "conv_bias": False, "feat_extract_norm": "group", "vocab_size": 32}


def sparse_safetensors(path: Path, shapes: dict[str, list[int]], dtype: str = "F32") -> Path:
    """A safetensors file with this header and a hole where the data would be (nothing written)."""
    table, offset = {}, 0
    for k, shape in shapes.items():
        n = ITEMSIZE[dtype] * int(torch.Size(shape).numel())
        table[k] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header = json.dumps(table).encode()
    header += b" " * (-len(header) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        f.seek(8 + len(header) + offset - 1)
        f.write(b"\0")
    return path


def meta_shapes(net: torch.nn.Module) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in net.state_dict().items()}


def dit_folder(path: Path, keys: dict[str, list[int]], config: dict) -> Path:
    sparse_safetensors(path / "diffusion_pytorch_model.safetensors", keys)
    (path / "config.json").write_text(json.dumps(config))
    return path


def wan_folder(path: Path) -> Path:
    """VAE_Wan/Wan2.1_VAE.pth at the full size: stride-0 tensors (real storages of one element)."""
    with torch.device("meta"):
        shapes = meta_shapes(WanVAE())
    path.mkdir(parents=True, exist_ok=True)
    torch.save({k: torch.zeros(1).expand(s) for k, s in shapes.items()}, path / "Wan2.1_VAE.pth")
    return path


def ltx_folder(path: Path, keys: dict[str, list[int]] = LTX_KEYS) -> Path:
    return dit_folder(path, keys, LTX_CONFIG)


def wav2vec2_folder(path: Path, cfg: Wav2Vec2Config | None = None) -> Path:
    """A wav2vec2-base-960h folder as transformers saves `Wav2Vec2ForCTC`: `wav2vec2.` prefix,
    the CTC head and SpecAugment's mask vector."""
    with torch.device("meta"):
        net = Wav2Vec2(cfg or Wav2Vec2Config.base())
    keys = {f"wav2vec2.{k}": s for k, s in meta_shapes(net).items()}
    keys |= {"wav2vec2.masked_spec_embed": [net.cfg.hidden_size], "lm_head.weight": [32, net.cfg.hidden_size],
             "lm_head.bias": [32]}
    sparse_safetensors(path / "model.safetensors", keys)
    raw = W2V_CONFIG if cfg is None else {"model_type": "wav2vec2", **dataclasses.asdict(cfg)}
    (path / "config.json").write_text(json.dumps(raw))
    return path


def flashhead_root(path: Path, pro: bool = True, lite: bool = True) -> Path:
    if pro:
        dit_folder(path / "Model_Pro", PRO_KEYS, PRO_CONFIG)
        wan_folder(path / "VAE_Wan")
    if lite:
        dit_folder(path / "Model_Lite", LITE_KEYS, LITE_CONFIG)
        ltx_folder(path / "VAE_LTX")
    return path


def nets(report: dict) -> dict[str, dict]:
    return {n["name"].split("/")[-1]: n for n in report["networks"]}


def test_full_size_folders_counts(tmp_path: Path) -> None:
    """The counts of issue 28: Pro 1.5077 B and Lite 1.5269 B parameters, 843 DiT tensors each
    (12 unused by the forward), Wan VAE 194 / 126.9 M, LTX VAE 190 / 419.19 M; and a 6 GB file
    takes a few kB of disk."""
    root = flashhead_root(tmp_path / "SoulX-FlashHead-1_3B")
    assert os.stat(root / "Model_Pro" / "diffusion_pytorch_model.safetensors").st_blocks * 512 < 1 << 20
    report = check_folder(root)
    assert report["ok"], report["problems"]
    n = nets(report)
    assert (n["Model_Pro"]["tensors"], n["Model_Pro"]["parameters"]) == (843, 1_507_694_912)
    assert (n["Model_Lite"]["tensors"], n["Model_Lite"]["parameters"]) == (843, 1_526_864_256)
    assert (n["VAE_Wan"]["tensors"], round(n["VAE_Wan"]["parameters"] / 1e6, 1)) == (194, 126.9)
    assert (n["VAE_LTX"]["tensors"], round(n["VAE_LTX"]["parameters"] / 1e6, 2)) == (190, 419.19)
    for dit, variant in (("Model_Pro", "pro"), ("Model_Lite", "lite")):
        assert (n[dit]["variant"], n[dit]["released"], n[dit]["unused_tensors"]) == (variant, True, 12)
        assert n[dit]["unused"] == ["audio_emb.*", "text_embedding.*"]
        assert n[dit]["used_tensors"] == 831 and n[dit]["dtypes"] == {"F32": 843}
    assert 4 * 1_507_694_912 < n["Model_Pro"]["bytes"] < 4 * 1_507_694_912 + 200_000  # fp32 + header
    models = report["models"]
    assert set(models) == {"flashhead-pro", "flashhead-lite"}
    for m in models.values():
        assert m["assumed"] == ["wav2vec2"]
        assert m["weight_bytes"]["fp8"] < m["weight_bytes"]["bf16"] < m["gpu_bytes"]["bf16"] < 12e9
        assert m["gpu_bytes"]["fp8"] < m["gpu_bytes"]["bf16"] and isinstance(m["runs_here"], bool)
    text = describe(report)
    assert "1.5077 B" in text and "1.5269 B" in text and "12 tensors" in text and "ok:" in text


def test_collection_through_the_cli(tmp_path: Path) -> None:
    """The README's `models/` (the FlashHead root and wav2vec2-base-960h side by side): exit 0,
    the JSON line, wav2vec2-base's 94.4 M with its CTC head skipped, both budgets complete."""
    flashhead_root(tmp_path / "SoulX-FlashHead-1_3B")
    wav2vec2_folder(tmp_path / "wav2vec2-base-960h")
    r = run_cli("models", "check", str(tmp_path), "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    w = nets(report)["wav2vec2-base-960h"]
    assert (w["variant"], round(w["parameters"] / 1e6, 1), w["unused"]) == ("base", 94.4, ["lm_head.*", "wav2vec2.masked_spec_embed"])
    assert w["used_parameters"] == 94_370_944
    assert all(m["assumed"] == [] for m in report["models"].values())
    alone = check_folder(tmp_path / "SoulX-FlashHead-1_3B")  # its wav2vec2 beside it, as the loader looks
    assert [n["name"] for n in alone["networks"]][0] == "../wav2vec2-base-960h"
    assert all(m["assumed"] == [] for m in alone["models"].values())


def test_tiny_official_folders(tmp_path: Path) -> None:
    """The tiny folders the loader's own tests run end to end pass too: sizes from config.json,
    avatarstream.json and the stored tensors, as the loader takes them."""
    from avatarstream.weights.flashhead_folder import write_official_folder

    for variant in ("pro", "lite"):
        write_official_folder(tmp_path, variant)
    report = check_folder(tmp_path)
    assert report["ok"], report["problems"]
    assert {n["family"] for n in report["networks"]} == {"flashhead-dit", "wan-vae", "ltx-vae", "wav2vec2"}
    assert not any(n["released"] for n in report["networks"])
    assert set(report["models"]) == {"flashhead-pro", "flashhead-lite"}


def check_problems(folder: Path) -> list[str]:
    report = check_folder(folder)
    assert not report["ok"]
    return report["problems"]


def test_broken_folders_through_the_cli(tmp_path: Path) -> None:
    """A missing file: exit 1, the file named, no traceback; a folder of another kind: exit 2,
    one line."""
    root = flashhead_root(tmp_path / "root", lite=False)
    (root / "VAE_Wan" / "Wan2.1_VAE.pth").unlink()
    r = run_cli("models", "check", str(root))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "VAE_Wan/Wan2.1_VAE.pth: missing" in r.stdout
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    r = run_cli("models", "check", str(tmp_path / "other"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert "not a checkpoint folder this check knows" in r.stderr


def test_partial_files(tmp_path: Path) -> None:
    """Truncated safetensors (data cut short; cut inside the header), a header that is not one,
    and a truncated .pth."""
    root = flashhead_root(tmp_path / "a", lite=False)
    dit = root / "Model_Pro" / "diffusion_pytorch_model.safetensors"
    os.truncate(dit, 3_000_000_000)
    [p] = check_problems(root)
    assert "Model_Pro/diffusion_pytorch_model.safetensors: 3,000,000,000 bytes on disk" in p and "partial" in p
    os.truncate(dit, 1000)
    [p] = check_problems(root)
    assert "header alone claims" in p and "partial download" in p
    dit.write_bytes((12).to_bytes(8, "little") + b"not a table!")
    [p] = check_problems(root)
    assert "the header is not JSON" in p and "corrupt" in p
    root = flashhead_root(tmp_path / "b", lite=False)
    pth = root / "VAE_Wan" / "Wan2.1_VAE.pth"
    os.truncate(pth, pth.stat().st_size // 2)
    [p] = check_problems(root)
    assert p.startswith("VAE_Wan/Wan2.1_VAE.pth:") and "partial or corrupt" in p


def test_missing_key_and_wrong_shape(tmp_path: Path) -> None:
    keys = {k: v for k, v in PRO_KEYS.items() if k != "blocks.7.ffn.0.weight"}
    [p] = check_problems(dit_folder(tmp_path / "a" / "Model_Pro", keys, PRO_CONFIG))
    assert "1 tensor(s) of the FlashHead Pro DiT missing: 'blocks.7.ffn.0.weight'" in p
    keys = dict(PRO_KEYS, **{"blocks.0.self_attn.q.weight": [1536, 1535]})
    [p] = check_problems(dit_folder(tmp_path / "b" / "Model_Pro", keys, PRO_CONFIG))
    assert "'blocks.0.self_attn.q.weight' has shape [1536, 1535], the FlashHead Pro DiT expects [1536, 1536]" in p
    keys = {k: v for k, v in LTX_KEYS.items() if k != "latents_std"}  # a renamed network's key too
    [p] = check_problems(ltx_folder(tmp_path / "c" / "VAE_LTX", keys))
    assert "LTX-Video VAE missing: 'latents_std'" in p


def test_lite_dit_in_model_pro(tmp_path: Path) -> None:
    """Lite's weights under Pro's config, and Lite's whole folder moved to Model_Pro/."""
    [p] = check_problems(dit_folder(tmp_path / "a" / "Model_Pro", LITE_KEYS, PRO_CONFIG))
    assert "Model_Pro/diffusion_pytorch_model.safetensors: holds a FlashHead Lite DiT" in p
    [p] = check_problems(dit_folder(tmp_path / "b" / "Model_Pro", LITE_KEYS, LITE_CONFIG))
    assert "Model_Pro/config.json: describes a Lite DiT" in p


def test_another_family_and_half_a_model(tmp_path: Path) -> None:
    root = tmp_path / "root"
    dit_folder(root / "Model_Lite", LITE_KEYS, LITE_CONFIG)
    ltx_folder(root / "VAE_LTX", PRO_KEYS)  # a DiT's file where the LTX VAE belongs
    [p] = check_problems(root)
    assert "VAE_LTX/diffusion_pytorch_model.safetensors: none of its 843 tensors is one of the LTX-Video VAE's" in p
    dit_folder(root / "Model_Pro", PRO_KEYS, PRO_CONFIG)  # Pro without VAE_Wan/
    problems = check_problems(root)
    assert any(p.startswith("VAE_Wan/: missing, flashhead-pro needs it") for p in problems)
    (root / "VAE_Wan").mkdir()
    (root / "VAE_Wan" / "config.json").write_text(json.dumps({"_class_name": "WanModelAudioProject"}))
    assert any("VAE_Wan/Wan2.1_VAE.pth: missing" in p for p in check_problems(root))


def test_wav2vec2_of_the_wrong_size(tmp_path: Path) -> None:
    """wav2vec2-large next to FlashHead: the folder is fine alone, not with this DiT."""
    big = wav2vec2_folder(tmp_path / "w2v", Wav2Vec2Config.large())
    assert check_folder(big)["ok"]
    dit_folder(tmp_path / "fh" / "Model_Lite", LITE_KEYS, LITE_CONFIG)
    problems = check_problems(tmp_path)
    assert any("wav2vec2 gives 24 layers × 1024" in p and "takes 12 × 768" in p for p in problems)


def test_not_a_folder() -> None:
    with pytest.raises(InputError, match="no such folder"):
        check_folder("/nonexistent/checkpoints")


def test_sharded_dit(tmp_path: Path) -> None:
    """A DiT written as a sharded index (`.safetensors.index.json` + shards) is read shard by
    shard; a shard that is not there is named."""
    folder = tmp_path / "Model_Pro"
    keys = list(PRO_KEYS)
    shards = {"a.safetensors": keys[:400], "b.safetensors": keys[400:]}
    for name, part in shards.items():
        sparse_safetensors(folder / name, {k: PRO_KEYS[k] for k in part})
    index = {"weight_map": {k: name for name, part in shards.items() for k in part}}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps(PRO_CONFIG))
    report = check_folder(folder)
    assert report["ok"] and report["networks"][0]["tensors"] == 843, report["problems"]
    (folder / "b.safetensors").unlink()
    assert check_problems(folder) == ["Model_Pro/b.safetensors: missing (download it again)"]
