"""LiveAvatar's streaming DiT: Wan2.2-S2V-14B (`CausalWanModel_S2V`) run block-causally.

A stream is generated in blocks of a few latent frames (3 in the release), each denoised in a few
Euler steps (4), with one `KVRing` per step (timestep forcing). Before the first block, the sink
is prefilled once: one t = 0 pass over the [reference ; FramePack] tokens (`prefill_sink`). Then
every step of every block is one `forward_block`:

    tokens   noisy latents patchified (+ pose via `cond_encoder`, + mask embedding 0)
    time     per latent frame: 6 AdaLN vectors per layer, 2 for the head (t = 1000·σ)
    layers   self-attention over [ring (this step's last blocks, this block included) ; sink],
             keys RoPE'd at absolute latent frames, the sink rolled (`sink.py`); text
             cross-attention; FFN; audio injected after the layers in `audio_inject_layers`
    head     AdaLN head, unpatchified -> velocity

Conditioning tokens (reference: mask embedding 1, FramePack: 2) only ever run at t = 0, in the
prefill, and are seen afterwards only as the sink's K/V. Audio never crosses blocks: a block's
wav2vec2 states are left-padded with `motion_frames` copies of its first frame and the first
`motion_latents` encoded frames are dropped, as the official forward does.

Keys and shapes are the official ones (`s2v14b_keys.json`: 1260 tensors, 16.296 B parameters), so
a checkpoint loads with no renames (`weights.official.build_loaded`).

Shapes: latents `[B, C, F, H, W]`; tokens `[B, F, P, D]` with P = (H/ph)(W/pw); audio
`[B, L, C_a, 4F]` (wav2vec2 layers, channels, video frames); context `[L_text, text_dim]` or
`[B, L_text, text_dim]`, or a `TextKV`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from avatarstream.models.dit_blocks import Head, sinusoidal_embedding
from avatarstream.models.liveavatar.audio import AudioInjector, CausalAudioEncoder
from avatarstream.models.liveavatar.blocks import LayerAttend, LiveAvatarBlock, TextKV
from avatarstream.models.liveavatar.config import LiveAvatarConfig
from avatarstream.models.liveavatar.framepack import FramePack, framepack_positions
from avatarstream.models.liveavatar.ring import KVRing
from avatarstream.models.liveavatar.sink import SinkKV
from avatarstream.models.rope import apply_rope, rope_tables

# q, k, v `[B, heads, N, hd]` -> `[B, heads, N, hd]`: the self-attention kernel (SDPA by default;
# sequence parallelism swaps in its own)
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked attention of q over k, v (all `[B, heads, N, hd]`)."""
    return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype))



@dataclass
class BlockInputs:
    """One block as the layers take it (`LiveAvatarDiT.embed_block`): noisy tokens `[B, F, P, D]`,
    the head's time embedding e `[B, F, D]`, the layers' AdaLN tables e6 `[B, F, 6, D]`, the audio
    (global `[B, F, 1, D]`, local `[B, F, A, D]`), the token grid (F, h, w) and the block's RoPE
    cos, sin `[F·P, hd/2]`. Everything but `rope` is per latent frame, so a shard of every frame's
    tokens runs the layers with these tables as they are."""

    tokens: torch.Tensor
    e: torch.Tensor
    e6: torch.Tensor
    audio: tuple[torch.Tensor, torch.Tensor]
    grid: tuple[int, int, int]
    rope: tuple[torch.Tensor, torch.Tensor]

class LiveAvatarDiT(nn.Module):
    """See the module doc. `blocks` is the per-layer `nn.ModuleList` (offload and FSDP wrap it)."""

    def __init__(self, config: LiveAvatarConfig) -> None:
        super().__init__()
        c = self.config = config
        d, patch = c.dim, c.patch_size
        self.patch_embedding = nn.Conv3d(c.in_dim, d, kernel_size=patch, stride=patch)
        self.text_embedding = nn.Sequential(nn.Linear(c.text_dim, d), nn.GELU(approximate="tanh"),
                                            nn.Linear(d, d))
        self.time_embedding = nn.Sequential(nn.Linear(c.freq_dim, d), nn.SiLU(), nn.Linear(d, d))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(LiveAvatarBlock(d, c.num_heads, c.ffn_dim, c.eps)
                                    for _ in range(c.num_layers))
        self.head = Head(d, c.out_dim * math.prod(patch), c.eps)
        self.cond_encoder = (nn.Conv3d(c.cond_dim, d, kernel_size=patch, stride=patch)
                             if c.cond_dim > 0 else None)
        self.casual_audio_encoder = CausalAudioEncoder(c.audio_dim, d, c.num_audio_token, c.audio_layers)
        self.audio_injector = AudioInjector(d, c.num_heads, len(c.audio_inject_layers))
        self.trainable_cond_mask = nn.Embedding(3, d)  # 0 noisy, 1 reference, 2 motion
        self.frame_packer = FramePack(c.in_dim, d, patch, c.framepack_buckets)
        self._injector_of = {layer: j for j, layer in enumerate(c.audio_inject_layers)}
        # the self-attention kernel used where a call passes none (an executor may set it once)
        self.attention: AttentionFn = sdpa_attention

    # -- pieces shared by the prefill and the blocks ---------------------------------------------
    def text_cache(self, context: torch.Tensor) -> TextKV:
        """A session's text K/V cache for the prompt `context` `[L, text_dim]` (or `[B, L, text_dim]`):
        zero-padded to `text_len` *before* `text_embedding` (padded positions are not zero tokens,
        and all `text_len` are attended), embedded now, per-layer K/V made on first use."""
        if context.dim() == 2:
            context = context[None]
        n = context.shape[1]
        if n > self.config.text_len:
            raise ValueError(f"prompt of {n} tokens, the model takes at most {self.config.text_len}")
        w = self.text_embedding[0].weight
        padded = F.pad(context.to(w.device, w.dtype), (0, 0, 0, self.config.text_len - n))
        return TextKV(self.text_embedding(padded), len(self.blocks))

    def _text(self, context: torch.Tensor | TextKV) -> TextKV:
        return context if isinstance(context, TextKV) else self.text_cache(context)

    def time_tables(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Timesteps t `[B, F]` (1000·σ) -> e `[B, F, D]` (head), e6 `[B, F, 6, D]` (layers)."""
        e = self.time_embedding(sinusoidal_embedding(t, self.config.freq_dim).to(self.head.modulation.dtype))
        return e, self.time_projection(e).unflatten(-1, (6, self.config.dim))

    def _rope(self, t: torch.Tensor, h: torch.Tensor, w: torch.Tensor, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        cos, sin = rope_tables(t, h, w, c.head_dim, c.rope_theta, fp16=c.rope_fp16)
        return cos.to(device), sin.to(device)

    def run_layers(self, h: torch.Tensor, e6: torch.Tensor, text: TextKV,
                attend: Callable[[int], LayerAttend],
                audio: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Every layer, in order, through `block(...)`: h `[B, F, P, D]`; `attend(i)` is layer i's
        self-attention; audio (global `[B, F, 1, D]`, local `[B, F, A, D]`) is injected after the
        layers of `audio_inject_layers` (None: no audio, as in the sink prefill)."""
        for i, block in enumerate(self.blocks):
            h = block(h, e6, text.layers[i], attend(i))
            j = self._injector_of.get(i)
            if audio is not None and j is not None:
                h = self.audio_injector.inject(j, h, *audio)
        return h

    # -- the sink --------------------------------------------------------------------------------
    def prefill_sink(self, ref_latents: torch.Tensor, motion_latents: torch.Tensor,
                     context: torch.Tensor | TextKV, *, attention: AttentionFn | None = None) -> SinkKV:
        """One t = 0 pass over [reference ; FramePack] tokens: full self-attention among them, text
        cross-attention, no audio. Returns each layer's K (before RoPE) and V.

        ref_latents `[B, C, 1, H, W]`, motion_latents `[B, C, T_m, H, W]` (the newest
        sum(framepack_buckets) are read; fewer are zero-padded in front)."""
        c = self.config
        attention = attention or self.attention
        if ref_latents.shape[2] != 1:
            raise ValueError(f"the reference is one latent frame, got {ref_latents.shape[2]}")
        ref = self.patch_embedding(ref_latents.to(self.patch_embedding.weight.dtype))  # [B, D, 1, h, w]
        hp, wp = ref.shape[3], ref.shape[4]
        ref = ref.flatten(2).transpose(1, 2) + self.trainable_cond_mask.weight[1]  # [B, h·w, D]
        mot = self.frame_packer(motion_latents.to(ref.dtype)) + self.trainable_cond_mask.weight[2]
        tokens = torch.cat([ref, mot.expand(ref.shape[0], -1, -1)], dim=1)[:, None]  # [B, 1, S, D]
        # positions at placement 0: the reference at ref_time, FramePack at its fixed times
        rh = torch.arange(hp, dtype=torch.float64).repeat_interleave(wp)
        rw = torch.arange(wp, dtype=torch.float64).repeat(hp)
        mt, mh, mw = framepack_positions(c.framepack_buckets, c.patch_size, *motion_latents.shape[3:])
        pos_t = torch.cat([torch.full((hp * wp,), float(c.ref_time), dtype=torch.float64), mt])
        pos_h, pos_w = torch.cat([rh, mh]), torch.cat([rw, mw])
        moves = torch.cat([torch.ones(hp * wp, dtype=torch.bool), torch.zeros(mt.numel(), dtype=torch.bool)])
        if mot.shape[1] != mt.numel():
            raise ValueError(f"FramePack made {mot.shape[1]} tokens for {mt.numel()} positions "
                             f"(motion latents {tuple(motion_latents.shape[3:])} do not fit patch "
                             f"{c.patch_size})")
        cos, sin = self._rope(pos_t, pos_h, pos_w, tokens.device)
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []

        def attend(_: int) -> LayerAttend:
            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                ks.append(k.to(v.dtype))
                vs.append(v)
                kr = apply_rope(k, cos, sin).to(v.dtype)
                return attention(apply_rope(q, cos, sin).to(v.dtype), kr, v)
            return run

        _, e6 = self.time_tables(torch.zeros(tokens.shape[0], 1, device=tokens.device))  # [B, 1, 6, D]
        self.run_layers(tokens, e6, self._text(context), attend, None)
        return SinkKV(ks, vs, pos_t, pos_h, pos_w, moves, c.ref_time)

    # -- one denoising step of one block ---------------------------------------------------------
    def audio_tokens(self, audio: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's wav2vec2 states `[B, L, C_a, T]` -> (global `[B, F, 1, D]`, local
        `[B, F, n+1, D]`): left-padded with `motion_frames` copies of the first video frame, encoded,
        the first `motion_latents` latent frames dropped."""
        c = self.config
        padded = torch.cat([audio[..., :1].expand(*audio.shape[:-1], c.motion_frames), audio], dim=-1)
        glob, loc = self.casual_audio_encoder(padded.to(self.head.modulation.device))
        glob, loc = glob[:, c.motion_latents:], loc[:, c.motion_latents:]
        if glob.shape[1] != frames:
            raise ValueError(f"audio of {audio.shape[-1]} video frames makes {glob.shape[1]} latent "
                             f"frames, the block has {frames} (give 4 video frames per latent frame)")
        return glob, loc

    def embed_block(self, x: torch.Tensor, t: torch.Tensor | float, audio: torch.Tensor, frame_start: int,
                    pose: torch.Tensor | None = None) -> BlockInputs:
        """Everything of a block the layers take (see `BlockInputs`; arguments as `forward_block`)."""
        b, f = x.shape[0], x.shape[2]
        p = self.patch_embedding(x.to(self.patch_embedding.weight.dtype))  # [B, D, F, h, w]
        if self.cond_encoder is not None:
            p = p + (self.cond_encoder.bias[None, :, None, None, None] if pose is None
                     else self.cond_encoder(pose.to(p.dtype)))
        hp, wp = p.shape[3], p.shape[4]
        tokens = p.flatten(3).permute(0, 2, 3, 1) + self.trainable_cond_mask.weight[0]  # [B, F, P, D]
        tt = torch.as_tensor(t, dtype=torch.float32, device=x.device)
        e, e6 = self.time_tables((tt[:, None] if tt.dim() == 1 else tt).expand(b, f))
        glob, loc = self.audio_tokens(audio, f)
        # positions: the block's frames at absolute times (the sink is placed by `block_attend`)
        pos_t = torch.arange(frame_start, frame_start + f, dtype=torch.float64).repeat_interleave(hp * wp)
        pos_h = torch.arange(hp, dtype=torch.float64).repeat_interleave(wp).repeat(f)
        pos_w = torch.arange(wp, dtype=torch.float64).repeat(hp * f)
        rope = self._rope(pos_t, pos_h, pos_w, x.device)
        return BlockInputs(tokens, e, e6, (glob, loc), (f, hp, wp), rope)

    def block_attend(self, emb: BlockInputs, sink: SinkKV, ring: KVRing, frame_start: int,
                     sink_distance: int, attention: AttentionFn | None = None) -> Callable[[int], LayerAttend]:
        """Layer i's self-attention of a block: q, k, v `[B, heads, F·P, hd]` of the whole block
        (before RoPE) -> the output. Writes the block's RoPE'd K and V into `ring` (this step's
        ring) before attending to [ring ; sink], the sink's reference keys placed `sink_distance`
        frames ahead (`sink.py`). Every op is per head, so `heads` may be any subset of the
        model's, as long as the ring and the sink hold the same (sequence parallelism: a head shard)."""
        attention = attention or self.attention
        f = emb.grid[0]
        cos, sin = emb.rope
        scos, ssin = self._rope(sink.times(frame_start, sink_distance), sink.h, sink.w, cos.device)

        def attend(i: int) -> LayerAttend:
            def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                ring.write(i, frame_start, f, apply_rope(k, cos, sin).to(v.dtype), v)
                rk, rv = ring.read(i)
                sk = apply_rope(sink.k[i], scos, ssin).to(v.dtype)
                keys, vals = torch.cat([rk, sk], dim=2), torch.cat([rv, sink.v[i]], dim=2)
                return attention(apply_rope(q, cos, sin).to(v.dtype), keys, vals)
            return run

        return attend

    def forward_block(self, x: torch.Tensor, t: torch.Tensor | float, audio: torch.Tensor,
                      context: torch.Tensor | TextKV, sink: SinkKV, ring: KVRing, frame_start: int,
                      sink_distance: int, *, attention: AttentionFn | None = None,
                      pose: torch.Tensor | None = None) -> torch.Tensor:
        """Velocity `[B, C, F, H, W]` of the block x `[B, C, F, H, W]` at timestep t (1000·σ: a
        scalar, `[B]` or `[B, F]`), whose first latent frame is the stream's `frame_start`.

        Writes the block's RoPE'd K and V into `ring` (this step's ring) before attending to it;
        the sink's reference keys are placed `sink_distance` frames ahead (`sink.py`). pose
        `[B, cond_dim, F, H, W]` or None (zeros: only the `cond_encoder` bias enters).

        The pieces (`embed_block`, `block_attend`, `run_layers`, `head`, `unpatchify`) are public
        so an executor can run the layers on a shard of the tokens (`parallel/sp_liveavatar.py`)."""
        emb = self.embed_block(x, t, audio, frame_start, pose)
        attend = self.block_attend(emb, sink, ring, frame_start, sink_distance, attention)
        h = self.run_layers(emb.tokens, emb.e6, self._text(context), attend, emb.audio)
        out = self.head(h, emb.e)  # [B, F, P, pt·ph·pw·C]
        return self.unpatchify(out, emb.grid)

    def unpatchify(self, out: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """Head output `[B, F, P, pt·ph·pw·C]` (channels last in a patch) -> `[B, C, F·pt, H, W]`."""
        f, hp, wp = grid
        pt, ph, pw = self.config.patch_size
        c = self.config.out_dim
        u = out.reshape(out.shape[0], f, hp, wp, pt, ph, pw, c)
        return torch.einsum("bfhwpqrc->bcfphqwr", u).reshape(out.shape[0], c, f * pt, hp * ph, wp * pw)
