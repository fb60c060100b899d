"""`models check` on a LiveAvatar download (weights/liveavatar_folder.py's layout), from headers only.

The networks of the download, each checked like the FlashHead ones (weights/check.py: our network
built on the meta device, the stored names through the family's adapter):
- `liveavatar-dit`: Wan2.2-S2V-14B/config.json and the sharded DiT (every shard of the index
  read, every key the index lists found in its shard, every key and shape of `LiveAvatarDiT`);
- `liveavatar-lora`: LiveAvatar/liveavatar.safetensors against the DiT's targeted linears
  (weights/lora.py: exactly one pair per target, nothing else in the file);
- `wan-vae` and `wav2vec2` (check.py's own checks), `umt5` (counted only: the DiT does not need it).

The model's entry adds the memory plans of weights/plans.py, at the stream size of the folder's
`avatarstream.json` (height, width) or LiveAvatar's 720x400. The loader runs the same checks on
the files it is about to read (`header_problems`), so a folder this check passes is one it loads.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import torch

from avatarstream.errors import AvatarStreamError
from avatarstream.models.liveavatar import LiveAvatarConfig, LiveAvatarDiT
from avatarstream.models.wan.vae import WanVAE, WanVAEConfig
from avatarstream.models.wav2vec2 import Wav2Vec2, Wav2Vec2Config
from avatarstream.weights import check_memory as mem
from avatarstream.weights.check_networks import (Network, check_wan, check_wav2vec2, count, fit, read_config,
                                                 read_weights)
from avatarstream.weights.headers import Bad, Stored
from avatarstream.weights.liveavatar_layout import (CLASS_NAME, DIT_FILE, INDEX_FILE as INDEX, LIVEAVATAR, LORA_FILE,
                                                    SIDECAR, T5_FILE, TOKENIZER_DIR, LiveAvatarFolder, is_download,
                                                    locate)
from avatarstream.weights.lora import LIVEAVATAR_LORA, match_lora, target_modules
from avatarstream.weights.text_context import FILE as CONTEXT, MAX_TOKENS, read_context
from avatarstream.weights.validate import confine, liveavatar_dit, read_json, shard_names, sidecar
from avatarstream.weights.plans import Geometry, Sizes, describe_plans, dit_sizes, fp8_weight, memory_plans, rank_parts


@dataclass
class LANetwork(Network):
    """A LiveAvatar network as checked: the DiT keeps its stored table (for the plans), the LoRA
    its pair check and the DiT it must fit."""

    liveavatar: ClassVar[bool] = True  # check.py pairs FlashHead's networks among the others only
    file: str = ""  # the LoRA's file name (liveavatar.safetensors unless given)
    lora: dict[str, Any] = field(default_factory=dict)  # pairs, expected_pairs, rank, alpha, scale
    stored: dict[str, Stored] = field(default_factory=dict, repr=False)
    dit: Network | None = field(default=None, repr=False)
    group: str = field(default="", repr=False)  # the download it belongs to (its Wan2.2-S2V-14B folder)

    def to_json(self) -> dict[str, Any]:
        skip = ("folder", "config", "root", "stored", "dit", "file", "group") + (() if self.lora else ("lora",))
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}


def _shard_named(problems: list[str], shown: str, net: Network, weight_map: dict[str, str]) -> list[str]:
    """fit()'s shape problems name the index; name the shard that holds the key instead."""
    out = []
    for p in problems:
        m = re.match(rf"{re.escape(shown)}: '([^']+)' has shape", p)
        out.append(p.replace(shown, net.shown(weight_map[m[1]]), 1) if m and m[1] in weight_map else p)
    return out


def check_dit(net: LANetwork, audio: Wav2Vec2Config | None = None) -> None:
    """Wan2.2-S2V-14B/: config.json (WanModel_S2V kwargs) and the sharded DiT."""
    raw = read_config(net)
    if raw.get("_class_name", CLASS_NAME) != CLASS_NAME:
        raise Bad(f"{net.shown('config.json')}: a {str(raw['_class_name'])[:60]} config, not the {CLASS_NAME} DiT's")
    liveavatar_dit(raw, net.shown("config.json"))
    try:
        cfg = net.config = LiveAvatarConfig.from_official(raw)
    except (TypeError, ValueError) as e:
        raise Bad(f"{net.shown('config.json')}: not a Wan2.2-S2V DiT config ({e})") from None
    if not (net.folder / INDEX).is_file():
        raise Bad(f"{net.shown(INDEX)}: missing (the DiT ships as 4 shards and this index: download it again)")
    stored = net.stored = read_weights(net, DIT_FILE)
    weight_map = shard_names(read_json(net.path(INDEX), net.shown(INDEX), what="shard index"), net.shown(INDEX))
    lost = [k for k in weight_map if k not in stored]
    if lost:
        net.problems.append(f"{net.shown(weight_map[lost[0]])}: does not hold {lost[0]!r}, which the index puts "
                            f"there ({len(lost)} such tensor(s)): a shard of another download? download it again")
    shown = net.shown(INDEX)
    f = fit(stored, LIVEAVATAR, "dit", lambda: LiveAvatarDiT(cfg), shown, "LiveAvatar DiT")
    f.problems = _shard_named(f.problems, shown, net, weight_map)
    count(net, stored, f, low_precision=lambda k: fp8_weight(k, stored[k].shape))
    net.released = cfg == LiveAvatarConfig.full()


def check_lora(net: LANetwork, audio: Wav2Vec2Config | None = None) -> None:
    """liveavatar.safetensors: exactly one rank-128 A/B pair per linear the DiT targets, nothing else."""
    stored = read_weights(net, net.file or LORA_FILE)
    dit = net.dit
    cfg = dit.config if dit is not None and dit.config is not None else LiveAvatarConfig.full()
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LiveAvatarDiT(cfg).state_dict().items()}
    targets = target_modules(shapes, LIVEAVATAR_LORA)
    m = match_lora({k: s.shape for k, s in stored.items()}, targets, LIVEAVATAR_LORA, net.shown(net.file or LORA_FILE))
    numel = {k: math.prod(s.shape) for k, s in stored.items()}
    net.tensors, net.parameters = len(stored), sum(numel.values())
    net.dtypes = dict(sorted({s.dtype: sum(x.dtype == s.dtype for x in stored.values()) for s in stored.values()}.items()))
    used = [k for pair in m.pairs.values() for k in pair]
    net.used_tensors, net.used_parameters = len(used), sum(numel[k] for k in used)
    net.lora = {"pairs": len(m.pairs), "expected_pairs": len(targets), "rank": LIVEAVATAR_LORA.rank,
                "alpha": LIVEAVATAR_LORA.alpha, "scale": LIVEAVATAR_LORA.scale, "merged_into": "the DiT, at load (fp32)"}
    net.problems += m.problems


def check_t5(net: Network, audio: Wav2Vec2Config | None = None) -> None:
    """The umT5-XXL encoder: counted (only `models encode-text` reads it, once); its tokenizer beside it."""
    stored = read_weights(net, T5_FILE)
    net.tensors, net.parameters = len(stored), sum(math.prod(s.shape) for s in stored.values())
    net.dtypes = {d: sum(s.dtype == d for s in stored.values()) for d in {s.dtype for s in stored.values()}}
    if not (net.folder / TOKENIZER_DIR).is_dir():
        net.problems.append(f"{net.shown(TOKENIZER_DIR)}/: missing, the umT5 encoder needs its tokenizer (download it again)")


CHECKS = {"liveavatar-dit": check_dit, "liveavatar-lora": check_lora, "umt5": check_t5}


def networks(folder: LiveAvatarFolder, name: Any = str, *, lora: bool = True, t5: bool = False) -> list[Network]:
    """The networks of a download; name(path) -> how a report names a folder."""
    group = str(folder.base)
    dit = LANetwork(name(folder.base), "liveavatar-dit", folder.base, group=group)
    nets: list[Network] = [dit]
    if lora:
        nets.append(LANetwork(name(folder.lora.parent), "liveavatar-lora", folder.lora.parent, file=folder.lora.name,
                              dit=dit, group=group))
    nets += [LANetwork(name(folder.base), "wan-vae", folder.base, group=group),
             LANetwork(name(folder.wav2vec), "wav2vec2", folder.wav2vec, group=group)]
    if t5 and (folder.base / T5_FILE).is_file():
        nets.append(LANetwork(name(folder.base), "umt5", folder.base, group=group))
    for n in nets:
        n.root = folder.trusted(n.folder)
    return nets


def find(folder: Path, prefix: str = "") -> list[Network] | None:
    """The networks of a LiveAvatar download at `folder` (ROOT or one of its two folders), named
    relative to it; None: not one."""
    if not is_download(folder):
        return None

    def name(p: Path) -> str:
        rel = os.path.relpath(p, folder)
        return prefix.rstrip("/") or folder.name if rel == "." else f"{prefix}{rel}"

    return networks(locate(folder), name, t5=True)


def run(nets: list[Network]) -> None:
    for net in nets:
        try:
            (CHECKS.get(net.family) or {"wan-vae": check_wan, "wav2vec2": check_wav2vec2}[net.family])(net, None)
        except Bad as e:
            net.problems.append(str(e))
        except (OSError, AvatarStreamError) as e:
            net.problems.append(f"{net.name}: {e}")


def header_problems(folder: LiveAvatarFolder, *, lora: bool = True) -> list[str]:
    """What is missing or wrong in the files the loader reads (the DiT, the LoRA, the VAE, wav2vec2)."""
    nets = networks(folder, lambda p: str(p), lora=lora)
    run(nets)
    return [p for n in nets for p in n.problems] + models(nets, mem.machine(), context=False)[1]


def _released(build: Any) -> int:
    with torch.device("meta"):
        return sum(t.numel() for t in build().state_dict().values())


def sizes_of(nets: list[Network]) -> tuple[Sizes, Geometry, list[str]] | None:
    """The plans' inputs from checked networks (released VAE / wav2vec2 assumed where not checked)."""
    dit = next((n for n in nets if n.family == "liveavatar-dit" and n.weight_bytes), None)
    if dit is None:
        return None
    cfg: LiveAvatarConfig = dit.config
    vae = next((n for n in nets if n.family == "wan-vae" and n.weight_bytes), None)
    audio = next((n for n in nets if n.family == "wav2vec2" and n.weight_bytes), None)
    assumed = [f for f, n in (("wan-vae", vae), ("wav2vec2", audio)) if n is None]
    vcfg = vae.config if vae is not None else WanVAEConfig()
    whole, unit, resident = dit_sizes({k: dit.stored[k].shape for k in dit.stored}, cfg.audio_inject_layers)
    s = Sizes(dim=cfg.dim, layers=cfg.num_layers, ffn_dim=cfg.ffn_dim, dit=whole, unit=unit, resident=resident,
              vae=2 * (vae.used_parameters if vae else _released(WanVAE)),
              audio=2 * (audio.used_parameters if audio else _released(lambda: Wav2Vec2(Wav2Vec2Config.large()))),
              vae_width=vcfg.dim * vcfg.dim_mult[0], vae_frames=vcfg.temporal_factor)
    size = {}  # the stream size of our avatarstream.json, if any (else LiveAvatar's 720x400)
    try:
        extra = sidecar(confine(dit.folder.parent / SIDECAR, dit.folder.parent))
        size = {k: extra[k] for k in ("height", "width") if k in extra}
    except Bad:  # reported by the Wan VAE's check
        size = {}
    geo = Geometry(spatial=vcfg.spatial_factor, patch=cfg.patch_size[1:], framepack=cfg.framepack_buckets, **size)
    return s, geo, assumed


def models(nets: list[Network], machine: dict[str, Any], *,
           context: bool = True) -> tuple[dict[str, Any], list[str]]:
    """One `liveavatar` entry per download checked (memory needed, plans, this machine) and the
    problems of each combination (a wav2vec2 that is not the width and depth the DiT's audio
    encoder mixes; with `context`, the download's own prompt context file)."""
    out: dict[str, Any] = {}
    problems: list[str] = []
    groups = [n.group for n in nets if isinstance(n, LANetwork) and n.family == "liveavatar-dit"]
    for group in groups:
        mine = [n for n in nets if isinstance(n, LANetwork) and n.group == group]
        entry, bad = _model([*mine], machine)
        problems += bad + (context_problems(mine) if context else [])
        if entry:
            out["liveavatar" if len(groups) == 1 else f"liveavatar ({mine[0].name})"] = entry
    return out, problems


def context_problems(nets: list[Network]) -> list[str]:
    """ROOT/context.safetensors, when there (the prompt context the loader reads by default),
    checked as the loader reads it (text_context.read_context: header, shape, dtype, NaN/Inf)."""
    dit = next((n for n in nets if n.family == "liveavatar-dit"), None)
    if dit is None or not ((dit.folder.parent / CONTEXT).is_file() or (dit.folder.parent / CONTEXT).is_symlink()):
        return []
    cfg: LiveAvatarConfig | None = dit.config
    try:
        read_context(dit.folder.parent / CONTEXT, dim=cfg.text_dim if cfg else None,
                     max_tokens=cfg.text_len if cfg else MAX_TOKENS, root=dit.folder.parent)
    except AvatarStreamError as e:
        return [str(e)]
    return []


def _model(nets: list[Network], machine: dict[str, Any]) -> tuple[dict[str, Any] | None, list[str]]:
    problems = []
    dit = next((n for n in nets if n.family == "liveavatar-dit" and n.config is not None), None)
    audio = next((n for n in nets if n.family == "wav2vec2" and n.config is not None), None)
    if dit is not None and audio is not None:
        a, c = audio.config, dit.config
        if (a.num_hidden_layers + 1, a.hidden_size) != (c.audio_layers, c.audio_dim):
            problems.append(f"{audio.name}: wav2vec2 gives {a.num_hidden_layers + 1} hidden states × {a.hidden_size}, "
                            f"{dit.name}'s audio encoder mixes {c.audio_layers} × {c.audio_dim} "
                            "(LiveAvatar needs wav2vec2-large-xlsr-53-english)")
    got = sizes_of(nets)
    if got is None:
        return None, problems
    s, geo, assumed = got
    lora = next((n for n in nets if n.family == "liveavatar-lora"), None)
    plans = memory_plans(s, geo)
    gpu = {p: sum(rank_parts(s, geo, precision=p).values()) for p in ("bf16", "fp8")}
    act = max(plans["geometry"]["dit_activation_bytes"], plans["geometry"]["vae_activation_bytes"])
    cpu = 2 * (gpu["bf16"] - mem.RESERVE)  # fp32 on the CPU: twice the bf16 bytes, no CUDA reserve
    runs, verdict = mem.verdict(gpu, cpu, machine)
    one = plans["plans"]["1x80GB"]["per_gpu_bytes"]
    if machine["cuda"] and not runs and one <= machine["gpu_free_bytes"]:
        runs, verdict = True, f"{verdict}; with fp8 + offload (plan 1x80GB, {mem.gb(one)}) it fits"
    names = {"dit": dit.name if dit else None, "lora": lora and lora.name,
             "vae": next((n.name for n in nets if n.family == "wan-vae" and n.weight_bytes), "wan-vae (released size assumed)"),
             "audio": next((n.name for n in nets if n.family == "wav2vec2" and n.weight_bytes),
                           "wav2vec2-large (released size assumed)")}
    entry = {"networks": names, "assumed": assumed,
             "weight_bytes": {p: s.dit[p] + s.vae + s.audio for p in ("bf16", "fp8")}, "activation_bytes": act,
             "gpu_bytes": gpu, "cpu_bytes": cpu, "runs_here": runs, "verdict": verdict, **plans}
    return entry, problems


def plan_sizes(folder: LiveAvatarFolder) -> tuple[Sizes, Geometry] | None:
    """The plans' sizes and stream geometry of a download (headers only), or None when they cannot be read."""
    nets = networks(folder, str, lora=False)
    run(nets)
    got = sizes_of(nets)
    return got[:2] if got else None


def describe_model(name: str, m: dict[str, Any]) -> list[str]:
    """`models check`'s lines for the liveavatar model (check.describe calls it)."""
    lines = [f"  {name}: GPU memory on one GPU, all resident: bf16 {mem.gb(m['gpu_bytes']['bf16'])}, fp8 "
             f"{mem.gb(m['gpu_bytes']['fp8'])} (weights {mem.gb(m['weight_bytes']['bf16'])} bf16 / "
             f"{mem.gb(m['weight_bytes']['fp8'])} fp8, every step's KV ring, the shared sink, activations, reserve)"]
    if m["assumed"]:
        lines.append(f"    not in this folder, released size assumed: {', '.join(m['assumed'])}")
    lines += describe_plans(m)
    lines.append(f"    this machine: {m['verdict']}")
    lines.append(f"    estimates: {m['how']}")
    return lines


def describe_network(n: dict[str, Any]) -> list[str]:
    """The LoRA's pair line under its network line."""
    lo = n.get("lora")
    if not lo:
        return []
    return [f"    LoRA: {lo['pairs']} of {lo['expected_pairs']} targeted linears paired (rank {lo['rank']}, "
            f"alpha {lo['alpha']:g}, scale {lo['scale']:g}), merged into the DiT at load"]

