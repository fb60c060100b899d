"""Training data (train/data.py): the prepared file's layout and statistics, and `train prepare`
keeping an exported model's VAE exactly."""

from __future__ import annotations

import json

import pytest
import torch

from avatarstream.train.data import FRAME_KEYS, PreparedData, clip_bytes, motion_descriptor
from avatarstream.train.nets import build_nets

from .helpers import FAST, run

pytestmark = pytest.mark.usefixtures("one_thread")


def test_prepared_file_layout(dataset):
    data = PreparedData(dataset["prepared"])
    s = dataset["summary"]
    # latents stored at unit scale per channel; the file's VAE (stats folded in) encodes to them
    both = torch.cat([data.lr.transpose(0, 1).flatten(1), data.hr.transpose(0, 1).flatten(1)], 1)
    assert both.mean(1).abs().max() < 0.02 and (both.std(1) - 1).abs().max() < 0.02
    from avatarstream.data.shards import ShardReader
    from avatarstream.train.data import encode_video

    vae = build_nets("tiny")["vae"]
    vae.load_state_dict(data.vae_state)
    reader = ShardReader(dataset["shards"])
    rec = reader.load(next(e for e in reader.entries() if e["key"] == data.clips[0]["key"]))
    n = data.clips[0]["frames"]
    video = torch.from_numpy(rec.frames[:n]).permute(3, 0, 1, 2).float().div(127.5).sub(1.0)[None]
    z = encode_video(vae.eval(), video)[0].permute(1, 0, 2, 3)
    stored = data.hr[: data.clips[0]["latents"]]
    assert (z - stored).abs().max() < 0.02  # float16 storage
    assert s["clips"] == 4 and s["identities"] == 2
    c = data.clips[0]
    assert data.lr.shape[1:] == (4, 4, 4) and data.hr.shape[1:] == (4, 8, 8)
    assert c["latents"] == 1 + (c["frames"] - 1) // 4 and data.table(0).shape == (c["frames"], len(FRAME_KEYS))
    # every clip's identity has another scene: cross-scene references exist
    j, cross = data.other_scene(0, torch.Generator().manual_seed(0))
    assert cross and data.clips[j]["identity"] == c["identity"] and data.clips[j]["scene"] != c["scene"]
    per_clip = clip_bytes(4, 4, 1.0)
    vae_bytes = sum(v.numel() * v.element_size() for v in data.vae_state.values())
    assert s["bytes_per_clip"] < 2 * per_clip + 4096 + vae_bytes / s["clips"]
    m = motion_descriptor(data.table(0), torch.arange(3), 16)
    assert m.shape == (3, 16) and torch.all(m[:, 12:] == 0) and m[:, :3].abs().max() < 5


# -- every recipe -------------------------------------------------------------------------------


def test_prepare_keeps_an_exported_models_vae_as_it_is(trained, dataset, tmp_path):
    """`train prepare --vae WEIGHTS` (statistics already folded in): the file holds that VAE
    exactly and its latents as that VAE encodes them, so preparing again from the file changes
    nothing, and an export of a run on it shares the model's VAE file byte for byte. A VAE run
    folder's VAE is still folded (unit-scale latents)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from avatarstream.cli import main
    from avatarstream.train.export import export

    w = tmp_path / "w"
    export([trained["cfg-distill-tiny"], trained["sr-tiny"]], w)
    base = ["train", "prepare", "--shards", str(dataset["shards"]), "--model", "tiny", "--no-progress"]
    assert main([*base, "--vae", str(w), "--out", str(tmp_path / "a.safetensors")]) == 0
    assert main([*base, "--vae", str(tmp_path / "a.safetensors"), "--out", str(tmp_path / "b.safetensors")]) == 0
    assert main([*base, "--vae", str(trained["vae-tiny"]), "--out", str(tmp_path / "r.safetensors")]) == 0
    a, b = load_file(str(tmp_path / "a.safetensors")), load_file(str(tmp_path / "b.safetensors"))
    mine = load_file(str(w / "vae.safetensors"))
    for k, v in mine.items():
        assert torch.equal(a[f"vae.{k}"], v.float()) and torch.equal(b[f"vae.{k}"], a[f"vae.{k}"]), k
    assert torch.equal(a["hr"], b["hr"]) and torch.equal(a["lr"], b["lr"])
    meta = lambda f: json.loads(safe_open(str(tmp_path / f), "pt").metadata()["avatarstream"])["stats"]  # noqa: E731
    assert meta("a.safetensors")["folded"] is False and meta("r.safetensors")["folded"] is True
    r = load_file(str(tmp_path / "r.safetensors"))["hr"].float()
    assert abs(float(r.std()) - 1.0) < 0.05
    # a run on the file exports with the model's own VAE: shared, not copied
    rd = tmp_path / "run"
    run("a2v-tiny", dataset, rd, train__steps=2, data__prepared=str(tmp_path / "a.safetensors"),
        **FAST["a2v-tiny"])
    s = export([rd], tmp_path / "w2", share_with=w)
    assert "vae" in s["shared"]
