"""Wan's umT5 text encoder and `models encode-text` (issue 29, item 1: text as a context file).

The encoder is `transformers`' UMT5EncoderModel filled from Wan's own key layout
(weights/umt5.py). Equivalence with the official code is the golden fixture `umt5-a` (made with
Wan2.2 `wan/modules/t5.py` at a tiny size): tolerance 1e-4 in fp32, measured 1.2e-6 on the trimmed
input `encode-text` runs and 0.0 on the official padded + masked input. The tokenizer is a tiny
Unigram model trained here on a few sentences and saved in the Hugging Face folder layout (no
network).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("ftfy")

from avatarstream.cli import main  # noqa: E402
from avatarstream.errors import ConfigError, InputError  # noqa: E402
from avatarstream.parity.fixture import load_fixture, run_parity  # noqa: E402
from avatarstream.weights.official import read_state  # noqa: E402
from avatarstream.weights.text_context import FORMAT, file_sha256, read_context, read_metadata  # noqa: E402
from avatarstream.weights.umt5 import (WAN_UMT5, XXL, encode_ids, load_tokenizer, load_umt5,  # noqa: E402
                                       prompt_ids, umt5_config, wan_keys)

from conftest import run_cli  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "golden" / "umt5-a.safetensors"
SENTENCES = ["a woman speaks to the camera in a bright room", "the man smiles and nods slowly",
             "une femme parle devant la caméra", "ein Mann lächelt", "she turns her head and laughs"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny T5-style tokenizer folder: Unigram + Metaspace, `</s>` (id 1) appended, `<pad>` 0."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    d = tmp_path_factory.mktemp("umt5-tokenizer")
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tok.train_from_iterator(SENTENCES * 4, trainers.UnigramTrainer(
        vocab_size=80, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>", show_progress=False))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.save(str(d / "tokenizer.json"))
    special = {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5Tokenizer", "extra_ids": 0,
                                                         "model_max_length": 512, **special}))
    (d / "special_tokens_map.json").write_text(json.dumps(special))
    return d


@pytest.fixture(scope="module")
def wan_pth(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture's tiny random encoder saved as Wan saves the real one: a bf16 state dict .pth."""
    path = tmp_path_factory.mktemp("umt5-weights") / "models_t5_umt5-xxl-enc-bf16.pth"
    torch.save({k: v.to(torch.bfloat16) for k, v in load_fixture(FIXTURE).weights.items()}, path)
    return path


def encode(*args: str) -> int:
    return main(["models", "encode-text", "--json", *args])


def test_parity_fixture_passes_through_the_cli() -> None:
    r = run_cli("models", "parity", str(FIXTURE), "--json")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["family"] == "umt5" and result["pass"]
    assert result["max_abs_diff"] <= 1e-5, result  # measured 1.2e-6 (max |expected| 4.4)


def test_padded_masked_input_equals_the_official_run() -> None:
    """Wan's own call (512-style padding plus mask, then trim) reproduced through our loader: 0.0
    measured on the AMD EPYC machine that made the fixture, 2.4e-6 on an Intel Xeon (its kernels
    sum in another order); the trimmed run encode-text uses differs by 1.2e-6."""
    fx = load_fixture(FIXTURE)
    model = load_umt5(fx.weights, fx.config, dtype=torch.float32)
    ids, mask = fx.inputs["ids"].long(), fx.inputs["mask"].long()
    with torch.inference_mode():
        out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    for row, n in enumerate(mask.sum(1).tolist()):
        assert (out[row, :n] - fx.expected["context"][row, :n]).abs().max() <= 1e-5


def test_a_wrong_mapping_fails_the_fixture(tmp_path: Path) -> None:
    """The fixture tells the FFN's two input branches apart: swapped, the port is far off."""
    from safetensors.torch import save_file

    fx = load_fixture(FIXTURE)
    tensors = {f"weights.{k}": v for k, v in fx.weights.items()}
    a, b = "weights.blocks.0.ffn.gate.0.weight", "weights.blocks.0.ffn.fc1.weight"
    tensors[a], tensors[b] = tensors[b], tensors[a]
    tensors |= {f"inputs.{k}": v for k, v in fx.inputs.items()} | {f"expected.{k}": v for k, v in fx.expected.items()}
    meta = {"format": "avatarstream-parity/1", "family": "umt5", "config": json.dumps(fx.config),
            "settings": json.dumps(fx.settings)}
    save_file(tensors, str(tmp_path / "swapped.safetensors"), metadata=meta)
    result = run_parity(tmp_path / "swapped.safetensors")
    assert not result["pass"] and result["max_abs_diff"] > 1e-2


def test_full_size_layout_maps_key_for_key_on_meta() -> None:
    """Wan's XXL file (242 tensors, 5.681 B params) lands on every tensor of transformers' model."""
    from transformers import UMT5EncoderModel

    d, a, f, h, v = XXL["dim"], XXL["dim_attn"], XXL["dim_ffn"], XXL["num_heads"], XXL["vocab"]
    shapes = {"norm1.weight": (d,), "norm2.weight": (d,), "attn.o.weight": (d, a), "ffn.fc2.weight": (d, f),
              "ffn.gate.0.weight": (f, d), "ffn.fc1.weight": (f, d), "pos_embedding.embedding.weight": (32, h),
              **{f"attn.{p}.weight": (a, d) for p in "qkv"}}
    shapes |= {"token_embedding.weight": (v, d), "norm.weight": (d,)}
    wan = {k: torch.empty(shapes[k.split(".", 2)[2] if k.startswith("blocks.") else k], device="meta")
           for k in wan_keys(XXL["num_layers"])}
    assert len(wan) == 242
    assert sum(t.numel() for t in wan.values()) == 5_680_910_336
    with torch.device("meta"):
        hf = UMT5EncoderModel(umt5_config(XXL)).state_dict()
    mapped = WAN_UMT5.state_dict("umt5", wan)
    assert set(hf) - set(mapped) == {"shared.weight"}  # the second name of the token embedding
    assert {k: tuple(t.shape) for k, t in mapped.items()} == {k: tuple(hf[k].shape) for k in mapped}


def test_prompt_ids_are_wans_tokenizer_call(tokenizer_dir: Path) -> None:
    """Cleaned as Wan cleans (whitespace runs, HTML entities), eos appended, truncated at text_len
    with the eos kept; equal to the padded call Wan makes, cut at its mask."""
    tok = load_tokenizer(tokenizer_dir)
    ids, truncated = prompt_ids(tok, "  the man\t smiles &amp;   nods  ")
    want = tok(["the man smiles & nods"], padding="max_length", truncation=True, max_length=512,
               add_special_tokens=True, return_tensors="pt")
    assert not truncated and int(ids[-1]) == 1
    assert ids.tolist() == want.input_ids[0, : int(want.attention_mask.sum())].tolist()
    long_ids, truncated = prompt_ids(tok, " ".join(SENTENCES * 20), text_len=16)
    assert truncated and len(long_ids) == 16 and int(long_ids[-1]) == 1
    with pytest.raises(ConfigError, match="empty"):
        prompt_ids(tok, " \n\t ")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_encode_text_writes_the_direct_forward(tmp_path: Path, tokenizer_dir: Path, wan_pth: Path,
                                               dtype: str, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "context.safetensors"
    prompt = "a woman speaks to the camera"
    assert encode("--t5", str(wan_pth), "--tokenizer", str(tokenizer_dir), "--prompt", prompt,
                  "--out", str(out), "--dtype", dtype) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ctx = read_context(out, dim=32)
    model = load_umt5(read_state(wan_pth), dtype=getattr(torch, dtype))
    ids, _ = prompt_ids(load_tokenizer(tokenizer_dir), prompt)
    assert torch.equal(ctx, encode_ids(model, ids))  # [L, 32], L = true length with eos
    assert ctx.dtype == getattr(torch, dtype) and ctx.shape == (len(ids), 32) == (summary["tokens"], 32)
    meta = read_metadata(out)
    assert meta["format"] == FORMAT and meta["prompt"] == prompt and meta["t5_sha256"] == file_sha256(wan_pth)
    assert json.loads(meta["token_ids"]) == ids.tolist()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["context.safetensors"]  # no temporary left


def test_encode_text_finds_both_in_a_checkpoint_folder(tmp_path: Path, tokenizer_dir: Path,
                                                       wan_pth: Path) -> None:
    """LiveAvatar's layout: ckpt/Wan2.2-S2V-14B/{models_t5_umt5-xxl-enc-bf16.pth, google/umt5-xxl/}."""
    base = tmp_path / "ckpt" / "Wan2.2-S2V-14B"
    (base / "google").mkdir(parents=True)
    (base / wan_pth.name).symlink_to(wan_pth)
    (base / "google" / "umt5-xxl").symlink_to(tokenizer_dir)
    direct, found = tmp_path / "direct.safetensors", tmp_path / "found.safetensors"
    assert encode("--t5", str(wan_pth), "--tokenizer", str(tokenizer_dir), "--prompt", "hello",
                  "--out", str(direct)) == 0
    assert encode("--ckpt", str(tmp_path / "ckpt"), "--prompt", "hello", "--out", str(found)) == 0
    assert torch.equal(read_context(found), read_context(direct))


def _error(capsys: pytest.CaptureFixture, *args: str) -> str:
    assert encode(*args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("avatarstream: error:") and "Traceback" not in err and len(err.splitlines()) == 1
    return err


def test_bad_inputs_are_one_clear_message(tmp_path: Path, tokenizer_dir: Path, wan_pth: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    out = str(tmp_path / "c.safetensors")
    args = ["--tokenizer", str(tokenizer_dir), "--prompt", "hello", "--out", out]
    assert "nothing.pth" in _error(capsys, "--t5", str(tmp_path / "nothing.pth"), *args)
    state = read_state(wan_pth)
    state["blocks.1.attn.query.weight"] = state.pop("blocks.1.attn.q.weight")
    torch.save(state, tmp_path / "renamed.pth")
    assert "blocks.1.attn.q.weight" in _error(capsys, "--t5", str(tmp_path / "renamed.pth"), *args)
    torch.save({"encoder.conv1.weight": torch.zeros(2, 2)}, tmp_path / "vae.pth")
    assert "not Wan's umT5 encoder" in _error(capsys, "--t5", str(tmp_path / "vae.pth"), *args)
    assert "empty" in _error(capsys, "--t5", str(wan_pth), "--tokenizer", str(tokenizer_dir), "--prompt", "  ",
                             "--out", out)
    (tmp_path / "a-file").write_text("")
    assert "does not exist" in _error(capsys, "--t5", str(wan_pth), *args[:-1], str(tmp_path / "a-file" / "c.st"))
    assert "is a folder" in _error(capsys, "--t5", str(wan_pth), *args[:-1], str(tmp_path))
    assert "none of tokenizer.json" in _error(capsys, "--t5", str(wan_pth), "--tokenizer", str(tmp_path),
                                              *args[2:])
    assert "neither" in _error(capsys, "--ckpt", str(tmp_path), "--prompt", "hello", "--out", out)
    assert not Path(out).exists()


def test_read_context_refuses_other_files(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not a text context file"):
        read_context(FIXTURE)
    with pytest.raises(InputError, match="no such text context file"):
        read_context(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(InputError, match="not a readable safetensors"):
        read_context(tmp_path / "junk.safetensors")
