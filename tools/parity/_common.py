"""Shared parts of the parity-fixture generators (docs/parity-fixtures.md, "Regenerating the fixtures").

Each `make_<family>.py` imports the official code from a checkout the user names with `--official`
(never from this repository: no official code is committed here), draws the weights and inputs from
the seeds a fixture's `settings.weight_init` names, runs the official computation on the CPU in fp32
with one thread, and writes a file in the `avatarstream-parity/1` format. With `--like FIXTURE` it
takes every size, seed and metadata string from that fixture and, after writing, compares the new
file tensor by tensor with it and prints one JSON object (the last line of stdout): the largest difference per tensor, which
ones matched bit for bit, and the worst difference per group (weights, inputs, expected).

Run them with the library versions the fixtures name (torch 2.13 CPU, transformers 4.51.3,
diffusers 0.35.2); other versions may still agree within float32 rounding.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import types
from pathlib import Path

import torch

FORMAT = "avatarstream-parity/1"
GAIN_NAMES = ("gamma", "weight_g", "g", "original0")  # RMS_norm gain, weight-norm magnitude


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    ap.add_argument("--official", required=True, type=Path,
                    help="root of a checkout of the official repository at the commit SOURCES names")
    ap.add_argument("--like", required=True, type=Path,
                    help="a committed fixture: sizes, seeds and metadata are taken from it, and the "
                         "new file is compared with it")
    ap.add_argument("--out", required=True, type=Path, help="where to write the regenerated fixture")
    return ap


def check_checkout(root: Path, marker: str) -> Path:
    """The checkout must hold `marker` (a file of the official repository); one clear line if not."""
    root = root.resolve()
    if not (root / marker).is_file():
        sys.exit(f"error: {root} does not look like the official checkout: {marker} is missing")
    return root


def skip_package_inits(root: Path, top: str) -> None:
    """Register every folder under root/top as a package whose `__init__` never runs.

    The official packages' `__init__` files import whole training and inference stacks (decord,
    peft, T5, distributed helpers); registering the folders as bare packages lets a generator
    import the one module file it needs, unchanged, with its own relative and absolute imports.
    """
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    for folder, _dirs, _files in os.walk(root / top):
        name = os.path.relpath(folder, root).replace(os.sep, ".")
        if name in sys.modules or "__pycache__" in name:
            continue
        mod = types.ModuleType(name)
        mod.__path__ = [folder]
        sys.modules[name] = mod


def stub_module(name: str, **attrs) -> types.ModuleType:
    """A stand-in for a dependency the official code imports but the fixture never uses."""
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def cpu_fp32() -> None:
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float32)
    torch.manual_seed(0)


def draw_weights(module: torch.nn.Module, seed: int, overrides: dict | None = None) -> None:
    """The fixtures' weight rule, in `named_parameters()` order from one seeded generator.

    Normalisation gains (the weight of a module whose class name contains "Norm", an RMS_norm
    `gamma`, a weight-norm magnitude) are 1 + 0.2·N(0,1); other tensors of two or more dims are
    N(0,1)/sqrt(prod(shape[1:])); 1-D tensors are 0.2·N(0,1). `overrides` maps a parameter name
    to a function of the standard-normal draw (a family's documented exception).
    """
    overrides = overrides or {}
    gains = set()
    for mname, mod in module.named_modules():
        for pname, _p in mod.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            if (pname == "weight" and "Norm" in type(mod).__name__) or pname in GAIN_NAMES:
                gains.add(full)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            z = torch.randn(p.shape, generator=gen)
            if name in overrides:
                p.copy_(overrides[name](z))
            elif name in gains:
                p.copy_(1 + 0.2 * z)
            elif p.dim() >= 2:
                p.copy_(z / math.sqrt(math.prod(p.shape[1:])))
            else:
                p.copy_(0.2 * z)


def read_fixture(path: Path):
    """(metadata, config, settings, tensors) of a fixture."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != FORMAT:
        sys.exit(f"error: {path} is not an {FORMAT} fixture (format {meta.get('format')!r})")
    return meta, json.loads(meta["config"]), json.loads(meta["settings"]), tensors


def group(tensors: dict, prefix: str) -> dict:
    return {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}


def write_and_compare(out: Path, meta: dict, like_tensors: dict, weights: dict, inputs: dict,
                      expected: dict, settings_update: dict | None = None) -> dict:
    """Write the regenerated fixture (metadata from the `--like` file) and compare it with that file."""
    from safetensors.torch import save_file

    tensors = {f"weights.{k}": v for k, v in weights.items()}
    tensors.update({f"inputs.{k}": v for k, v in inputs.items()})
    tensors.update({f"expected.{k}": v for k, v in expected.items()})
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in tensors.items()}
    meta = dict(meta)
    if settings_update:
        settings = json.loads(meta["settings"])
        settings.update(settings_update)
        meta["settings"] = json.dumps(settings)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=meta)

    report = {"fixture": str(out), "like": meta.get("family"), "missing": [], "extra": [],
              "groups": {}, "tensors": {}}
    report["missing"] = sorted(set(like_tensors) - set(tensors))
    report["extra"] = sorted(set(tensors) - set(like_tensors))
    for key in sorted(set(tensors) & set(like_tensors)):
        a, b = tensors[key], like_tensors[key].to(torch.float32)
        if a.shape != b.shape:
            diff = float("inf")
        else:
            diff = (a - b).abs().max().item() if a.numel() else 0.0
        grp = key.split(".", 1)[0]
        g = report["groups"].setdefault(grp, {"tensors": 0, "bit_equal": 0, "max_abs_diff": 0.0})
        g["tensors"] += 1
        g["bit_equal"] += int(a.shape == b.shape and torch.equal(a, b))
        g["max_abs_diff"] = max(g["max_abs_diff"], diff)
        if grp != "weights":
            report["tensors"][key] = {"max_abs_diff": diff, "max_abs": b.abs().max().item()}
    return report


def finish(report: dict, tolerance: float = 1e-5) -> None:
    """Print the report; exit 1 if a tensor is missing or any group is off by more than
    tolerance · max(1, max|expected|)."""
    bad = bool(report["missing"] or report["extra"])
    for key, row in report["tensors"].items():
        row["ok"] = row["max_abs_diff"] <= tolerance * max(1.0, row["max_abs"])
        bad |= not row["ok"]
    weights = report["groups"].get("weights", {})
    bad |= weights.get("max_abs_diff", 0.0) > tolerance
    report["ok"] = not bad
    print(json.dumps(report))  # one line, the last one (official modules may print at import)
    sys.exit(1 if bad else 0)
