"""LiveAvatar (Wan2.2-S2V-14B + the LiveAvatar LoRA) as a user downloads it, loaded and merged.

The official layout (docs/real-models.md, LiveAvatar's "Download"), the two Hugging Face repositories side by side:

    ROOT/Wan2.2-S2V-14B/   Wan-AI/Wan2.2-S2V-14B: config.json, the DiT as 4 safetensors shards +
                           diffusion_pytorch_model.safetensors.index.json, Wan2.1_VAE.pth,
                           wav2vec2-large-xlsr-53-english/ (a transformers folder), the umT5
                           encoder (models_t5_umt5-xxl-enc-bf16.pth, google/umt5-xxl/ tokenizer)
    ROOT/LiveAvatar/       Quark-Vision/Live-Avatar: liveavatar.safetensors (the LoRA)

`liveavatar:DIR[,lora=PATH][,wav2vec=PATH]` names it; DIR may be ROOT or either folder (the other
is looked for beside it). The umT5 encoder is not needed here: the DiT takes a precomputed text
context. What the release does not write is an optional `ROOT/avatarstream.json`
(`{"wan_vae": Wan VAE constructor kwargs, "height": px, "width": px}`, as the FlashHead folders);
`write_official_folder` writes a tiny random folder in this layout with it, for tests.

Loading never holds the checkpoint twice: the shards are memory-mapped, the DiT is built on the
meta device and filled in place in the wanted dtype (bf16 by default), the LoRA is merged one
module at a time (weights/lora.py). Before any tensor is read, the files are checked from their
headers (weights/check_liveavatar.py: one error naming the file and key) and, on CUDA, the GPU's
free memory against the chosen plan (weights/plans.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from avatarstream.errors import ConfigError, InputError
from avatarstream.models.liveavatar.config import OFFICIAL_DEFAULTS, LiveAvatarConfig
from avatarstream.weights.check_liveavatar import header_problems, plan_sizes
from avatarstream.weights.liveavatar_layout import (BASE_DIR, CLASS_NAME, DIT_FILE, INDEX_FILE, LIVEAVATAR,
                                                    LORA_DIR, LORA_FILE, PREFIX, SHARDS, SIDECAR, T5_FILE,
                                                    TOKENIZER_DIR, VAE_FILE, W2V_DIR, LiveAvatarFolder, dit_config,
                                                    is_download, locate, parse_name)
from avatarstream.weights.lora import LIVEAVATAR_LORA, merge_lora, target_modules
from avatarstream.weights.official import build_loaded, read_state

__all__ = ["BASE_DIR", "CLASS_NAME", "DIT_FILE", "INDEX_FILE", "LIVEAVATAR", "LORA_DIR", "LORA_FILE", "PREFIX",
           "SHARDS", "SIDECAR", "T5_FILE", "TOKENIZER_DIR", "VAE_FILE", "W2V_DIR", "LiveAvatarFolder",
           "build_liveavatar_dit", "dit_config", "is_download", "load_liveavatar_dit", "locate", "parse_name",
           "require_memory", "write_official_folder"]

def require_memory(folder: LiveAvatarFolder, device: str | torch.device, *,
                   free_bytes: Callable[[torch.device], int] | None = None, **plan: Any) -> None:
    """On a CUDA `device`: a ConfigError naming both numbers when what this GPU must hold under
    `plan` (weights/plans.py `rank_parts` keywords: role, precision, offload, sp, rings,
    with_vae; and the stream's height, width, steps, ring_blocks: default the folder's
    avatarstream.json, else 720x400) is more than it has free; from the files' headers, before any
    tensor is read. An estimate the check cannot make is left to the loader."""
    dev = torch.device(device)
    if dev.type != "cuda" and free_bytes is None:
        return
    from avatarstream.weights.check_memory import gb
    from avatarstream.weights.plans import rank_parts

    got = plan_sizes(folder)
    if got is None:
        return
    sizes, geo = got
    geo = replace(geo, **{k: plan.pop(k) for k in ("height", "width", "steps", "ring_blocks") if k in plan})
    parts = rank_parts(sizes, geo, **plan)
    need = sum(parts.values())
    free = (free_bytes or (lambda d: torch.cuda.mem_get_info(d)[0]))(dev)
    if need > free:
        detail = ", ".join(f"{k} {gb(v)}" for k, v in parts.items())
        raise ConfigError(f"{folder.root}: LiveAvatar needs about {gb(need)} on {dev} for this plan at "
                          f"{geo.label()} ({detail}); it has {gb(free)} free. Free the GPU or choose another "
                          "plan (`avatarstream models check` lists them)")


def build_liveavatar_dit(state: Mapping[str, torch.Tensor], config: LiveAvatarConfig, *,
                         dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
                         what: str = "LiveAvatar DiT") -> nn.Module:
    """`LiveAvatarDiT(config)` built on the meta device and filled in place with an official state
    dict (the shards' `read_state`, or a parity fixture's weights: the same key mapping)."""
    from avatarstream.models.liveavatar import LiveAvatarDiT

    ours = LIVEAVATAR.state_dict("dit", state)
    return build_loaded(lambda: LiveAvatarDiT(config), ours, what=what, dtype=dtype, device=device).eval()


def load_liveavatar_dit(folder: LiveAvatarFolder, *, dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cpu", merge_device: str | torch.device | None = None,
                        lora: bool = True, plan: dict[str, Any] | None = None) -> nn.Module:
    """The DiT with the LiveAvatar LoRA merged, in `dtype` on `device`. Refused before a tensor is
    read when a file is missing or does not fit (one InputError naming the file and key) or, on
    CUDA, when the GPU lacks the memory of `plan` (`require_memory`; default: the whole model
    resident on this GPU). merge_device: where the fp32 merge runs (default `device`). A GPU should
    merge the 448 pairs in about a second (an estimate: ~4 TFLOP and ~200 GB of traffic); this
    2-core CPU took 21 s for 72 full-width pairs, so about 2 minutes for all of them."""
    problems = header_problems(folder, lora=lora)
    if problems:
        raise InputError(problems[0] + (f" (and {len(problems) - 1} more problem(s): `avatarstream models "
                                        f"check {folder.root}` lists them)" if len(problems) > 1 else ""))
    require_memory(folder, device, **(plan or {"precision": "bf16" if dtype != torch.float32 else "fp32"}))
    net = build_liveavatar_dit(read_state(folder.index), dit_config(folder), dtype=dtype, device=device,
                               what=str(folder.index))  # the shards memory-mapped, filled in place
    if lora:
        merge_lora(net, read_state(folder.lora), LIVEAVATAR_LORA, what=str(folder.lora),
                   device=merge_device)
    return net.eval().requires_grad_(False)


# -- a tiny random folder in the official layout (tests, demos) -------------------------------------
TINY_VAE = {"dim": 4, "z_dim": 16, "dim_mult": [1, 1, 2, 2], "num_res_blocks": 1}


def official_config_json(cfg: LiveAvatarConfig) -> dict[str, Any]:
    """config.json as diffusers' ConfigMixin writes the official constructor's kwargs."""
    kw = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items() if k in OFFICIAL_DEFAULTS}
    return {"_class_name": CLASS_NAME, "_diffusers_version": "0.35.0", **kw}


def write_shards(folder: Path, state: dict[str, torch.Tensor], shards: int = SHARDS) -> Path:
    """`state` as `diffusion_pytorch_model-0000i-of-0000n.safetensors` + the index, keys in order."""
    from safetensors.torch import save_file

    keys = list(state)
    per = -(-len(keys) // shards)
    weight_map, total = {}, 0
    for i in range(shards):
        name = f"{DIT_FILE[:-len('.safetensors')]}-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k].contiguous() for k in keys[i * per:(i + 1) * per]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = folder / INDEX_FILE
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return index


def write_wav2vec2_folder(folder: Path, cfg: Any, g: torch.Generator) -> Path:
    """A random `Wav2Vec2ForCTC` folder as transformers saves it (`wav2vec2.` keys, a CTC head,
    config.json in transformers' field names) at our `Wav2Vec2Config` `cfg`."""
    from safetensors.torch import save_file

    from avatarstream.models.wav2vec2 import Wav2Vec2
    from avatarstream.weights.flashhead_folder import random_state

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {"wav2vec2." + k: t for k, t in random_state(Wav2Vec2(cfg), g).items()}
    vocab = 32
    tensors["lm_head.weight"], tensors["lm_head.bias"] = torch.randn(vocab, cfg.hidden_size, generator=g), torch.zeros(vocab)
    save_file(tensors, str(folder / "model.safetensors"))
    fields = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}
    (folder / "config.json").write_text(json.dumps({
        **fields, "model_type": "wav2vec2", "architectures": ["Wav2Vec2ForCTC"], "vocab_size": vocab,
        "num_feat_extract_layers": len(cfg.conv_dim)}, indent=1))
    return folder


def write_official_folder(root: str | Path, size: str = "tiny", seed: int = 0,
                          prompt: str | None = "a person talking") -> Path:
    """A tiny random LiveAvatar download: `Wan2.2-S2V-14B/` (config.json, the DiT in 4 bf16 shards
    with the index, a narrow Wan2.1 VAE, a 24-layer width-16 wav2vec2-large-like folder) and
    `LiveAvatar/liveavatar.safetensors` (a rank-128 adapter on every targeted module, bf16), with
    `avatarstream.json` for the VAE and a 64² stream, and (unless `prompt` is None) a random
    `context.safetensors` for `prompt`. Returns ROOT (what `liveavatar:ROOT` takes)."""
    from safetensors.torch import save_file

    from avatarstream.models.liveavatar import LiveAvatarDiT
    from avatarstream.models.wan.vae import WanVAE, WanVAEConfig
    from avatarstream.models.wav2vec2 import Wav2Vec2Config
    from avatarstream.weights.flashhead_folder import random_state

    if size != "tiny":
        raise ConfigError(f"write_official_folder writes the tiny layout, not {size!r}")
    root = Path(root)
    base, lora_dir = root / BASE_DIR, root / LORA_DIR
    for d in (base, lora_dir):
        d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    cfg = LiveAvatarConfig.tiny()
    state = random_state(LiveAvatarDiT(cfg), g)
    w = state["casual_audio_encoder.weights"]  # the forward divides by Σ silu(w): keep it far from 0
    state["casual_audio_encoder.weights"] = 1 + 0.2 * torch.randn(w.shape, generator=g)
    write_shards(base, {k: v.to(torch.bfloat16) for k, v in state.items()})
    (base / "config.json").write_text(json.dumps(official_config_json(cfg), indent=1))

    r = LIVEAVATAR_LORA.rank
    lora = {}
    for module, (o, i) in target_modules({k: tuple(v.shape) for k, v in state.items()}, LIVEAVATAR_LORA).items():
        lora[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, i, generator=g) / i ** 0.5
        lora[f"base_model.model.{module}.lora_B.weight"] = 0.05 * torch.randn(o, r, generator=g) / r ** 0.5
    save_file({k: v.to(torch.bfloat16) for k, v in lora.items()}, str(lora_dir / LORA_FILE))

    torch.save(random_state(WanVAE(WanVAEConfig.from_official(TINY_VAE)), g), str(base / VAE_FILE))
    audio = replace(Wav2Vec2Config.tiny(stable=True), num_hidden_layers=cfg.audio_layers - 1)
    write_wav2vec2_folder(base / W2V_DIR, audio, g)
    (root / SIDECAR).write_text(json.dumps({"wan_vae": TINY_VAE, "height": 64, "width": 64}))
    if prompt is not None:  # what `models encode-text` would write, here random: the folder runs as is
        from avatarstream.weights.text_context import write_context

        write_context(root / "context.safetensors", torch.randn(5, cfg.text_dim, generator=g), {"prompt": prompt})
    return root
