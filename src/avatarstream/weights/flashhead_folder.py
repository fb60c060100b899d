"""SoulX-FlashHead-1.3B as a user downloads it, loaded into a `ModelSet` our engine runs.

The official layout (docs/real-models.md, "Download"), one folder given as `--model flashhead-pro:DIR`:

    DIR/Model_Pro/   config.json, diffusion_pytorch_model.safetensors     (the DiT)
    DIR/Model_Lite/  config.json, diffusion_pytorch_model.safetensors
    DIR/VAE_Wan/     Wan2.1_VAE.pth                                        (Pro's VAE)
    DIR/VAE_LTX/     config.json, diffusion_pytorch_model.safetensors     (Lite's VAE)
    wav2vec2-base-960h/   a Hugging Face wav2vec2 folder: DIR/wav2vec2-base-960h, or beside DIR,
                          or given: `flashhead-pro:DIR,wav2vec=PATH`

Every file goes through the same loader the parity fixtures check (`load_flashhead_dit`,
`load_wan_vae`, `load_wav2vec2_folder`). Sizes come from the files: the DiT's config.json, the
audio projection's widths from its tensors and the paired wav2vec2 (the official module hard-codes
them for wav2vec2-base). What the official release does not write is an optional
`DIR/avatarstream.json`: `{"size": pixels, "height": pixels, "width": pixels, "wan_vae": Wan VAE
constructor kwargs}` (height and width together: a non-square video); without it, 512² and the real
Wan2.1 VAE. `generate --size WxH` renders another size without touching the folder. `write_official_folder` writes a tiny random folder in this layout (with
that file: 64 px, a narrow Wan VAE) for tests and demos.

Lite (LTX VAE, 8 frames a latent) needs the chunk loop to plan with the model's stride
(`PipelineConfig.latent_stride`: engine/loop.py's `make_config_schedule` must pass it on).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from avatarstream.engine.config import ModelSet, PipelineConfig
from avatarstream.engine.module import Module
from avatarstream.engine.pcm_stream import PCMFrames
from avatarstream.engine.stages.flashhead import flashhead_reference, flashhead_stages
from avatarstream.errors import ConfigError, InputError
from avatarstream.models.flashhead import FlashHeadConfig
from avatarstream.weights.check_networks import flashhead_problems
from avatarstream.weights.flashhead import load_flashhead_dit
from avatarstream.weights.official import read_state
from avatarstream.weights.spec import ModelSpec
from avatarstream.weights.validate import confine, flashhead_dit, read_json, sidecar
from avatarstream.weights.wan import load_wan_vae, wan_vae_config
from avatarstream.weights.wav2vec2 import load_wav2vec2_folder

VARIANTS = {"pro": ("Model_Pro", "VAE_Wan"), "lite": ("Model_Lite", "VAE_LTX")}
DIT_FILE, WAN_FILE, W2V_DIR, SIDECAR = "diffusion_pytorch_model.safetensors", "Wan2.1_VAE.pth", \
    "wav2vec2-base-960h", "avatarstream.json"
PREFIX = "flashhead-"


@dataclass(frozen=True)
class FlashHeadFolder:
    root: Path
    variant: str
    wav2vec: Path
    fp8: bool = False  # `,fp8`: the DiT blocks' linears stored in fp8 (models/fp8.py)

    @property
    def model_dir(self) -> Path:
        return self.root / VARIANTS[self.variant][0]

    @property
    def vae_dir(self) -> Path:
        return self.root / VARIANTS[self.variant][1]

    def extra(self) -> dict[str, Any]:
        """ROOT/avatarstream.json, checked (validate.sidecar: sizes in range); {} without one."""
        return sidecar(confine(self.root / SIDECAR, self.root))

    def config(self) -> dict[str, Any]:
        """The DiT's config.json, checked against the FlashHead schema (validate.flashhead_dit)."""
        path = confine(self.model_dir / "config.json", self.root)
        raw = read_json(path)
        flashhead_dit(raw, str(path))
        return raw


def parse_name(name: str) -> FlashHeadFolder | None:
    """`flashhead-pro:DIR[,wav2vec=PATH][,fp8]` -> the folder (files checked); None: not such a name."""
    head, sep, rest = name.partition(":")
    if not (sep and head.startswith(PREFIX)):
        return None
    fp8 = rest.endswith(",fp8") or ",fp8," in rest
    rest = rest.replace(",fp8,", ",").removesuffix(",fp8")
    variant = head[len(PREFIX):]
    if variant not in VARIANTS:
        raise ConfigError(f"{name!r}: unknown FlashHead variant {variant!r}; use flashhead-pro or flashhead-lite")
    root, _, opt = rest.partition(",wav2vec=")
    root_p = Path(root)
    cands = [Path(opt)] if opt else [root_p / W2V_DIR, root_p.parent / W2V_DIR]
    w2v = next((c for c in cands if (c / "config.json").is_file()), cands[0])
    folder = FlashHeadFolder(root_p, variant, w2v, fp8)
    vae = [WAN_FILE] if variant == "pro" else ["config.json", DIT_FILE]
    need = [folder.model_dir / "config.json", folder.model_dir / DIT_FILE,
            *(folder.vae_dir / f for f in vae), w2v / "config.json"]
    missing = [str(p) for p in need if not p.is_file()]
    if missing:
        raise InputError(f"{root}: not a SoulX-FlashHead-1_3B download ({missing[0]} is missing; "
                         f"wav2vec2 is looked for in {' and '.join(map(str, cands))})")
    return folder


def flashhead_pipeline(folder: FlashHeadFolder) -> PipelineConfig:
    """The official inference settings (configs/infer_params.yaml): 33-frame chunks (Pro 9
    latents of 4 frames, Lite 5 of 8), 2 motion latents, 4 re-noising steps at shift 5, colour
    correction 1.0; the latent width and patch from the DiT's config.json; the video size from
    `avatarstream.json` (512² without one). Geometry: Pro's Wan latents are 8x smaller and
    patched 2x2 (sides multiples of 16 pixels), Lite's LTX latents 32x smaller, patch 1 (32)."""
    extra = folder.extra()
    size = int(extra.get("size", 512))
    stride, spatial = (4, 8) if folder.variant == "pro" else (8, 32)
    raw = folder.config()
    channels, patch = raw["out_dim"], raw["patch_size"][-1]
    hw = {k: extra[k] for k in ("height", "width") if k in extra}
    try:
        return PipelineConfig(lr_size=size, hr_size=size, latent_channels=channels, motion_dim=1,
                              chunk=1 + 32 // stride, ref_frames=1, steps=4, sampler="renoise", shift=5.0,
                              strategy="handoff", overlap=2, audio_window=stride - 4, latent_stride=stride,
                              decode_overlap=False, scene_frame=False, spatial_stride=spatial, patch_size=patch,
                              **hw)
    except ConfigError as e:
        raise ConfigError(f"{folder.root / SIDECAR}: {e}") from None


class WholeChunkLTX(nn.Module):
    """Lite's LTX-Video VAE as the engine calls it: whole-chunk encode (the mode: docs/real-models.md,
    FlashHead's differences; the official `.sample()` is not reproduced) and decode (not clamped, as
    the official one), and no conv cache (it cannot stream)."""

    def __init__(self, vae: nn.Module) -> None:
        super().__init__()
        self.vae = vae
        self.temporal_factor = vae.temporal_factor

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        return self.vae.encode(video)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(z)

    def new_cache(self) -> None:
        return None


def _load_vae(folder: FlashHeadFolder) -> nn.Module:
    if folder.variant == "pro":
        return load_wan_vae(read_state(folder.vae_dir / WAN_FILE), wan_vae_config(folder.extra().get("wan_vae", {})),
                            what=str(folder.vae_dir / WAN_FILE))
    from avatarstream.weights.ltx import load_ltx_vae

    raw = read_json(confine(folder.vae_dir / "config.json", folder.root))
    return WholeChunkLTX(load_ltx_vae(read_state(folder.vae_dir / DIT_FILE), raw, what=str(folder.vae_dir)))


def _dit_config(folder: FlashHeadFolder, state: dict[str, torch.Tensor], w2v: nn.Module) -> FlashHeadConfig:
    raw = folder.config()
    try:
        dim = int(raw["dim"])
        audio = {"blocks": w2v.cfg.num_hidden_layers, "channels": w2v.cfg.hidden_size,
                 "intermediate_dim": int(state["audio_proj.proj1.weight"].shape[0]),
                 "context_tokens": int(state["audio_proj.proj3.weight"].shape[0]) // dim, "output_dim": dim}
        return FlashHeadConfig.from_official(raw, audio)
    except (KeyError, ValueError, TypeError) as e:
        raise InputError(f"{folder.model_dir}: not a FlashHead DiT ({e})") from None


class NoText(nn.Module):
    """FlashHead has no text encoder: prompts encode to nothing."""

    def encode(self, prompts: list[str]) -> tuple[None, None]:
        return None, None


def check_gpu_memory(folder: FlashHeadFolder, device: str, bf16: bool) -> None:
    """On a CUDA `device`: a ConfigError naming both numbers when the memory the folder needs
    (`models check`'s estimate, from the files' headers: weights/check_memory.py) is more than
    the GPU has free, before any tensor is read; loading would otherwise fail minutes later with an
    out-of-memory error halfway through the weights. fp32 on the GPU (no bf16): the CPU estimate
    plus the CUDA reserve. An estimate the check cannot make (a damaged folder) is left to the
    loader, whose errors name the file."""
    if torch.device(device).type != "cuda":
        return
    from avatarstream.weights import check_memory as mem
    from avatarstream.weights.check import check_folder

    model = check_folder(folder.root)["models"].get(f"{PREFIX}{folder.variant}")
    if model is None:
        return
    kind = "fp8" if folder.fp8 else ("bf16" if bf16 else "fp32")
    need = model["gpu_bytes"][kind] if kind != "fp32" else model["cpu_bytes"] + mem.RESERVE
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    if need > free:
        raise ConfigError(f"{folder.root}: {PREFIX}{folder.variant} needs about {mem.gb(need)} of GPU memory "
                          f"({kind}), {device} has {mem.gb(free)} free; free the GPU "
                          "or use --device cpu (`avatarstream models check` shows the estimate)")


def load_flashhead(folder: FlashHeadFolder, name: str, *, device: str = "cpu",
                   bf16: bool | None = None) -> ModelSet:
    """The ModelSet of a downloaded folder: DiT (bf16 autocast where fast), Wan VAE, wav2vec2.
    On CUDA, refused up front when the GPU lacks the memory (`check_gpu_memory`)."""
    from avatarstream.hardware import bf16_is_fast

    config = flashhead_pipeline(folder)
    # bf16 where it is fast (a GPU, an AVX512-bf16 CPU): the DiT's weights are cast tensor by tensor
    # while they are assigned (half the memory of the fp32 files) and its forward autocasts
    dt = torch.bfloat16 if (bf16_is_fast(device) if bf16 is None else bf16) else torch.float32
    problems = flashhead_problems(folder.model_dir, folder.vae_dir, folder.wav2vec, folder.root)
    if problems:  # the files as `models check` sees them, before a tensor is read
        raise InputError(problems[0] + (f" (and {len(problems) - 1} more problem(s): `avatarstream models check "
                                        f"{folder.root}` lists them)" if len(problems) > 1 else ""))
    check_gpu_memory(folder, device, dt == torch.bfloat16)
    w2v = load_wav2vec2_folder(folder.wav2vec)
    state = read_state(folder.model_dir / DIT_FILE)
    dit = load_flashhead_dit(state, _dit_config(folder, state, w2v), dtype=dt, what=str(folder.model_dir / DIT_FILE))
    del state
    if folder.fp8:  # the blocks' linears in fp8, a scale per row (no official fp8: our choice)
        from avatarstream.models.fp8 import FLASHHEAD_FP8, quantize_linears_

        quantize_linears_(dit, names=FLASHHEAD_FP8, device=device if torch.device(device).type == "cuda" else None)
    vae = _load_vae(folder)
    spf = config.sample_rate // config.fps
    return ModelSet(name=name, dit=Module("dit", dit, device=device, dtype=dt,
                                          autocast_dtype=dt if dt != torch.float32 else None), refiner=None,
                    vae=Module("vae", vae, device=device), audio=Module("audio", w2v, device=device),
                    text=Module("text", NoText(), device=device), config=config,
                    make_audio_stream=lambda: PCMFrames(spf), stages=flashhead_stages,
                    reference=flashhead_reference)


def _built_by_folder() -> Any:
    raise ConfigError("a FlashHead folder's networks are built by its loader (load_model)")


def flashhead_spec(name: str) -> ModelSpec | None:
    """The ModelSpec of a `flashhead-<variant>:DIR` name, or None for any other name."""
    folder = parse_name(name)
    if folder is None:
        return None
    return ModelSpec(name, _built_by_folder, None, _built_by_folder, _built_by_folder, _built_by_folder,
                     lambda: flashhead_pipeline(folder), weights=folder.root,
                     description=f"SoulX-FlashHead-1.3B {folder.variant} from {folder.root}",
                     load=lambda device, bf16: load_flashhead(folder, name, device=device, bf16=bf16))


# -- a tiny random folder in the official layout (tests, demos) -------------------------------------
def random_state(net: nn.Module, g: torch.Generator) -> dict[str, torch.Tensor]:
    """The fixtures' recipe: gains 1 + 0.2·N, matrices and kernels N/√fan-in, vectors 0.2·N (no
    zero-initialised path stays zero)."""
    out = {}
    for k, t in net.state_dict().items():
        leaf = k.rsplit(".", 1)[-1]
        if t.dim() >= 2:
            v = torch.randn(t.shape, generator=g) / float(t[0].numel()) ** 0.5
        elif leaf in ("gamma", "weight_g") or (leaf == "weight" and "norm" in k):
            v = 1 + 0.2 * torch.randn(t.shape, generator=g)
        else:
            v = 0.2 * torch.randn(t.shape, generator=g)
        out[k] = v.to(t.dtype).contiguous()
    return out


def write_official_folder(root: str | Path, variant: str = "pro", size: str = "tiny", seed: int = 0) -> Path:
    """A tiny random SoulX-FlashHead folder: `Model_Pro/` + `VAE_Wan/` (or `Model_Lite/` +
    `VAE_LTX/`; call twice for both) with its wav2vec2-base-960h beside them, at 64 px
    (`avatarstream.json`): what `--model flashhead-<variant>:ROOT` loads in seconds."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    from avatarstream.models.flashhead import AudioProjConfig, FlashHeadDiT
    from avatarstream.models.ltx import LTXVAEConfig, LTXVideoVAE
    from avatarstream.models.wan.vae import WanVAE, WanVAEConfig
    from avatarstream.models.wav2vec2 import Wav2Vec2, Wav2Vec2Config

    if variant not in VARIANTS or size != "tiny":
        raise ConfigError(f"write_official_folder writes the tiny pro or lite layout, not {variant} {size}")
    root = Path(root)
    g = torch.Generator().manual_seed(seed)
    model_dir, vae_dir = (root / d for d in VARIANTS[variant])
    w2v_dir = root / W2V_DIR
    for d in (model_dir, vae_dir, w2v_dir):
        d.mkdir(parents=True, exist_ok=True)
    w2v_cfg = Wav2Vec2Config.tiny()
    ltx = LTXVAEConfig.tiny()
    z, patch, stride = (16, (1, 2, 2), (4, 8, 8)) if variant == "pro" else (ltx.latent_channels, (1, 1, 1), (8, 32, 32))
    dit_cfg = FlashHeadConfig(in_channels=2 * z, out_channels=z, dim=64, depth=2, heads=2, ffn_dim=128,
                              patch=patch, vae_stride=stride, audio=AudioProjConfig(
                                  layers=w2v_cfg.num_hidden_layers, channels=w2v_cfg.hidden_size, hidden=32, tokens=4))

    official = {k.replace(".audio_attn.", ".cross_attn.").replace(".norm_audio.", ".norm3."): v
                for k, v in random_state(FlashHeadDiT(dit_cfg), g).items()}
    d = dit_cfg.dim
    official.update({"text_embedding.0.weight": torch.randn(d, 32, generator=g),
                     "text_embedding.0.bias": torch.zeros(d), "text_embedding.2.weight": torch.randn(d, d, generator=g),
                     "text_embedding.2.bias": torch.zeros(d), "audio_emb.proj.0.weight": torch.randn(d, 16, generator=g)})
    save_file(official, str(model_dir / DIT_FILE))
    (model_dir / "config.json").write_text(json.dumps({
        "_class_name": "WanModelAudioProject", "model_type": "i2v", "in_dim": dit_cfg.in_channels,
        "out_dim": dit_cfg.out_channels, "dim": d, "num_layers": dit_cfg.depth, "num_heads": dit_cfg.heads,
        "ffn_dim": dit_cfg.ffn_dim, "freq_dim": dit_cfg.freq_dim, "eps": dit_cfg.eps, "text_len": 512,
        "patch_size": list(patch), "vae_stride": list(stride)}, indent=1))

    extra = json.loads((root / SIDECAR).read_text()) if (root / SIDECAR).is_file() else {}
    if variant == "pro":
        extra["wan_vae"] = {"dim": 4, "z_dim": z, "dim_mult": [1, 1, 2, 2], "num_res_blocks": 1}
        torch.save(random_state(WanVAE(WanVAEConfig.from_official(extra["wan_vae"])), g), str(vae_dir / WAN_FILE))
    else:
        state = random_state(LTXVideoVAE(ltx), g)
        state["latents_std"] = torch.exp(0.3 * torch.randn(z, generator=g))  # positive scales
        save_file(state, str(vae_dir / DIT_FILE))  # our LTX keys are diffusers' (weights/ltx.py)
        keys = ("in_channels", "out_channels", "latent_channels", "patch_size", "block_out_channels",
                "layers_per_block", "spatio_temporal_scaling", "decoder_block_out_channels",
                "decoder_layers_per_block", "decoder_spatio_temporal_scaling", "encoder_causal",
                "decoder_causal", "resnet_norm_eps")
        cfg = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(ltx).items() if k in keys}
        (vae_dir / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKLLTXVideo", **cfg}, indent=1))

    w2v = {f"wav2vec2.{k}": v for k, v in random_state(Wav2Vec2(w2v_cfg), g).items()}
    w2v.update({"lm_head.weight": torch.randn(32, w2v_cfg.hidden_size, generator=g), "lm_head.bias": torch.zeros(32)})
    save_file(w2v, str(w2v_dir / "model.safetensors"))
    hf = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(w2v_cfg).items()}
    hf.update(model_type="wav2vec2", architectures=["Wav2Vec2ForCTC"], num_feat_extract_layers=len(w2v_cfg.conv_dim))
    (w2v_dir / "config.json").write_text(json.dumps(hf, indent=1))
    (root / SIDECAR).write_text(json.dumps({**extra, "size": 64}))
    return root
