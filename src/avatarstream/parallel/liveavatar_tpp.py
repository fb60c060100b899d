"""LiveAvatar's ranks of the timestep-forcing pipeline (officially 4 denoise ranks + 1 VAE rank; docs/real-models.md, "GPU runbook"): the same protocol as
ours (`parallel/tpp.py`), with LiveAvatar's stages.

    denoise rank i   the block's audio (its own wav2vec2 window: every denoise rank encodes the
                     block's audio itself, as every official DiT rank does), receive the block
                     from rank i − 1 (rank 0: the chunk's seeded noise), run its share of the 4
                     steps with its own step rings, send it on
    decode rank      receive the finished block from the last denoise rank, primed streaming
                     decode, publish

Adaptive Attention Sink: the last denoise rank finishes block 0, so it holds the stream's first
generated latent; before block `aas_block` it sends it to the other denoise ranks and every rank
re-prefills its sink with it (the official VAE rank broadcasts it after clip 0; here the rank that
made it does). The sink distance is drawn per block from the session seed
(`engine/liveavatar.sink_distance`), so every rank uses the same d for a block: the output is the
single-process output (the official ranks draw their own, unseeded).
"""

from __future__ import annotations

from typing import Any

from avatarstream.engine.session import SessionState
from avatarstream.engine.stage import ChunkRecord, Stage
from avatarstream.engine.stages.liveavatar import LiveAvatarDenoiseStage, liveavatar_stages
from avatarstream.parallel.link import TAG_LATENT, TAG_SINK


class LiveAvatarTPPDenoiseStage(Stage):
    name = "tpp_denoise"
    reads = ("audio", "sigma_noise")
    writes = ()

    def __init__(self, inner: LiveAvatarDenoiseStage, rank: int, shares: list[list[int]], link: Any) -> None:
        super().__init__()
        self.inner, self.rank, self.shares, self.link = inner, rank, shares, link
        self.last = rank == len(shares) - 1

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        if state.causal is None:
            state.causal = self.inner.new_denoiser(state, steps=self.shares[self.rank])
        den = state.causal
        x = rec.sigma_noise.float()  # [1, C, F, h, w]
        if den.wants_sink_swap():
            if self.last:
                for r in range(self.rank):
                    self.link.send(den.first, r, TAG_SINK)
                first = den.first
            else:
                first = self.link.recv((1, x.shape[1], 1, *x.shape[3:]), len(self.shares) - 1, TAG_SINK)
            den.adaptive_attention_sink(first)
        if self.rank > 0:
            x = self.link.recv(tuple(x.shape), self.rank - 1, TAG_LATENT)
        x = den.denoise(x, rec.audio, rec.plan.id)
        self.link.send(x, self.rank + 1, TAG_LATENT)


class ReceiveLiveAvatarBlockStage(Stage):
    """The decode rank's source of finished blocks: the last denoise rank."""

    name = "tpp_receive"
    reads = ("sigma_noise",)
    writes = ("lr_latents",)

    def __init__(self, src: int, link: Any) -> None:
        super().__init__()
        self.src, self.link = src, link

    def run_one(self, rec: ChunkRecord, state: SessionState) -> None:
        rec.lr_latents = self.link.recv(tuple(rec.sigma_noise.shape), self.src, TAG_LATENT)


def denoise_rank_stages(models: Any, config: Any, rank: int, shares: list[list[int]], link: Any) -> list[Stage]:
    audio, denoise, _ = liveavatar_stages(models, config)
    return [audio, LiveAvatarTPPDenoiseStage(denoise, rank, shares, link)]


def decode_rank_stages(models: Any, config: Any, src: int, link: Any) -> list[Stage]:
    *_, decode = liveavatar_stages(models, config)
    return [ReceiveLiveAvatarBlockStage(src, link), decode]


def is_liveavatar(models: Any) -> bool:
    return models.stages is liveavatar_stages
