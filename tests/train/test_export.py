"""`train export` (train/export.py): runs -> a weights folder the registry loads; `--share-with`
refers to identical files instead of copying them; a decoder fine-tune's decoder is bundled with
the encoder its DiT's latents came from."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from avatarstream import registry
from avatarstream.errors import InputError
from avatarstream.train.checkpoints import net_weights
from avatarstream.train.data import PreparedData
from avatarstream.train.export import export
from avatarstream.weights import load_exported, model_spec

from .helpers import FAST, run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_export_loads_into_registry(trained, dataset, tmp_path, monkeypatch):
    out = tmp_path / "weights" / "tiny-trained"
    runs = [trained["cfg-distill-tiny"], trained["a2v-tiny"], trained["sr-tiny"], trained["vae-tiny"]]
    s = export(runs, out, dtype="fp32")
    assert set(s["trained"]) == {"dit", "audio", "text", "refiner", "vae"} and not s["untrained"]
    # the VAE is the one the latent runs' prepared file was made with (latent statistics folded in)
    prep = load_file(str(dataset["prepared"]))
    assert s["trained"]["vae"] == str(dataset["prepared"])
    assert torch.equal(load_file(str(out / "vae.safetensors"))["quant_conv.bias"], prep["vae.quant_conv.bias"])
    assert s["trained"]["dit"] == str(trained["cfg-distill-tiny"]) and s["trained"]["audio"] == str(trained["a2v-tiny"])
    nets = load_exported(out)  # strict load into the model classes
    ck = load_file(str(sorted((trained["cfg-distill-tiny"]).glob("ckpt-*.safetensors"))[-1]))
    sd = nets["dit"].state_dict()
    assert torch.equal(sd["blocks.0.self_attn.q.weight"], ck["ema.dit.blocks.0.self_attn.q.weight"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"] == "tiny" and cfg["pipeline"]["hr_size"] == 64
    # the DiT takes the CFG scales as inputs: the distill run's scales are the model's defaults
    assert (cfg["pipeline"]["audio_scale"], cfg["pipeline"]["ref_scale"]) == (3.0, 1.5)
    monkeypatch.setitem(registry.MODELS, "tiny-trained", model_spec(out))
    ms = registry.load_model("tiny-trained")
    assert ms.config.guidance == (3.0, 1.5)
    assert torch.equal(ms.vae.model.state_dict()["quant_conv.weight"],
                       load_file(str(out / "vae.safetensors"))["quant_conv.weight"])
    # default storage: bf16, half the bytes, loads into the same classes
    s16 = export(runs, tmp_path / "w16")
    assert s16["bytes"] < 0.55 * s["bytes"]
    w16 = load_exported(tmp_path / "w16")["dit"].state_dict()["blocks.0.self_attn.q.weight"]
    assert torch.equal(w16, sd["blocks.0.self_attn.q.weight"].bfloat16().float())


def test_export_shares_identical_files_with_another_folder(trained, dataset, tmp_path, monkeypatch):
    """`export --share-with A`: networks byte-identical to A's are referred to (path + sha256),
    not copied; the model loads the same weights as a full copy through the registry, `export`'s
    own readers and `[init]`; a shared file that changed or is missing is one clear error."""
    runs = [trained["cfg-distill-tiny"], trained["a2v-tiny"], trained["sr-tiny"], trained["vae-tiny"]]
    a = tmp_path / "w" / "a"
    export(runs, a)
    full = tmp_path / "w" / "full"
    export(runs[:1] + runs[2:], full)  # text/audio from the distill run's frozen copies
    b = tmp_path / "w" / "b"
    s = export(runs[:1] + runs[2:], b, share_with=a)
    cfg = json.loads((b / "config.json").read_text())
    same = {n for n in ("dit", "vae", "audio", "text", "refiner")
            if (a / f"{n}.safetensors").read_bytes() == (full / f"{n}.safetensors").read_bytes()}
    assert same and s["shared"] == sorted(same) == sorted(cfg["shared"])
    assert "dit" in same  # the same distill run's EMA DiT
    for n in same:
        assert not (b / f"{n}.safetensors").exists() and cfg["shared"][n]["file"] == f"../a/{n}.safetensors"
    want, got = load_exported(full), load_exported(b)
    for n in want:
        for k, v in want[n].state_dict().items():
            assert torch.equal(v, got[n].state_dict()[k]), (n, k)
    n = sorted(same)[0]
    assert all(torch.equal(v, net_weights(full, n)[k]) for k, v in net_weights(b, n).items())
    monkeypatch.setitem(registry.MODELS, "tiny-b", model_spec(b))
    ms = registry.load_model("tiny-b")
    assert torch.equal(ms.dit.model.state_dict()["blocks.0.self_attn.q.weight"],
                       want["dit"].state_dict()["blocks.0.self_attn.q.weight"])
    f = a / f"{n}.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(InputError, match="has changed since the export"):
        load_exported(b)
    f.unlink()
    with pytest.raises(InputError, match="which is missing"):
        registry.load_model("tiny-b")
    with pytest.raises(InputError, match="not a weights folder"):
        export(runs, tmp_path / "w" / "c", share_with=tmp_path)
    with pytest.raises(InputError, match="is the --out folder"):
        export(runs, full, share_with=full)


def test_export_takes_the_finetuned_decoder(trained, dataset, tmp_path):
    """export(a2v run, decoder fine-tune run started from the prepared file's VAE): the bundle's
    encoder is the prepared VAE's, its decoder the fine-tune's; a fine-tune of another VAE is
    refused (its latent space is not the DiT's)."""
    prepared_vae = PreparedData(dataset["prepared"]).vae_state
    save_file(prepared_vae, str(tmp_path / "prep-vae.safetensors"))
    over = dict(FAST["vae-tiny"], train__steps=4, train__checkpoint_every=100, vae__train_encoder=False)
    t = run("vae-tiny", dataset, tmp_path / "dec", init__vae=str(tmp_path / "prep-vae.safetensors"), **over)
    export([trained["a2v-tiny"], tmp_path / "dec"], tmp_path / "out", dtype="fp32")
    vae = load_exported(tmp_path / "out")["vae"].state_dict()
    tuned = t.ema
    for k, v in vae.items():
        if k.startswith(("encoder.", "quant_conv.")):
            assert torch.equal(v, prepared_vae[k].float()), k
        elif f"vae.{k}" in tuned:
            assert torch.equal(v, tuned[f"vae.{k}"]), k
    assert any(not torch.equal(vae[k], prepared_vae[k].float()) for k in vae if k.startswith("decoder."))
    run("vae-tiny", dataset, tmp_path / "other", init__vae=str(trained["vae-tiny"]), **over)
    with pytest.raises(InputError, match="frozen encoder"):
        export([trained["a2v-tiny"], tmp_path / "other"], tmp_path / "out2")
