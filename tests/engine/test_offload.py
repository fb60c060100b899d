"""Block offload (`engine/offload.py`): a DiT whose blocks live in a host store and are copied
into two device slots one block ahead computes what the resident DiT computes.

Tolerance: 1e-6 absolute (the same float32 ops on the same weights: measured 0, bit-identical).
On the CPU "device" the mechanism is the real one: between uses every block's parameters are
empty tensors, and each use copies the block's bytes from the store into a slot.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from avatarstream.engine.causal import CausalDenoiser, CausalSettings
from avatarstream.engine.module import Module
from avatarstream.engine.offload import OffloadedBlocks, offload_blocks
from avatarstream.samplers import flow_sigmas

sys.path.insert(0, str(Path(__file__).parents[1] / "parallel"))  # tiny_dit, shared with the SP tests
from sp_rollout import tiny_dit  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-6


def stream(dit: Module, blocks: int = 4) -> list[torch.Tensor]:
    """A causal rollout: the sink encode (its block loop stops early at the last layer), the
    Adaptive Attention Sink, 2 steps a block with rolling caches."""
    den = CausalDenoiser(dit, flow_sigmas(2), CausalSettings(kv_blocks=2))
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        den.start(dit.call("encode_reference", torch.randn(1, 4, 2, 4, 4, generator=g), None,
                           torch.full((2,), -8.0)))
        outs = []
        for i in range(blocks):
            x, m = torch.randn(1, 4, 3, 4, 4, generator=g), torch.randn(1, 3, 4, generator=g)
            xo, mo = den.denoise(x, m, audio=torch.randn(1, 3, 6, 16, generator=g),
                                 text=torch.randn(1, 5, 16, generator=g), text_mask=None,
                                 positions=[3 * i, 3 * i + 1, 3 * i + 2], block=i)
            if i == 0:
                den.adaptive_attention_sink(xo[:, :, :1])
            outs += [xo, mo]
    return outs


def test_offloaded_equals_resident():
    """5 blocks: more than the two slots hold, so every forward copies every block in turn."""
    want = stream(Module("dit", tiny_dit(depth=5)))
    net = tiny_dit(depth=5)
    block_bytes = sum(p.numel() * p.element_size() for p in net.blocks[0].parameters())
    store = offload_blocks(net, "cpu")
    assert isinstance(net.blocks, OffloadedBlocks)
    assert all(p.numel() == 0 for p in net.blocks.parameters())  # nothing resident before use
    got = stream(Module("dit", net))
    diff = max(float((a - b).abs().max()) for a, b in zip(got, want))
    assert diff <= TOL, f"max abs diff {diff:.3g}"
    # freed again after use; the store is the only full copy; the bytes really moved
    assert all(p.numel() == 0 for p in net.blocks.parameters())
    slots = {s.data_ptr() for s in store.slots}
    assert not slots & {s.data_ptr() for s in store.store}
    uses = 1 + 1 + 4 * 2  # sink, AAS sink, 4 blocks x 2 steps: forwards of all blocks
    assert store.bytes_moved >= uses * 4 * block_bytes
    assert store.nbytes >= 2 * block_bytes and len(store.slots) == 2


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(3))

    def forward(self, x: torch.Tensor, stop: int = 3) -> torch.Tensor:
        x = self.inp(x)
        for i, b in enumerate(self.blocks):
            if i == stop:
                break
            x = x + b(x)
        return x


def test_any_module_with_blocks_early_stop_and_indexing():
    """Any `blocks` ModuleList (here odd-sized, so the wrap-around prefetch of block 0 meets the
    slot rotation), a loop that stops early, direct indexing."""
    x = torch.randn(2, 8)
    ref = Toy()
    want = [ref(x), ref(x, stop=1), ref.blocks[2](x)]
    toy = Toy()
    offload_blocks(toy, "cpu")
    for _ in range(2):  # second round: slots already hold blocks from the first
        got = [toy(x), toy(x, stop=1), toy.blocks[2](x)]
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        held = toy.blocks._modules  # (indexing would onload the block)
        assert held["0"][0].weight.numel() == 0 and held["1"][0].weight.numel() == 0


def test_refuses_what_is_not_a_module_list():
    with pytest.raises(TypeError, match="not an nn.ModuleList"):
        offload_blocks(nn.Linear(2, 2), "cpu", attr="weight")


def test_slots_made_inside_inference_mode_serve_outside_it():
    """Slots given back (`drop_slots`) and allocated again inside an inference-mode call are
    normal tensors: a later forward under no_grad copies blocks into them."""
    x = torch.randn(2, 8)
    want = Toy()(x)
    toy = Toy()
    store = offload_blocks(toy, "cpu")
    store.drop_slots()
    with torch.inference_mode():
        assert torch.equal(toy(x), want)  # the slots are allocated here
    with torch.no_grad():
        assert torch.equal(toy(x), want)  # 3 blocks, 2 slots: copies into them
