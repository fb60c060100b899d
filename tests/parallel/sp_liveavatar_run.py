"""LiveAvatar's streaming DiT, plain or sequence-parallel: the workloads of test_sp_liveavatar.py.

`rollout(parallel, heads)` runs 6 blocks of `LiveAvatarDenoiser` (4 Euler steps, one ring of 2
blocks per step, so the rings wrap from block 2; the Adaptive Attention Sink before block 4;
seeded sink distances) on a tiny DiT of `heads` heads at 10 x 14 latents (35 tokens a frame:
padded on 2 and on 4 ranks) and returns every block's latents, with the head counts the rings and
the sink hold.

Under torchrun (gloo):
    sp_liveavatar_run.py denoise HEADS OUT      the rollout, sequence-parallel over the world;
                                                rank 0 saves it to OUT
    sp_liveavatar_run.py generate OUT ARGS...   `avatarstream.parallel.launch` with ARGS (a
                                                `generate --sequence-parallel ...` command line);
                                                rank 0 saves every block's denoised latents and
                                                the rings' head count to OUT
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def tiny_dit(heads: int):  # type: ignore[no-untyped-def]
    from avatarstream.models.liveavatar import LiveAvatarConfig, LiveAvatarDiT

    torch.manual_seed(0)
    cfg = LiveAvatarConfig(dim=64, num_heads=heads, num_layers=2, ffn_dim=128, text_dim=32, text_len=16,
                           audio_dim=16, audio_inject_layers=(0, 1))
    net = LiveAvatarDiT(cfg).eval()
    with torch.no_grad():  # no zero-initialised path stays trivially zero
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return net


def rollout(parallel: bool, heads: int, blocks: int = 6) -> tuple[list[torch.Tensor], int, int]:
    """Every block's latents `[1, 16, 3, 10, 14]`, the rings' and the sink's head counts."""
    from avatarstream.engine.liveavatar import LiveAvatarDenoiser
    from avatarstream.engine.module import Module

    net = tiny_dit(heads)
    if parallel:
        from avatarstream.parallel.sp_liveavatar import SequenceParallelLiveAvatar
        from avatarstream.parallel.ulysses import SPGroup

        net = SequenceParallelLiveAvatar(net, SPGroup.default())
    den = LiveAvatarDenoiser(Module("dit", net), block=3, ring_blocks=2, seed=3, aas_block=4)
    g = torch.Generator().manual_seed(1)
    den.start(torch.randn(1, 16, 1, 10, 14, generator=g), torch.randn(1, 16, 19, 10, 14, generator=g),
              torch.randn(5, 32, generator=g))
    outs = []
    for b in range(blocks):
        if den.wants_sink_swap():
            den.adaptive_attention_sink(den.first)
        x, a = torch.randn(1, 16, 3, 10, 14, generator=g), torch.randn(1, 25, 16, 12, generator=g)
        outs.append(den.denoise(x, a, b))
    assert den.sink is not None
    return outs, int(den.rings[0].k[0].shape[1]), int(den.sink.k[0].shape[1])


class Recorded:
    """What LiveAvatar's denoise stage made: every block's latents `[1, C, 3, h, w]`, and the
    head count its rings hold (the model's, or this rank's share under sequence parallelism)."""

    def __init__(self) -> None:
        self.latents: list[torch.Tensor] = []
        self.ring_heads = 0


@contextmanager
def recorded_latents() -> Iterator[Recorded]:
    """Records LiveAvatar's denoise stage (`Recorded`) while the block runs."""
    from avatarstream.engine.stages.liveavatar import LiveAvatarDenoiseStage

    seen = Recorded()
    orig = LiveAvatarDenoiseStage.run_one

    def run_one(self, rec, state):  # type: ignore[no-untyped-def]
        orig(self, rec, state)
        seen.latents.append(rec.lr_latents.detach().clone())
        seen.ring_heads = int(state.causal.rings[0].k[0].shape[1])

    LiveAvatarDenoiseStage.run_one = run_one  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        LiveAvatarDenoiseStage.run_one = orig  # type: ignore[method-assign]


def _denoise(heads: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    with torch.inference_mode():
        lat, ring_heads, sink_heads = rollout(parallel=True, heads=heads)
    last = lat[-1].clone()
    dist.broadcast(last, 0)
    assert torch.equal(last, lat[-1]), "the ranks' outputs differ"  # every rank has the whole block
    if dist.get_rank() == 0:
        torch.save((lat, ring_heads, sink_heads), out)
    dist.destroy_process_group()


def _generate(out: str, argv: list[str]) -> int:
    import os

    from avatarstream.parallel.launch import main

    with recorded_latents() as seen:
        rc = main(argv)
    if rc == 0 and os.environ["RANK"] == "0":
        torch.save((seen.latents, seen.ring_heads), out)
    return rc


if __name__ == "__main__":
    if sys.argv[1] == "denoise":
        _denoise(int(sys.argv[2]), sys.argv[3])
    else:
        sys.exit(_generate(sys.argv[2], sys.argv[3:]))
