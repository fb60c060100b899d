"""`avatarstream models check DIR`: is a downloaded checkpoint folder complete, of the right family
and size, and can this machine run it? Answered from the files' headers (weights/headers.py),
without reading a tensor: the folders weigh 6-10 GB, and reading them to learn whether a download
is complete would take minutes and the very memory this check budgets.

What is expected comes from our own networks, not from shipped key lists: each network is built on
the meta device (no memory) at the folder's config, and the stored names go through the family's
`StateDictAdapter` (weights/flashhead.py, wan.py, ltx.py, wav2vec2.py), exactly as the loader does.
So a folder this check passes is one the loader accepts, and a tensor the adapter drops by name
(FlashHead's `text_embedding.*`, `audio_emb.*`) is reported as unused rather than as an error.

Layouts (docs/real-models.md): a SoulX-FlashHead-1_3B root (`Model_Pro/`,
`Model_Lite/`, `VAE_Wan/`, `VAE_LTX/`), any one of those folders, a wav2vec2 Hugging Face folder, or
a folder holding such folders (the official README's `models/`). Memory estimates and this
machine: weights/check_memory.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from avatarstream.errors import AvatarStreamError, InputError
from avatarstream.weights import check_liveavatar as la, check_memory as mem
from avatarstream.weights.check_networks import (CHECKS, MODELS, PARTS, VAE_OF, W2V_DIR, WAN_WEIGHTS, Bad,
                                                 Network)
from avatarstream.weights.validate import read_json, under


# -- finding the networks of a folder ---------------------------------------------------------------
def family_of(folder: Path) -> str | None:
    """The family a folder holds, from its name or its files; None: none this check knows."""
    if folder.name in PARTS:
        return PARTS[folder.name]
    if (folder / WAN_WEIGHTS).is_file():
        return "wan-vae"
    try:
        raw = read_json(folder / "config.json")
    except Bad:
        return None
    kind = {"WanModelAudioProject": "flashhead-dit", "AutoencoderKLLTXVideo": "ltx-vae",
            "CausalVideoAutoencoder": "ltx-vae"}.get(str(raw.get("_class_name")))
    return kind or ("wav2vec2" if raw.get("model_type") == "wav2vec2" else None)


def find(folder: Path, prefix: str = "", depth: int = 1) -> tuple[list[Network], list[Path]]:
    """The networks under `folder` and the FlashHead roots among the folders searched: the folder
    itself as a root, one network, or (depth allowing) a folder of such folders."""
    liveavatar = la.find(folder, prefix)  # a LiveAvatar download (its own module)
    if liveavatar is not None:
        return liveavatar, []
    if any((folder / p).is_dir() for p in PARTS):
        nets = [Network(f"{prefix}{p}", fam, folder / p) for p, fam in PARTS.items() if (folder / p).is_dir()]
        # its wav2vec2: inside, or beside it (a collection's scan finds that one by itself)
        for sub in (W2V_DIR,) if prefix else (W2V_DIR, f"../{W2V_DIR}"):
            if family_of(folder / sub) == "wav2vec2":
                return [*nets, Network(f"{prefix}{sub}", "wav2vec2", folder / sub)], [folder]
        return nets, [folder]
    fam = family_of(folder)
    if fam is not None:
        return [Network(prefix.rstrip("/") or folder.name, fam, folder)], []
    nets, roots = [], []
    if depth > 0:
        for child in sorted(p for p in folder.iterdir() if p.is_dir()):
            n, r = find(child, f"{prefix}{child.name}/", depth - 1)
            nets, roots = nets + n, roots + r
    return nets, roots


def check_folder(path: str | Path) -> dict[str, Any]:
    """The report of `models check` (JSON-serialisable); `ok` is False when anything is wrong.
    InputError when `path` is no folder or holds nothing this check knows."""
    root = Path(path)
    if not root.is_dir():
        raise InputError(f"{root}: no such folder (give the downloaded SoulX-FlashHead-1_3B or "
                         "wav2vec2-base-960h folder, or the folder holding them)")
    try:
        nets, roots = find(root)
    except OSError as e:
        raise InputError(f"{root}: cannot be listed ({e})") from None
    if not nets:
        raise InputError(f"{root}: not a checkpoint folder this check knows: expected a SoulX-FlashHead-1_3B "
                         "folder (Model_Pro/, Model_Lite/, VAE_Wan/, VAE_LTX/), one of those folders, a LiveAvatar "
                         "download (Wan2.2-S2V-14B/ and LiveAvatar/), a wav2vec2 folder (config.json with model_type wav2vec2), or a folder holding them")
    nets.sort(key=lambda n: n.family != "wav2vec2")  # first: the DiT's audio sizes follow it
    for net in nets:  # what a network may read: the folder named, or its own (a wav2vec2 found beside it)
        net.root = root if under(net.folder, root) else net.folder
    for net in nets:
        audio = next((n.config for n in nets if n.family == "wav2vec2" and n.config is not None
                      and not getattr(n, "liveavatar", False)), None)  # FlashHead's: not LiveAvatar's
        try:
            (CHECKS.get(net.family) or la.CHECKS[net.family])(net, audio)
        except Bad as e:
            net.problems.append(str(e))
        except (OSError, AvatarStreamError) as e:
            net.problems.append(f"{net.name}: {e}")
    problems = [p for n in nets for p in n.problems]
    for r in roots:  # a root with half a model: the other half is missing
        for model, parts in MODELS.items():
            have = [p for p in parts if (r / p).is_dir()]
            if have and len(have) < len(parts):
                lost = [p for p in parts if p not in have]
                problems.append(f"{r.relative_to(root) / lost[0] if r != root else lost[0]}/: missing, "
                                f"{model} needs it next to {have[0]}/ (download it again)")
    machine = mem.machine()
    for n in nets:
        if n.weight_bytes:
            n.alone = mem.budget([{"weight_bytes": n.weight_bytes, "activation_bytes": n.activation_bytes}], machine)
    models, mismatched = mem.models([n for n in nets if not getattr(n, "liveavatar", False)], VAE_OF, machine)
    la_models, la_mismatched = la.models(nets, machine)
    models, problems = {**models, **la_models}, problems + mismatched + la_mismatched
    return {"folder": str(root), "networks": [n.to_json() for n in nets], "models": models,
            "machine": machine, "estimate": mem.HOW, "problems": problems, "ok": not problems}


def _count(n: int) -> str:
    return f"{n / 1e9:.4f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"


def describe(report: Mapping[str, Any]) -> str:
    """The report as lines for a person (the CLI prints it before the JSON line)."""
    lines = [f"{report['folder']}:"]
    for n in report["networks"]:
        kind = n["family"] + (f" ({n['variant']})" if n["variant"] else "")
        size = "" if n["released"] is None else ", released size" if n["released"] else ", not the released size"
        lines.append(f"  {n['name']}: {kind}{size}: {n['tensors']} tensors, {_count(n['parameters'])} "
                     f"parameters, {mem.gb(n['bytes'])} on disk ({', '.join(n['dtypes']) or '-'})")
        if n["alone"] and not report["models"]:
            lines.append(f"    alone on a GPU: bf16 {mem.gb(n['alone']['gpu_bytes']['bf16'])}, fp8 "
                         f"{mem.gb(n['alone']['gpu_bytes']['fp8'])}; this machine: {n['alone']['verdict']}")
        lines += la.describe_network(n)
        if n["unused_tensors"]:
            lines.append(f"    {n['unused_tensors']} tensors ({_count(n['unused_parameters'])}) unused by the "
                         f"forward, skipped when loading: {', '.join(n['unused'])}")
    for name, m in report["models"].items():
        if "plans" in m:  # LiveAvatar's KV rings and plans
            lines += la.describe_model(name, m)
            continue
        lines.append(f"  {name}: GPU memory bf16 {mem.gb(m['gpu_bytes']['bf16'])}, fp8 "
                     f"{mem.gb(m['gpu_bytes']['fp8'])} (weights {mem.gb(m['weight_bytes']['bf16'])} + "
                     f"activations {mem.gb(m['activation_bytes'])} at {mem.RES}² + "
                     f"{mem.RESERVE >> 30} GiB reserve)")
        if m["assumed"]:
            lines.append(f"    not in this folder, released size assumed: {', '.join(m['assumed'])}")
        lines.append(f"    this machine: {m['verdict']}")
    if any("plans" not in m for m in report["models"].values()) or not report["models"]:  # FlashHead's
        lines.append(f"  estimates: {report['estimate']}")
    if report["problems"]:
        lines.append(f"{len(report['problems'])} problem(s):")
        lines += [f"  - {p}" for p in report["problems"]]
    else:
        lines.append("ok: every expected tensor is there with its shape")
    return "\n".join(lines)
