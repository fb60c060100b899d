"""GPU memory plans for LiveAvatar (Wan2.2-S2V-14B + LoRA): what each GPU holds when the model runs
on one GPU with offload, on two with sequence parallelism, or as 4 denoising ranks plus a decode
rank (TPP), and what a 24 GB or 48 GB card can do. `models check` prints them; the loader refuses a
plan the GPU cannot hold before it reads a tensor (weights/liveavatar_folder.py).

Every number is computed from the checked files and the config, none is typed in:
- **Weights**: the DiT's stored tensors at 2 bytes (bf16) or, in fp8, its blocks' and audio
  injectors' matrices at 1 byte and the rest at 2 (weight-only fp8 after the LoRA merge,
  as LiveAvatar's own `--fp8`). Offloaded: the DiT's blocks live in pinned CPU memory, and the GPU holds
  what is not in a block plus two offload units (a block and its audio injector), the one
  running and the one being copied in.
- **KV ring of one denoising step** (docs/real-models.md, "Streaming state"): layers × (K, V) × ring tokens × dim ×
  2 bytes, ring tokens = ring blocks × frames per block × tokens per latent frame; 11.1 GB at
  720×400. Each step has its own ring: a single GPU holds all `steps` of them, a TPP rank one.
- **Sink**: the same per token, over the reference latent plus the FramePack tokens
  (1 latent at full grid, 2 at half, 16 at quarter: the official motioner's valid convolutions).
  The official pipeline prefills one per step cache, but the passes are identical: our engine
  (engine/liveavatar.py) makes one and shares it between the steps of a process, so a GPU holds
  one sink whatever its step count.
- **Activations**: one block's forward (its tokens: the FFN's 2 × ffn_dim next to ~8 token-wide
  tensors, as check_memory.dit_activation) plus each layer's keys and values gathered for
  attention over ring + sink; or the Wan VAE's streaming decode at this size
  (check_memory.wan_activation's measured count), whichever is larger where both run on a GPU.
  Sequence parallelism splits the tokens and the heads, so a rank holds 1/n of the rings,
  the sink and the block activations.
- **Reserve**: check_memory.RESERVE for the CUDA context and workspaces.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from avatarstream.weights.check_memory import RESERVE, WAN_LIVE, gb

GiB = 1 << 30
HOW = ("LiveAvatar: DiT weights bf16, or fp8 for the block and injector matrices; a KV ring per denoising step "
       "(layers x K,V x ring tokens x dim x 2 bytes) and one sink its steps share (reference + FramePack tokens); "
       "activations of one "
       "block's forward or of the VAE's streaming decode at the stream size; 1 GiB reserve. Estimates from the "
       "config and the files' headers, not measurements.")
# usable memory of the cards the plans are for, as `torch.cuda.mem_get_info` reports them in total
CARDS = {"80GB": int(79.2 * GiB),  # H100 / A100 80 GB
         "48GB": int(44.9 * GiB),  # L40S (an RTX A6000 has 47.5 GiB)
         "24GB": int(23.6 * GiB)}  # RTX 4090 / A10 / L4-class 24 GB cards, less display memory


@dataclass(frozen=True)
class Geometry:
    """The stream's size: video pixels, latent and patch strides, causal blocks and the KV ring."""

    width: int = 720
    height: int = 400
    spatial: int = 8  # VAE spatial stride
    patch: tuple[int, int] = (2, 2)  # DiT patch (h, w)
    block_frames: int = 3  # latent frames per causal block
    ring_blocks: int = 4  # blocks in a step's KV ring, the current one included
    steps: int = 4  # denoising steps, one KV ring each
    framepack: tuple[int, int, int] = (1, 2, 16)  # motion latents at 1x, 2x, 4x compression

    @property
    def grid(self) -> tuple[int, int]:
        return self.height // self.spatial // self.patch[0], self.width // self.spatial // self.patch[1]

    @property
    def tokens_per_frame(self) -> int:
        h, w = self.grid
        return h * w

    @property
    def ring_tokens(self) -> int:
        return self.ring_blocks * self.block_frames * self.tokens_per_frame

    @property
    def sink_tokens(self) -> int:
        """Reference latent + FramePack: n latents at compression c give n/c frames of (h/c)·(w/c)."""
        h, w = self.grid
        packed = sum(n // c * (h // c) * (w // c) for n, c in zip(self.framepack, (1, 2, 4)))
        return self.tokens_per_frame + packed

    def label(self) -> str:
        return f"{self.width}x{self.height}"


@dataclass(frozen=True)
class Sizes:
    """A LiveAvatar model's weights (bytes by precision) and widths, as checked."""

    dim: int
    layers: int
    ffn_dim: int
    dit: dict[str, int]  # the whole DiT: {"bf16", "fp8", "fp32"}
    unit: dict[str, int]  # the largest offload unit: a block and its audio injector
    resident: dict[str, int]  # what stays on the GPU when the blocks are offloaded
    vae: int  # Wan VAE weights, bf16
    audio: int  # wav2vec2 weights, bf16 (the official TPP runs it in bf16)
    vae_width: int = 96  # the VAE's full-resolution channels (dim · dim_mult[0])
    vae_frames: int = 4  # video frames per latent


BLOCK = re.compile(r"blocks\.(\d+)\.")
INJECTOR = re.compile(r"audio_injector\.\w+\.(\d+)\.")


def fp8_weight(key: str, shape: Sequence[int]) -> bool:
    """Whether fp8 weight-only quantisation stores this DiT tensor at 1 byte: the linear matrices
    of the blocks and the audio injectors (the bulk: 15.9 of 16.3 B parameters)."""
    return len(shape) == 2 and key.endswith(".weight") and key.startswith(("blocks.", "audio_injector."))


def dit_sizes(shapes: Mapping[str, Sequence[int]], inject_layers: Sequence[int],
              fp8: Callable[[str, Sequence[int]], bool] = fp8_weight) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(whole, largest offload unit, resident) bytes by precision of a DiT's tensors: a unit is
    block N with the audio injector that runs after it (`inject_layers[J] == N`)."""
    after = {j: n for j, n in enumerate(inject_layers)}
    def zero() -> dict[str, int]:
        return {"bf16": 0, "fp8": 0, "fp32": 0}

    whole, resident = zero(), zero()
    units: dict[int, dict[str, int]] = {}
    for key, shape in shapes.items():
        n = math.prod(shape)
        size = {"bf16": 2 * n, "fp8": n if fp8(key, shape) else 2 * n, "fp32": 4 * n}
        b, i = BLOCK.match(key), INJECTOR.match(key)
        block = int(b[1]) if b else after.get(int(i[1])) if i else None
        target = resident if block is None else units.setdefault(block, zero())
        for p in size:
            target[p] += size[p]
            whole[p] += size[p]
    unit = max(units.values(), key=lambda u: u["bf16"], default=zero())
    return whole, unit, resident


def kv_bytes_per_token(s: Sizes) -> int:
    return s.layers * 2 * s.dim * 2  # every layer's K and V, bf16


def dit_activation(s: Sizes, g: Geometry, sp: int = 1) -> int:
    tokens = g.block_frames * g.tokens_per_frame
    keys = g.ring_tokens + g.sink_tokens
    return (2 * tokens * (2 * s.ffn_dim + 8 * s.dim) + 2 * 2 * keys * s.dim) // sp


def vae_activation(s: Sizes, g: Geometry) -> int:
    return 2 * WAN_LIVE * s.vae_frames * g.width * g.height * s.vae_width


def rank_parts(s: Sizes, g: Geometry, *, role: str = "dit", precision: str = "bf16", offload: bool = False,
               sp: int = 1, rings: int | None = None, with_vae: bool = True) -> dict[str, int]:
    """What one GPU holds, by part. role "vae": the decode rank (VAE + wav2vec2); role "dit": the
    DiT in `precision`, offloaded or resident, `rings` step caches (default: every step's; a TPP
    rank: 1) and the sink they share, split `sp` ways by sequence parallelism, with the VAE and wav2vec2 too when `with_vae`.
    precision "fp32" (a GPU run without bf16) also doubles the caches and the DiT's activations."""
    if role == "vae":
        return {"VAE + wav2vec2 weights": s.vae + s.audio, "VAE decode activations": vae_activation(s, g),
                "CUDA reserve": RESERVE}
    rings = g.steps if rings is None else rings
    wide = 2 if precision == "fp32" else 1  # fp32 runs keep caches and activations in fp32 too
    kv = wide * kv_bytes_per_token(s)
    parts = {f"DiT weights ({precision}{', offloaded' if offload else ''})":
             s.resident[precision] + 2 * s.unit[precision] if offload else s.dit[precision],
             f"KV rings ({rings} x {gb(kv * g.ring_tokens)}{f' / {sp}' if sp > 1 else ''})": rings * kv * g.ring_tokens // sp,
             f"sink{' (one, shared by the steps)' if rings > 1 else ''}{f' / {sp}' if sp > 1 else ''}":
             kv * g.sink_tokens // sp}
    act = wide * dit_activation(s, g, sp)
    if with_vae:
        parts["VAE + wav2vec2 weights"] = s.vae + s.audio
        act = max(act, vae_activation(s, g))
    parts["activations"] = act
    parts["CUDA reserve"] = RESERVE
    return parts


def _rank(parts: dict[str, int], count: int = 1) -> dict[str, Any]:
    return {"count": count, "bytes": sum(parts.values()), "parts": parts}


def _plan(gpus: str, card: str, ranks: dict[str, dict[str, Any]], how: str, host: int = 0) -> dict[str, Any]:
    need = max(r["bytes"] for r in ranks.values())
    return {"gpus": gpus, "card_bytes": CARDS[card], "per_gpu_bytes": need, "fits": need <= CARDS[card],
            "host_pinned_bytes": host, "ranks": ranks, "how": how}


def plans(s: Sizes, g: Geometry) -> dict[str, dict[str, Any]]:
    """The three topologies of issue 29 at geometry `g`."""
    offloaded = s.dit["fp8"] - s.resident["fp8"]
    return {
        "1x80GB": _plan("1 x 80 GB", "80GB", {"gpu": _rank(rank_parts(s, g, precision="fp8", offload=True))},
                        "fp8 weights, blocks offloaded to pinned CPU memory and onloaded one ahead; every "
                        "step's KV ring and the sink on the GPU", host=offloaded),
        "2x80GB": _plan("2 x 80 GB", "80GB", {
            "rank 0": _rank(rank_parts(s, g, sp=2)), "rank 1": _rank(rank_parts(s, g, sp=2, with_vae=False))},
            "bf16 weights on both ranks; sequence parallelism (Ulysses) splits tokens and heads, so each "
            "rank keeps half of every KV ring and of the sink; rank 0 also decodes"),
        "4+1": _plan("4 + 1 x 80 GB", "80GB", {
            "DiT rank": _rank(rank_parts(s, g, rings=1, with_vae=False), count=g.steps),
            "VAE rank": _rank(rank_parts(s, g, role="vae"))},
            f"TPP: {g.steps} DiT ranks, each with the whole bf16 DiT and its own step's KV ring and sink, "
            "and one decode rank (VAE + wav2vec2)"),
    }


def _fits(s: Sizes, g: Geometry, capacity: int, **kw: Any) -> bool:
    return sum(rank_parts(s, g, **kw).values()) <= capacity


def card(s: Sizes, g: Geometry, name: str) -> dict[str, Any]:
    """What one card of `CARDS[name]` can do: the single-GPU plan (fp8 + offload) at `g`; the
    largest size of `g`'s aspect (steps of 1/5 of it) and the longest KV ring that fit it; the
    TPP roles it can take."""
    cap = CARDS[name]
    single = rank_parts(s, g, precision="fp8", offload=True)
    sizes = [replace(g, width=g.width * k // 5 // 16 * 16, height=g.height * k // 5 // 16 * 16) for k in (5, 4, 3, 2, 1)]
    largest = next((x for x in sizes if _fits(s, x, cap, precision="fp8", offload=True)), None)
    ring = next((r for r in range(g.ring_blocks, 0, -1)
                 if _fits(s, replace(g, ring_blocks=r), cap, precision="fp8", offload=True)), 0)
    roles = [f"TPP DiT rank ({p})" for p in ("bf16", "fp8") if _fits(s, g, cap, precision=p, rings=1, with_vae=False)]
    roles += ["TPP VAE rank"] if _fits(s, g, cap, role="vae") else []
    return {"card_bytes": cap, "single_gpu_bytes": sum(single.values()), "single_gpu_fits": sum(single.values()) <= cap,
            "largest_size": largest and largest.label(), "ring_blocks_at_size": ring, "tpp_roles": roles}


def describe_plans(p: Mapping[str, Any]) -> list[str]:
    """`models check`'s lines for a model's plans and cards."""
    g = p["geometry"]
    lines = [f"    memory plans at {g['size']} ({g['tokens_per_frame']} tokens a latent frame; one step's KV ring "
             f"{gb(g['ring_bytes'])}, sink {gb(g['sink_bytes'])}):"]
    for name, plan in p["plans"].items():
        ranks = ", ".join(f"{r['count']} x {k} {gb(r['bytes'])}" if r["count"] > 1 else f"{k} {gb(r['bytes'])}"
                          for k, r in plan["ranks"].items())
        host = f", {gb(plan['host_pinned_bytes'])} pinned CPU" if plan["host_pinned_bytes"] else ""
        lines.append(f"      {plan['gpus']}: {ranks}{host}: {'fits' if plan['fits'] else 'does NOT fit'}")
    for name, c in p["cards"].items():
        roles = ", ".join(c["tpp_roles"]) or "no TPP role"
        lines.append(f"      one {name} card: single GPU at {g['size']} needs {gb(c['single_gpu_bytes'])} "
                     f"({'fits' if c['single_gpu_fits'] else 'no'}); largest size that fits: {c['largest_size'] or 'none'}; "
                     f"KV ring at {g['size']}: {c['ring_blocks_at_size']} block(s); {roles}")
    return lines


def memory_plans(s: Sizes, g: Geometry | None = None) -> dict[str, Any]:
    """Everything `models check` reports on memory for one LiveAvatar model (JSON-serialisable)."""
    g = g or Geometry()
    kv = kv_bytes_per_token(s)
    geometry = {"size": g.label(), "tokens_per_frame": g.tokens_per_frame, "ring_tokens": g.ring_tokens,
                "sink_tokens": g.sink_tokens, "ring_bytes": kv * g.ring_tokens, "sink_bytes": kv * g.sink_tokens,
                "dit_activation_bytes": dit_activation(s, g), "vae_activation_bytes": vae_activation(s, g),
                "steps": g.steps, "ring_blocks": g.ring_blocks, "block_frames": g.block_frames}
    return {"geometry": geometry, "plans": plans(s, g), "cards": {n: card(s, g, n) for n in ("48GB", "24GB")},
            "how": HOW}
