"""LoRA merge (weights/lora.py): the merged weight computes what the unmerged adapter does, both
PEFT key forms load, and an adapter that does not cover exactly the targeted modules, or that
carries anything but LoRA pairs, is refused before a weight changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from avatarstream.errors import InputError
from avatarstream.weights.lora import LIVEAVATAR_LORA, LoRASettings, match_lora, merge_lora, target_modules

KEYS = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "real-models" / "s2v14b_keys.json").read_text())
SETTINGS = LoRASettings(rank=4, alpha=2.0, targets=LIVEAVATAR_LORA.targets)  # scale 0.5, as LiveAvatar's


class Attn(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm_k = nn.LayerNorm(d)  # a ".k"-like name that is not a target


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.self_attn, self.cross_attn = Attn(d), Attn(d)
        self.ffn = nn.Sequential(nn.Linear(d, 3 * d), nn.GELU(), nn.Linear(3 * d, d))


class Toy(nn.Module):
    """LiveAvatar's module names at toy size: 2 blocks and one audio injector -> 2·10 + 4 targets."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.audio_injector = nn.Module()
        self.audio_injector.injector = nn.ModuleList([Attn(d)])
        self.head = nn.Linear(d, d)  # not a target


def adapter(net: nn.Module, form: str = "peft", seed: int = 0) -> dict[str, torch.Tensor]:
    """Random A [r, in], B [out, r] for every target of `net`, keyed in one PEFT form."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    shapes = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    for module, (o, i) in target_modules(shapes, SETTINGS).items():
        key = (lambda ab: f"base_model.model.{module}.lora_{ab}.weight") if form == "peft" else \
            (lambda ab: f"{module}.lora_{ab}.default.weight")
        out[key("A")] = torch.randn(SETTINGS.rank, i, generator=g) / i ** 0.5
        out[key("B")] = torch.randn(o, SETTINGS.rank, generator=g)
    return out


def test_full_size_targets_are_448() -> None:
    """PEFT's suffix rule on the real checkpoint's keys: 320 attention + 80 FFN + 48 injector linears."""
    targets = target_modules(KEYS, LIVEAVATAR_LORA)
    assert len(targets) == 448 and LIVEAVATAR_LORA.scale == 0.5
    groups = {"attn": sum(".self_attn." in m or ".cross_attn." in m for m in targets),
              "ffn": sum(".ffn." in m for m in targets), "injector": sum(m.startswith("audio_injector.") for m in targets)}
    assert groups == {"attn": 320, "ffn": 80, "injector": 48}
    assert targets["blocks.0.ffn.0"] == (13824, 5120)


@pytest.mark.parametrize("form", ["peft", "default"])
def test_merge_equals_unmerged_adapter(form: str) -> None:
    """x@W'.T + b == x@W.T + b + scale·(x@A.T)@B.T on every target, within 1e-6 in fp32 (the merge
    runs in fp32); untargeted weights untouched."""
    torch.manual_seed(0)
    net = Toy()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    lora = adapter(net, form)
    assert merge_lora(net, lora, SETTINGS) == 24
    prefix, suffix = ("base_model.model.", "") if form == "peft" else ("", ".default")
    worst = 0.0
    for module in target_modules({k: tuple(v.shape) for k, v in before.items()}, SETTINGS):
        a, b = (lora[f"{prefix}{module}.lora_{ab}{suffix}.weight"] for ab in "AB")
        lin = net.get_submodule(module)
        x = torch.randn(5, lin.in_features)
        ref = x @ before[f"{module}.weight"].T + before[f"{module}.bias"] + SETTINGS.scale * (x @ a.T) @ b.T
        worst = max(worst, (lin(x) - ref).abs().max().item())
    assert worst < 1e-6, worst
    assert torch.equal(net.head.weight, before["head.weight"])
    assert torch.equal(net.blocks[0].self_attn.norm_k.weight, before["blocks.0.self_attn.norm_k.weight"])


def test_merge_into_bf16_goes_through_fp32() -> None:
    """A bf16 network: the merge is computed in fp32 and rounded once (not bf16 products)."""
    torch.manual_seed(1)
    net = Toy()
    lora = adapter(net)
    w = net.blocks[1].ffn[2].weight.detach().clone()
    net.to(torch.bfloat16)
    merge_lora(net, lora, SETTINGS)
    a, b = lora["base_model.model.blocks.1.ffn.2.lora_A.weight"], lora["base_model.model.blocks.1.ffn.2.lora_B.weight"]
    want = (w.to(torch.bfloat16).float() + 0.5 * b @ a).to(torch.bfloat16)
    got = net.blocks[1].ffn[2].weight
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_one_pair_missing_is_refused() -> None:
    """23 of 24 pairs (LiveAvatar's 447 of 448): refused, naming the module; nothing merged."""
    net = Toy()
    before = net.blocks[0].self_attn.q.weight.detach().clone()
    lora = adapter(net)
    lora = {k: v for k, v in lora.items() if ".blocks.1.cross_attn.v." not in k}
    with pytest.raises(InputError, match=r"1 of the 24 targeted modules have no LoRA pair: 'blocks\.1\.cross_attn\.v'"):
        merge_lora(net, lora, SETTINGS, what="liveavatar.safetensors")
    assert torch.equal(net.blocks[0].self_attn.q.weight, before)


def test_447_of_448_at_full_size() -> None:
    """The real key list with one pair dropped, checked from shapes alone (what `models check` does)."""
    targets = target_modules(KEYS, LIVEAVATAR_LORA)
    stored = {}
    for module, (o, i) in targets.items():
        stored[f"base_model.model.{module}.lora_A.weight"] = (128, i)
        stored[f"base_model.model.{module}.lora_B.weight"] = (o, 128)
    m = match_lora(stored, targets, LIVEAVATAR_LORA, "liveavatar.safetensors")
    assert not m.problems and len(m.pairs) == 448 and len(stored) == 896
    del stored["base_model.model.audio_injector.injector.11.o.lora_A.weight"]
    del stored["base_model.model.audio_injector.injector.11.o.lora_B.weight"]
    [p] = match_lora(stored, targets, LIVEAVATAR_LORA, "liveavatar.safetensors").problems
    assert "1 of the 448 targeted modules have no LoRA pair: 'audio_injector.injector.11.o'" in p


def test_stray_tensor_is_refused() -> None:
    net = Toy()
    lora = adapter(net) | {"blocks.0.self_attn.q.weight": torch.zeros(8, 8)}
    with pytest.raises(InputError, match=r"1 tensor\(s\) that are not LoRA A/B weights: 'blocks\.0\.self_attn\.q\.weight'"):
        merge_lora(net, lora, SETTINGS)


def test_unmatched_half_and_wrong_shape() -> None:
    """A pair for a module that is not targeted, an A without its B, a wrong rank: all listed at once."""
    net = Toy()
    lora = adapter(net)
    lora["base_model.model.head.lora_A.weight"] = torch.zeros(4, 8)
    lora["base_model.model.head.lora_B.weight"] = torch.zeros(8, 4)
    del lora["base_model.model.blocks.0.ffn.0.lora_B.weight"]
    lora["base_model.model.blocks.0.ffn.2.lora_A.weight"] = torch.zeros(3, 24)
    targets = target_modules({k: tuple(p.shape) for k, p in net.named_parameters()}, SETTINGS)
    msg = "\n".join(match_lora({k: tuple(t.shape) for k, t in lora.items()}, targets, SETTINGS, "x").problems)
    assert "1 LoRA module(s) the network has no target for: 'head'" in msg
    assert "only one of lora_A/lora_B: 'blocks.0.ffn.0'" in msg
    assert "'base_model.model.blocks.0.ffn.2.lora_A.weight' is [3, 24], expected [4, 24]" in msg
    with pytest.raises(InputError) as e:  # the error: the first two and how many more, one line
        merge_lora(net, lora, SETTINGS)
    assert str(e.value).endswith("(and 1 more problem(s))") and "\n" not in str(e.value)


def test_both_forms_of_one_module() -> None:
    net = Toy()
    lora = adapter(net) | {"blocks.0.self_attn.q.lora_A.default.weight": torch.zeros(4, 8)}
    with pytest.raises(InputError, match="are the same LoRA tensor"):
        merge_lora(net, lora, SETTINGS)
