"""Causal streaming of a tiny 4-head DiT, plain or sequence-parallel: the test's workload.

`rollout(parallel)` runs 6 blocks of Algorithm 3 (3 steps, a rolling cache of 2 blocks, Rolling
RoPE, the Adaptive Attention Sink after block 0, a batch of 2 whose reference has a frame masked
for one element, a scene anchor) and returns every block's output. Run as a script under torchrun
it runs the sequence-parallel rollout over the world and rank 0 saves it to argv[1]. Block size
3 x (4 patches + 1 motion token) = 15 tokens: padded on 2 and on 4 ranks.
"""

from __future__ import annotations

import sys

import torch


def tiny_dit(depth: int = 2):  # type: ignore[no-untyped-def]
    from avatarstream.models.dit import DiTConfig, VideoRefDiT

    net = VideoRefDiT(DiTConfig(in_channels=4, dim=32, depth=depth, heads=4, ffn_dim=64, audio_dim=16,
                                audio_tokens=6, text_dim=16, motion_dim=4, anchor=True))
    net.init_random_(0)
    return net.eval()


def rollout(parallel: bool, blocks: int = 6) -> tuple[list[torch.Tensor], int]:
    """Every block's (latents, motion) and the head count of the rolling caches' K/V."""
    from avatarstream.engine.causal import CausalDenoiser, CausalSettings
    from avatarstream.engine.module import Module
    from avatarstream.samplers import flow_sigmas

    net = tiny_dit()
    if parallel:
        from avatarstream.parallel.sequence import SequenceParallelDiT
        from avatarstream.parallel.ulysses import SPGroup

        net = SequenceParallelDiT(net, SPGroup.default())
    dit = Module("dit", net)
    s = CausalSettings(kv_blocks=2, adaptive_sink=True, rolling_rope=True)
    den = CausalDenoiser(dit, flow_sigmas(3), s)
    g = torch.Generator().manual_seed(7)
    ref = torch.randn(1, 4, 2, 4, 4, generator=g).expand(2, -1, -1, -1, -1)
    valid = torch.tensor([[True, True], [True, False]])
    with torch.inference_mode():
        den.start(dit.call("encode_reference", ref, valid, torch.full((2,), s.ref_t_position)),
                  anchor=torch.randn(2, 4, 4, 4, generator=g))
        text = torch.randn(2, 5, 16, generator=g)
        outs = []
        for i in range(blocks):
            x, m = torch.randn(2, 4, 3, 4, 4, generator=g), torch.randn(2, 3, 4, generator=g)
            a = torch.randn(2, 3, 6, 16, generator=g)
            xo, mo = den.denoise(x, m, audio=a, text=text, text_mask=None,
                                 positions=list(range(3 * i, 3 * i + 3)), block=i)
            if i == 0:
                den.adaptive_attention_sink(xo[:, :, :1])
            outs += [xo.clone(), mo.clone()]
    return outs, int(den.caches[0].k[0].shape[1])


if __name__ == "__main__":
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = rollout(parallel=True)  # (outputs, cache heads)
    if dist.get_rank() == 0:
        torch.save(out, sys.argv[1])
    dist.destroy_process_group()
