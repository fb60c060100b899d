"""The networks `models check` knows (a FlashHead DiT, the Wan2.1 and LTX-Video VAEs, wav2vec2),
each checked from its files' headers against our network built on the meta device at the
folder's config (weights/check.py explains why and how). The FlashHead loader runs the same
checks on the files it is about to read (`flashhead_problems`), so what the check passes loads.
Every file read here must resolve inside the folder the user named (`Network.root`:
weights/validate.py `confine`), and every config passes its family's schema first.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from avatarstream.errors import AvatarStreamError
from avatarstream.models.flashhead import FlashHeadConfig, FlashHeadDiT
from avatarstream.models.ltx import LTXVAEConfig, LTXVideoVAE
from avatarstream.models.wan.vae import WanVAE, WanVAEConfig
from avatarstream.models.wav2vec2 import Wav2Vec2, Wav2Vec2Config
from avatarstream.weights import check_memory as mem
from avatarstream.weights.adapters import StateDictAdapter
from avatarstream.weights.flashhead import FLASHHEAD
from avatarstream.weights import validate as schema
from avatarstream.weights.headers import Bad, Stored, pth_tensors, safetensors_header
from avatarstream.weights.ltx import ltx_vae_adapter, ltx_vae_config
from avatarstream.weights.wan import WAN_VAE, wan_vae_config
from avatarstream.weights.validate import confine, read_json, shard_names, under
from avatarstream.weights.wav2vec2 import ADAPTER as WAV2VEC2, UNUSED as WAV2VEC2_UNUSED, WEIGHT_FILES

# the official root's folders and the family each holds; the two models and the folders each needs
PARTS = {"Model_Pro": "flashhead-dit", "Model_Lite": "flashhead-dit", "VAE_Wan": "wan-vae", "VAE_LTX": "ltx-vae"}
MODELS = {"flashhead-pro": ("Model_Pro", "VAE_Wan"), "flashhead-lite": ("Model_Lite", "VAE_LTX")}
VAE_OF = {"pro": "wan-vae", "lite": "ltx-vae"}
DIT_WEIGHTS = "diffusion_pytorch_model.safetensors"  # the diffusers name, in Model_*/ and VAE_LTX/
WAN_WEIGHTS = "Wan2.1_VAE.pth"
W2V_DIR = "wav2vec2-base-960h"  # looked for in a root and beside it, as weights/flashhead_folder.py does
SIDECAR = "avatarstream.json"  # ours, optional in a root: {"wan_vae": kwargs} (weights/flashhead_folder.py)


@dataclass
class Network:
    """One network's folder as checked; `problems` empty means it loads."""

    name: str  # the folder, relative to the checked DIR (DIR's own name when DIR is the network)
    family: str  # flashhead-dit | wan-vae | ltx-vae | wav2vec2
    folder: Path = field(repr=False)
    variant: str | None = None  # flashhead-dit: pro | lite; wav2vec2: base | large | other
    released: bool | None = None  # the size of the released checkpoint?
    files: list[str] = field(default_factory=list)
    bytes: int = 0  # on disk
    tensors: int = 0  # stored
    parameters: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)
    used_tensors: int = 0  # stored tensors the network takes
    used_parameters: int = 0
    unused: list[str] = field(default_factory=list)  # stored key patterns the forward never reads
    unused_tensors: int = 0
    unused_parameters: int = 0
    weight_bytes: dict[str, int] = field(default_factory=dict)  # precision -> bytes on the GPU
    activation_bytes: int = 0
    activation_note: str = ""
    alone: dict[str, Any] = field(default_factory=dict)  # check_memory.budget of this network alone
    problems: list[str] = field(default_factory=list)
    config: Any = field(default=None, repr=False)
    root: Path | None = field(default=None, repr=False)  # the folder named by the user (default: folder)

    def shown(self, file: str) -> str:
        return f"{self.name}/{file}"

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("folder", "config", "root")}

    def path(self, file: str) -> Path:
        """`file` of this network's folder, refused (Bad) when it resolves outside the folder the user named."""
        return confine(self.folder / file, self.root or self.folder, self.shown(file))


def read_weights(net: Network, file: str) -> dict[str, Stored]:
    """The tensors of `file` in net's folder (or of its sharded `.index.json`), counted into `net`."""
    path = net.folder / file
    index = net.folder / f"{file}.index.json"
    if not path.is_file() and index.is_file():
        shown = net.shown(index.name)
        shards = sorted(set(shard_names(read_json(net.path(index.name), shown, what="shard index"), shown).values()))
        out: dict[str, Stored] = {}
        for shard in shards:
            out.update(read_weights(net, shard))
        return out
    if not path.is_file():
        raise Bad(f"{net.shown(file)}: missing (download it again)")
    net.path(file)
    net.files.append(file)
    net.bytes += path.stat().st_size
    return pth_tensors(path, net.shown(file)) if file.endswith((".pth", ".bin")) else \
        safetensors_header(path, net.shown(file))


def read_config(net: Network) -> dict[str, Any]:
    """The network's config.json as an object of finite, bounded numbers (validate.read_json)."""
    return read_json(net.path("config.json"), net.shown("config.json"))


# -- comparing with our networks --------------------------------------------------------------------
@dataclass
class Fit:
    used: dict[str, str] = field(default_factory=dict)  # stored key -> our key
    unused: list[str] = field(default_factory=list)  # stored keys the network has no place for
    problems: list[str] = field(default_factory=list)


def fit(stored: Mapping[str, Stored], adapter: StateDictAdapter, net: str, build: Callable[[], nn.Module],
        shown: str, what: str, unused: tuple[str, ...] = ()) -> Fit:
    """How the stored tensors fill `build()` (made on the meta device) after `adapter`: every
    missing, unexpected or mis-shaped tensor, in the stored names where there is one."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build().state_dict().items()}
    skip = [re.compile(u) for u in unused]
    out, got = Fit(), {}
    for key, s in stored.items():
        ours = adapter.state_dict(net, {key: torch.empty(s.shape, device="meta")})
        for k, t in ours.items():
            if k in got:
                out.problems.append(f"{shown}: {got[k][0]!r} and {key!r} are the same tensor {k!r}")
            got[k] = (key, tuple(t.shape))
        if not ours or any(rx.fullmatch(k) for k in ours for rx in skip):
            out.unused.append(key)
    if not set(got) & set(expected):
        example = next(iter(stored), "nothing")
        out.problems.append(f"{shown}: none of its {len(stored)} tensors is one of the {what}'s (it has "
                            f"{example!r}): the file of another model?")
        return out
    missing = [k for k in expected if k not in got]
    extra = [got[k][0] for k in got if k not in expected and got[k][0] not in out.unused]
    if missing:
        out.problems.append(f"{shown}: {len(missing)} tensor(s) of the {what} missing: {_some(missing)}")
    if extra:
        out.problems.append(f"{shown}: {len(extra)} tensor(s) the {what} does not have: {_some(extra)}")
    for k, want in expected.items():
        if k in got and got[k][1] != want:
            out.problems.append(f"{shown}: {got[k][0]!r} has shape {list(got[k][1])}, the {what} "
                                f"expects {list(want)} (another variant or size?)")
    out.used = {got[k][0]: k for k in expected if k in got}
    return out


def _some(keys: list[str], n: int = 4) -> str:
    return ", ".join(repr(k) for k in keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def count(net: Network, stored: Mapping[str, Stored], f: Fit, low_precision: Callable[[str], bool]) -> None:
    """Stored, used and unused counts, and the bytes of the used tensors on the GPU in bf16 and
    fp8 (fp8: the tensors `low_precision(key)` names at 1 byte, the rest at 2)."""
    def numel(k: str) -> int:
        return math.prod(stored[k].shape)

    net.tensors, net.parameters = len(stored), sum(map(numel, stored))
    net.dtypes = dict(Counter(s.dtype for s in stored.values()))
    net.used_tensors, net.used_parameters = len(f.used), sum(map(numel, f.used))
    net.unused_tensors, net.unused_parameters = len(f.unused), sum(map(numel, f.unused))
    groups = Counter(k.split(".")[0] for k in f.unused)  # "text_embedding.0.weight" -> "text_embedding.*"
    net.unused = sorted({f"{k.split('.')[0]}.*" if groups[k.split(".")[0]] > 1 else k for k in f.unused})
    fp8 = sum(numel(k) * (1 if low_precision(k) and len(stored[k].shape) >= 2 else 2) for k in f.used)
    net.weight_bytes = {"bf16": 2 * net.used_parameters, "fp8": fp8, "fp32": 4 * net.used_parameters}
    net.problems += f.problems


# -- the four families -------------------------------------------------------------------------------
def dit_variant(cfg: FlashHeadConfig) -> str:
    return "lite" if cfg.vae_stride[0] == 8 else "pro"  # which VAE its latents are of: temporal stride 8 is LTX's, 4 Wan's


def audio_sizes(stored: Mapping[str, Stored], cfg: FlashHeadConfig, audio: Wav2Vec2Config | None) -> FlashHeadConfig:
    """The audio projection's sizes as the loader takes them (the official module hard-codes
    wav2vec2-base's): width and tokens from the stored tensors, layers × channels from the paired
    wav2vec2 where `proj1` fits it, else wav2vec2-base's (a mismatch is then reported by name)."""
    a, proj1, proj3 = cfg.audio, stored.get("audio_proj.proj1.weight"), stored.get("audio_proj.proj3.weight")
    if proj1 is None or proj3 is None or len(proj1.shape) != 2 or len(proj3.shape) != 2:
        return cfg
    layers, channels = a.layers, a.channels
    if audio is not None and a.window * audio.num_hidden_layers * audio.hidden_size == proj1.shape[1]:
        layers, channels = audio.num_hidden_layers, audio.hidden_size
    return replace(cfg, audio=replace(a, layers=layers, channels=channels, hidden=proj1.shape[0],
                                      tokens=max(proj3.shape[0] // cfg.dim, 1)))


def check_dit(net: Network, audio: Wav2Vec2Config | None) -> None:
    """A `Model_Pro/` or `Model_Lite/` folder: config.json (the official kwargs) and the DiT."""
    want = {"Model_Pro": "pro", "Model_Lite": "lite"}.get(net.folder.name)
    presets = {"pro": FlashHeadConfig.pro(), "lite": FlashHeadConfig.lite()}
    try:
        raw = read_config(net)
        if raw.get("_class_name", "WanModelAudioProject") != "WanModelAudioProject":
            raise Bad(f"{net.shown('config.json')}: a {raw['_class_name']} config, not a FlashHead DiT's "
                      "(WanModelAudioProject): another model's folder?")
        schema.flashhead_dit(raw, net.shown("config.json"))
        try:
            cfg = FlashHeadConfig.from_official(raw)
        except ValueError as e:
            raise Bad(f"{net.shown('config.json')}: not a FlashHead DiT config ({e})") from None
    except Bad as e:  # no usable config: check the weights against the folder's released size
        if want is None:
            raise
        net.problems.append(str(e))
        cfg = presets[want]
    net.variant = dit_variant(cfg)
    if want is not None and net.variant != want:
        net.problems.append(f"{net.shown('config.json')}: describes a {net.variant.title()} DiT "
                            f"(vae_stride {list(cfg.vae_stride)}); {net.folder.name}/ holds the {want.title()} one")
    stored = read_weights(net, DIT_WEIGHTS)
    cfg = net.config = audio_sizes(stored, cfg, audio)
    net.released = cfg == presets[net.variant]
    shown, what = net.shown(DIT_WEIGHTS), f"FlashHead {net.variant.title()} DiT"
    f = fit(stored, FLASHHEAD, "dit", lambda: FlashHeadDiT(cfg), shown, what)
    other = "lite" if net.variant == "pro" else "pro"
    if f.problems and not fit(stored, FLASHHEAD, "dit", lambda: FlashHeadDiT(presets[other]), shown, "").problems:
        f.problems = [f"{shown}: holds a FlashHead {other.title()} DiT (its tensors fit {other.title()} "
                      f"exactly), not the {net.variant.title()} one its config.json describes"]
    count(net, stored, f, low_precision=lambda k: k.startswith("blocks."))
    net.activation_bytes, net.activation_note = mem.dit_activation(cfg)


def check_wan(net: Network, audio: Wav2Vec2Config | None = None) -> None:
    """`VAE_Wan/`: `Wan2.1_VAE.pth` alone; its config is the official code's fixed one (ours'
    default), unless the root's `avatarstream.json` gives other constructor kwargs (our tiny folders)."""
    sidecar = net.folder.parent / SIDECAR
    kwargs = schema.sidecar(confine(sidecar, sidecar.parent)).get("wan_vae", {})
    try:
        cfg = net.config = wan_vae_config(kwargs)
    except AvatarStreamError as e:
        raise Bad(f"{sidecar}: not a usable avatarstream.json ({e})") from None
    stored = read_weights(net, WAN_WEIGHTS)
    count(net, stored, fit(stored, WAN_VAE, "vae", lambda: WanVAE(cfg),
                           net.shown(WAN_WEIGHTS), "Wan2.1 VAE"), low_precision=lambda k: False)
    net.released = cfg == WanVAEConfig()
    net.activation_bytes, net.activation_note = mem.wan_activation(cfg)


def check_ltx(net: Network, audio: Wav2Vec2Config | None = None) -> None:
    """`VAE_LTX/`: diffusers' config.json and weights (or the LTX repository's form of them)."""
    raw = read_config(net)
    schema.fields(raw, schema.LTX_VAE, net.shown("config.json"))
    try:
        cfg = net.config = ltx_vae_config(raw)
    except AvatarStreamError as e:
        raise Bad(f"{net.shown('config.json')}: {e}") from None
    stored = read_weights(net, DIT_WEIGHTS)
    if any(k.startswith("vae.") for k in stored):  # a combined LTX checkpoint: its VAE part (as the loader)
        stored = {k[len("vae."):]: v for k, v in stored.items() if k.startswith("vae.")}
    count(net, stored, fit(stored, ltx_vae_adapter(cfg), "vae", lambda: LTXVideoVAE(cfg),
                           net.shown(DIT_WEIGHTS), "LTX-Video VAE"), low_precision=lambda k: False)
    net.released = cfg == LTXVAEConfig()
    net.activation_bytes, net.activation_note = mem.ltx_activation(cfg)


def check_wav2vec2(net: Network, audio: Wav2Vec2Config | None = None) -> None:
    """A Hugging Face wav2vec2 folder: config.json and model.safetensors or pytorch_model.bin."""
    raw = read_config(net)
    if raw.get("model_type") != "wav2vec2":
        raise Bad(f"{net.shown('config.json')}: model_type {raw.get('model_type')!r}, not a wav2vec2 checkpoint")
    schema.fields(raw, schema.WAV2VEC2, net.shown("config.json"))
    try:
        cfg = net.config = Wav2Vec2Config.from_hf(raw)
    except (AvatarStreamError, TypeError, ValueError) as e:
        raise Bad(f"{net.shown('config.json')}: {e}") from None
    file = next((f for f in WEIGHT_FILES if (net.folder / f).is_file()), WEIGHT_FILES[0])
    stored = read_weights(net, file)
    count(net, stored, fit(stored, WAV2VEC2, "wav2vec2", lambda: Wav2Vec2(cfg), net.shown(file), "wav2vec2",
                           unused=WAV2VEC2_UNUSED), low_precision=lambda k: False)
    net.variant = {Wav2Vec2Config.base(): "base", Wav2Vec2Config.large(): "large"}.get(cfg, "other")
    net.released = net.variant != "other"
    net.weight_bytes = {k: net.weight_bytes["fp32"] for k in net.weight_bytes}  # runs in fp32, as FlashHead's official pipeline runs it
    net.activation_bytes, net.activation_note = mem.wav2vec2_activation(cfg)


CHECKS = {"flashhead-dit": check_dit, "wan-vae": check_wan, "ltx-vae": check_ltx, "wav2vec2": check_wav2vec2}




def flashhead_problems(model_dir: Path, vae_dir: Path, wav2vec: Path, root: Path) -> list[str]:
    """What `models check` finds wrong in the files the FlashHead loader is about to read (its DiT,
    VAE and wav2vec2), each naming the file: the loader refuses the folder on the first one."""
    vae = "wan-vae" if (vae_dir / WAN_WEIGHTS).is_file() or vae_dir.name == "VAE_Wan" else "ltx-vae"
    nets = [Network(str(wav2vec), "wav2vec2", wav2vec), Network(str(model_dir), "flashhead-dit", model_dir),
            Network(str(vae_dir), vae, vae_dir)]
    audio = None
    for net in nets:
        net.root = root if under(net.folder, root) else net.folder
        try:
            CHECKS[net.family](net, audio)
        except Bad as e:
            net.problems.append(str(e))
        except (OSError, AvatarStreamError) as e:
            net.problems.append(f"{net.name}: {e}")
        audio = audio or (net.config if net.family == "wav2vec2" else None)
    return [p for n in nets for p in n.problems]
