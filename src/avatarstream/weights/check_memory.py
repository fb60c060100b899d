"""The memory a FlashHead model needs, and whether this machine has it: the numbers of
`models check` (weights/check.py). These are estimates, and the report says how they are made:

- **Weights**: the tensors the networks use (not the file's dead ones), bf16 at 2 bytes each;
  fp8 puts the DiT blocks' matrices at 1 byte and keeps everything else bf16, which is what fp8
  weight-only quantisation stores (`flashhead-pro:DIR,fp8`: models/fp8.py). wav2vec2 stays fp32 in both, as the official pipeline runs it (docs/real-models.md, "The official FlashHead loop").
- **Activations** at 512² (the released models' size), per network, from the config: the
  networks of a chunk run one after another (audio, DiT, VAE), so a model's peak is its largest
  network's, not the sum. Each is a number of tensors of the network's widest size, that number
  measured once: the peak resident memory of one forward on the CPU in fp32 at 64²-512² with
  the real widths (it scales with the pixel count), divided by that size (see each function).
- **Reserve**: 1 GiB for the CUDA context, cuBLAS/cuDNN workspaces and allocator slack.

On a machine without CUDA the same model runs on the CPU in fp32: weights at 4 bytes, activations
at twice their bf16 size, no reserve; compared with the RAM available now (`MemAvailable`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from avatarstream.models.flashhead import FlashHeadConfig
from avatarstream.models.ltx import LTXVAEConfig, LTXVideoVAE
from avatarstream.models.wan.vae import WanVAE, WanVAEConfig
from avatarstream.models.wav2vec2 import Wav2Vec2, Wav2Vec2Config

RES = 512  # pixels per side of the activation estimates
CHUNK = 33  # video frames per FlashHead chunk (docs/real-models.md, "The official FlashHead loop")
AUDIO_WINDOW = 8 * 16000  # samples of the wav2vec2 window re-encoded every chunk
RESERVE = 1 << 30
WAN_LIVE = 12  # measured 12.1 (256², 512²; `bench vae --wan`): see wan_activation
LTX_LIVE = 8  # measured 7.5-7.8 (64², 128²): see ltx_activation
W2V_LIVE = 3  # measured 2.5 (8 s): see wav2vec2_activation
HOW = (f"weights: the used tensors in bf16 (fp8: DiT block matrices at 1 byte, the rest bf16; wav2vec2 "
       f"fp32); activations at {RES}x{RES}: the largest network's (they run one at a time), a count of "
       "its widest tensors measured once on the CPU at smaller sizes; plus "
       f"{RESERVE >> 30} GiB for the CUDA context and workspaces. CPU: fp32 weights and activations, "
       "no reserve. Estimates, not measurements of this folder.")


def dit_activation(cfg: FlashHeadConfig) -> tuple[int, str]:
    """One chunk's forward in bf16: at the FFN of a block the hidden state and its activation
    (2 × tokens × ffn_dim) live next to about 8 token-wide tensors (residual, normed input,
    q, k, v, attention output, modulated input, output). Attention runs through SDPA/flash,
    which never holds the tokens² matrix. Measured: 0.96-0.98 of this at 576 and 2304 tokens."""
    st, sh, sw = cfg.vae_stride
    _, ph, pw = cfg.patch
    frames = 1 + (CHUNK - 1) // st
    tokens = frames * (RES // (sh * ph)) * (RES // (sw * pw))
    return 2 * tokens * (2 * cfg.ffn_dim + 8 * cfg.dim), (
        f"{tokens} tokens ({frames} latents at {RES}²) × (2·{cfg.ffn_dim} FFN + 8·{cfg.dim}), bf16")


def wan_activation(cfg: WanVAEConfig) -> tuple[int, str]:
    """Decode (and encode) go one latent at a time, `temporal_factor` frames: the widest tensors
    are the full-resolution ones, dim·dim_mult[0] channels. A streaming decode holds the conv
    cache (two frames per causal conv: 5.9 of those tensors at the real width) and one latent's
    activations (its input, the normed and activated copies, the padded conv input, the conv
    output, the shortcut: 6.2): `bench vae --wan` peaked at 12.1 of them at 256² and 512²."""
    frames, width = cfg.temporal_factor, cfg.dim * cfg.dim_mult[0]
    return 2 * WAN_LIVE * frames * RES * RES * width, (
        f"{WAN_LIVE} × {frames} frames × {RES}² × {width} channels (one latent and the conv cache), bf16")


def ltx_activation(cfg: LTXVAEConfig) -> tuple[int, str]:
    """The LTX decoder cannot stream: a whole chunk (33 frames) goes through at once, and its
    widest tensors are the last stage's, at 512/patch pixels and decoder_block_out_channels[0]
    channels; the decode peaked at 7.5-7.8 of them."""
    side, width = RES // cfg.patch_size, cfg.decoder_block_out_channels[0]
    return 2 * LTX_LIVE * CHUNK * side * side * width, (
        f"{LTX_LIVE} × {CHUNK} frames × {side}² × {width} channels (a whole chunk), bf16")


def wav2vec2_activation(cfg: Wav2Vec2Config) -> tuple[int, str]:
    """The 8 s window re-encoded every chunk, fp32: the first conv's output (conv_dim[0] ×
    samples / stride) is the widest tensor; the forward peaked at 2.5 of its size (output, norm,
    GELU). The transformer then runs on 200 frames, which is small."""
    elems = cfg.conv_dim[0] * (AUDIO_WINDOW // cfg.conv_stride[0])
    return 4 * W2V_LIVE * elems, (
        f"{W2V_LIVE} × {cfg.conv_dim[0]} × {AUDIO_WINDOW // cfg.conv_stride[0]} (8 s window), fp32")


RELEASED: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[int, str]]]] = {
    "wan-vae": (lambda: WanVAE(WanVAEConfig()), lambda: wan_activation(WanVAEConfig())),
    "ltx-vae": (lambda: LTXVideoVAE(LTXVAEConfig()), lambda: ltx_activation(LTXVAEConfig())),
    "wav2vec2": (lambda: Wav2Vec2(Wav2Vec2Config.base()), lambda: wav2vec2_activation(Wav2Vec2Config.base())),
}


def assumed(family: str) -> dict[str, Any]:
    """The numbers of a released network that is not in the checked folder (built on the meta
    device for its parameter count)."""
    build, act = RELEASED[family]
    with torch.device("meta"):
        n = sum(t.numel() for t in build().state_dict().values())
    per = 4 if family == "wav2vec2" else 2
    act_bytes, _ = act()
    return {"weight_bytes": {"bf16": per * n, "fp8": per * n, "fp32": 4 * n}, "activation_bytes": act_bytes}


def machine() -> dict[str, Any]:
    """CUDA (the first device's name and free memory) and the RAM available now."""
    out: dict[str, Any] = {"cuda": False, "gpu": None, "gpu_free_bytes": None, "gpu_total_bytes": None,
                           "ram_available_bytes": None}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    out["ram_available_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    if torch.cuda.is_available():
        try:
            free, total = torch.cuda.mem_get_info(0)
            out.update(cuda=True, gpu=torch.cuda.get_device_name(0), gpu_free_bytes=free, gpu_total_bytes=total)
        except RuntimeError as e:  # a driver that cannot give memory: say so, answer as without CUDA
            out["gpu"] = f"unusable ({e})"
    return out


def gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def verdict(gpu: dict[str, int], cpu: int, m: dict[str, Any]) -> tuple[bool, str]:
    """Whether this machine can run a model that needs `gpu` (per precision) or `cpu` bytes."""
    if m["cuda"]:
        free = m["gpu_free_bytes"]
        if gpu["bf16"] <= free:
            return True, f"yes: {m['gpu']}, bf16 needs {gb(gpu['bf16'])} of {gb(free)} free"
        if gpu["fp8"] <= free:
            return False, (f"not in bf16 ({gb(gpu['bf16'])} needed, {gb(free)} free on {m['gpu']}); "
                           "fp8 weights would fit: add ,fp8 to the model name")
        return False, f"no: bf16 needs {gb(gpu['bf16'])}, {m['gpu']} has {gb(free)} free"
    ram = m["ram_available_bytes"]
    if ram is None or cpu <= ram:
        return True, (f"no CUDA device: on the CPU in fp32 (about {gb(cpu)} of RAM, {gb(ram)} available), "
                      "far below real time")
    return False, f"no CUDA device, and on the CPU fp32 needs about {gb(cpu)} of RAM ({gb(ram)} available)"


def budget(parts: Sequence[dict[str, Any]], m: dict[str, Any]) -> dict[str, Any]:
    """The memory of networks that run together (`weight_bytes`, `activation_bytes` each) on
    the GPU and on the CPU, and this machine's verdict."""
    weights = {p: sum(v["weight_bytes"][p] for v in parts) for p in ("bf16", "fp8", "fp32")}
    act = max(v["activation_bytes"] for v in parts)
    gpu = {p: weights[p] + act + RESERVE for p in ("bf16", "fp8")}
    cpu = weights["fp32"] + 2 * act
    runs, why = verdict(gpu, cpu, m)
    return {"weight_bytes": weights, "activation_bytes": act, "gpu_bytes": gpu, "cpu_bytes": cpu,
            "runs_here": runs, "verdict": why}


def models(nets: Sequence[Any], vae_of: dict[str, str], m: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """One budget per FlashHead DiT whose file was read (its VAE and wav2vec2 from the same check
    where read, else the released ones' numbers, listed as `assumed`), and the problems of the combination
    (a wav2vec2 whose layers × width is not what the DiT's audio projection takes)."""
    out: dict[str, Any] = {}
    problems: list[str] = []
    audio = next((n for n in nets if n.family == "wav2vec2" and n.weight_bytes), None)
    for dit in (n for n in nets if n.family == "flashhead-dit" and n.weight_bytes):
        name = f"flashhead-{dit.variant}"
        name = name if name not in out else f"{name} ({dit.name})"
        vae = next((n for n in nets if n.family == vae_of[dit.variant] and n.weight_bytes), None)
        parts = {"dit": dit.to_json(), "vae": vae and vae.to_json(), "audio": audio and audio.to_json()}
        fam = {"vae": vae_of[dit.variant], "audio": "wav2vec2"}
        missing = [fam[k] for k, v in parts.items() if v is None]
        parts = {k: v or assumed(fam[k]) for k, v in parts.items()}
        out[name] = {"networks": {k: (v.get("name") or f"{fam[k]} (released size assumed)") for k, v in parts.items()},
                     "assumed": missing, **budget(list(parts.values()), m)}
        a = dit.config.audio
        if audio is not None and (audio.config.num_hidden_layers, audio.config.hidden_size) != (a.layers, a.channels):
            problems.append(f"{audio.name}: wav2vec2 gives {audio.config.num_hidden_layers} layers × "
                            f"{audio.config.hidden_size}, {dit.name}'s audio projection takes {a.layers} × "
                            f"{a.channels} (FlashHead needs wav2vec2-base-960h)")
    return out, problems
