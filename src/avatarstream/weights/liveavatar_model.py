"""A LiveAvatar download as the engine runs it: `--model liveavatar:DIR[,context=FILE][,fp8][,...]`.

The ModelSet of a folder (weights/liveavatar_folder.py finds and loads its files):
- dit: the Wan2.2-S2V-14B DiT with the LoRA merged (bf16 where bf16 is fast, with autocast: the
  shared blocks take q/k in fp32);
- vae: the Wan2.1 VAE (streamed, primed: engine/stages/liveavatar.py);
- audio: wav2vec2-large-xlsr-53 over a bounded window (models/wav2vec2/liveavatar_stream.py);
- text: the prompt's precomputed umT5 context (`avatarstream models encode-text`; the DiT never
  needs the 11 GB T5 at run time): `context=FILE`, else `ROOT/context.safetensors`;
- the settings of LiveAvatar's TPP pipeline: blocks of 3 latents, 4 Euler steps over its σ table,
  a ring of 4 blocks per step, AAS after clip 0, 720x400 video unless the folder's
  avatarstream.json or `--size` says otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from avatarstream.engine.config import ModelSet, PipelineConfig
from avatarstream.engine.module import Module, NotLoaded
from avatarstream.engine.offload import offload_blocks
from avatarstream.engine.pcm_stream import PCMFrames
from avatarstream.engine.stages.liveavatar import liveavatar_reference, liveavatar_stages
from avatarstream.errors import ConfigError, InputError
from avatarstream.weights.liveavatar_folder import (PREFIX, LiveAvatarFolder, load_liveavatar_dit, parse_name,
                                                    require_memory)
from avatarstream.weights.official import read_state
from avatarstream.weights.spec import ModelSpec
from avatarstream.weights.wan import load_wan_vae, wan_vae_config
from avatarstream.weights.wav2vec2 import load_wav2vec2_folder

CONTEXT_FILE = "context.safetensors"  # a folder's default prompt context (text_context.FILE)
PARTS = ("dit", "vae", "audio", "text")
DEFAULT_HW = (400, 720)  # height, width: the official 720*400 (90x50 latents)
LOOKAHEAD_FRAMES = 12  # audio a block waits for past its end (one block; liveavatar_stream.py)
# fp8: the blocks' and injectors' linears stored in fp8 (models/fp8.py); offload: the DiT's blocks
# kept in (pinned) host memory and onloaded one ahead (engine/offload.py): one GPU holds the rest
FLAGS = ("fp8", "offload")


class PromptContext(nn.Module):
    """LiveAvatar's text encoder at run time: the prompt's umT5 output, read from a context file.
    A session's prompt text cannot be encoded here (that needs the T5 weights): it must be the
    file's, or empty."""

    def __init__(self, context: torch.Tensor, prompt: str, path: Path) -> None:
        super().__init__()
        self.register_buffer("context", context, persistent=False)
        self.prompt, self.path = prompt, path

    def encode(self, prompts: list[str]) -> torch.Tensor:
        asked = [p for p in prompts if p and p != self.prompt]
        if asked:
            raise ConfigError(f"LiveAvatar takes its prompt as a precomputed context; {self.path} holds "
                              f"{self.prompt!r}, not {asked[0]!r}: run `avatarstream models encode-text "
                              "--prompt ...` and pass liveavatar:DIR,context=FILE")
        return self.context


def split_name(name: str) -> tuple[str, Path | None, set[str]]:
    """`liveavatar:DIR[,context=FILE][,fp8][,offload][,...]` -> (the name without our options,
    FILE or None, the flags given)."""
    parts = name.split(",")
    ctx = [p for p in parts if p.startswith("context=")]
    if len(ctx) > 1 or any(p == "context=" for p in ctx):
        raise ConfigError(f"{name!r}: give context=FILE once")
    flags = {p for p in parts[1:] if p in FLAGS}
    rest = [p for p in parts if not p.startswith("context=") and p not in flags]
    return ",".join(rest), (Path(ctx[0][8:]) if ctx else None), flags


def load_context(folder: LiveAvatarFolder, path: Path | None) -> PromptContext:
    from avatarstream.weights.liveavatar_layout import dit_config
    from avatarstream.weights.text_context import MAX_TOKENS, read_context, read_metadata

    p = path or folder.root / CONTEXT_FILE
    if path is None and not p.is_file():
        raise InputError(f"{folder.root}: no prompt context ({p} is missing). LiveAvatar's DiT reads the "
                         "prompt's umT5 output: make it once with `avatarstream models encode-text --ckpt "
                         f"{folder.base} --prompt \"...\" --out {p}`, or pass liveavatar:DIR,context=FILE")
    try:  # the DiT's text width and length, to refuse a context of another encoder before loading it
        cfg = dit_config(folder)
        dim, tokens = cfg.text_dim, cfg.text_len
    except InputError:  # a broken config.json: the DiT's check says so (one line)
        dim, tokens = None, MAX_TOKENS
    ctx = read_context(p, dim=dim, max_tokens=tokens, root=folder.root if path is None else None)
    return PromptContext(ctx.float(), str(read_metadata(p).get("prompt", "")), p)


def liveavatar_pipeline(folder: LiveAvatarFolder) -> PipelineConfig:
    """The TPP pipeline's settings (docs/real-models.md, LiveAvatar's "Generate" and "Streaming state") at the folder's size."""
    extra = folder.extra()
    h, w = int(extra.get("height", DEFAULT_HW[0])), int(extra.get("width", DEFAULT_HW[1]))
    return PipelineConfig(lr_size=h, hr_size=h, latent_channels=16, motion_dim=0, chunk=3, ref_frames=1,
                          steps=4, strategy="causal", block=3, kv_blocks=4, block_context=0,
                          adaptive_sink=True, audio_window=3 + LOOKAHEAD_FRAMES, latent_stride=4,
                          decode_overlap=False, scene_frame=False, height=h, width=w)


def load_liveavatar(folder: LiveAvatarFolder, name: str, context: Path | None, *, device: str = "cpu",
                    bf16: bool | None = None, fp8: bool = False, offload: bool = False,
                    parts: tuple[str, ...] = PARTS) -> ModelSet:
    """The ModelSet of a download (files and GPU memory checked before a tensor is read).

    fp8: the LoRA is merged first (fp32), then the linears LiveAvatar's `--fp8` quantises (every
    one in the blocks and the audio injectors) are stored in fp8 with a scale per row, half the
    bytes. offload: the DiT's blocks stay in host memory, onloaded one block ahead of the compute.
    parts: the networks to load (a pipeline-parallel rank's; the others are `NotLoaded`): the
    decode rank never reads the DiT's shards."""
    from avatarstream.hardware import bf16_is_fast

    config = liveavatar_pipeline(folder)
    text = load_context(folder, context)
    dt = torch.bfloat16 if (bf16_is_fast(device) if bf16 is None else bf16) else torch.float32
    h, w = config.out_hw
    mods: dict[str, Any] = {p: NotLoaded(p, "this") for p in ("dit", "vae", "audio")}
    if "dit" in parts:
        require_memory(folder, device, precision="fp8" if fp8 else ("bf16" if dt != torch.float32 else "fp32"),
                       offload=offload, height=h, width=w)
        dit = load_liveavatar_dit(folder, dtype=dt, device="cpu")
        if text.context.shape[-1] != dit.config.text_dim:
            raise InputError(f"{text.path}: a context of width {text.context.shape[-1]}, this DiT reads "
                             f"{dit.config.text_dim}")
        if fp8:
            from avatarstream.models.fp8 import LIVEAVATAR_FP8, quantize_linears_

            quantize_linears_(dit, names=LIVEAVATAR_FP8, device=device if torch.device(device).type == "cuda" else None)
        if offload:
            offload_blocks(dit, device)
        mods["dit"] = Module("dit", dit, device=device, dtype=dt, autocast_dtype=dt if dt != torch.float32 else None)
    if "vae" in parts:
        vae = load_wan_vae(read_state(folder.vae), wan_vae_config(folder.extra().get("wan_vae", {})),
                           what=str(folder.vae))
        mods["vae"] = Module("vae", vae, device=device)
    if "audio" in parts:
        w2v = load_wav2vec2_folder(folder.wav2vec)
        layers = config_layers(folder)
        if w2v.cfg.num_hidden_layers + 1 != layers:
            raise InputError(f"{folder.wav2vec}: {w2v.cfg.num_hidden_layers} layers; the DiT mixes {layers} "
                             "hidden states (wav2vec2-large-xlsr-53 has 24 layers)")
        mods["audio"] = Module("audio", w2v, device=device)
    spf = config.sample_rate // config.fps
    return ModelSet(name=name, refiner=None, text=Module("text", text, device=device), config=config,
                    make_audio_stream=lambda: PCMFrames(spf), stages=liveavatar_stages,
                    reference=liveavatar_reference, **mods)


def config_layers(folder: LiveAvatarFolder) -> int:
    """The wav2vec2 hidden states the folder's DiT mixes (its config; 25 for the release)."""
    from avatarstream.weights.liveavatar_folder import dit_config

    return dit_config(folder).audio_layers


def _built_by_folder() -> Any:
    raise ConfigError("a LiveAvatar folder's networks are built by its loader (load_model)")


def liveavatar_spec(name: str) -> ModelSpec | None:
    """The ModelSpec of a `liveavatar:DIR[,...]` name, or None for any other name."""
    if not name.startswith(PREFIX):
        return None
    rest, context, flags = split_name(name)
    folder = parse_name(rest)
    assert folder is not None
    return ModelSpec(name, _built_by_folder, None, _built_by_folder, _built_by_folder, _built_by_folder,
                     lambda: liveavatar_pipeline(folder), weights=folder.root,
                     description=f"LiveAvatar (Wan2.2-S2V-14B + LoRA) from {folder.root}",
                     load=lambda device, bf16, parts=PARTS: load_liveavatar(
                         folder, name, context, device=device, bf16=bf16, fp8="fp8" in flags,
                         offload="offload" in flags, parts=parts))
