"""Reading a parity fixture and judging a port's outputs against it."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from avatarstream.errors import ConfigError, InputError
from avatarstream.parity import FAMILIES

FORMAT = "avatarstream-parity/1"
TOLERANCE = 1e-4  # max abs difference in fp32 (issue 28; a correct port lands near 1e-6)


@dataclass
class Fixture:
    path: Path
    family: str
    config: dict[str, Any]
    settings: dict[str, Any]
    weights: dict[str, torch.Tensor] = field(repr=False)  # official state-dict keys
    inputs: dict[str, torch.Tensor] = field(repr=False)
    expected: dict[str, torch.Tensor] = field(repr=False)
    source: str = ""
    note: str = ""

    @property
    def variant(self) -> str | None:
        return self.settings.get("variant")


def load_fixture(path: str | Path) -> Fixture:
    """The fixture at `path`, or one clear InputError (missing, not safetensors, not a fixture)."""
    from safetensors import SafetensorError, safe_open

    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: no such fixture file")
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise InputError(f"{p}: not a readable safetensors file ({e})") from None
    if meta.get("format") != FORMAT:
        raise InputError(f"{p}: not a parity fixture (metadata format {meta.get('format')!r}, "
                         f"expected {FORMAT!r})")
    try:
        config, settings = json.loads(meta["config"]), json.loads(meta["settings"])
    except (KeyError, json.JSONDecodeError) as e:
        raise InputError(f"{p}: fixture metadata is incomplete or not JSON ({e})") from None

    def group(prefix: str) -> dict[str, torch.Tensor]:
        return {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}

    return Fixture(p, meta.get("family", ""), config, settings, group("weights"), group("inputs"),
                   group("expected"), meta.get("source", ""), meta.get("note", ""))


def run_parity(path: str | Path, *, tolerance: float = TOLERANCE) -> dict[str, Any]:
    """Run our implementation on a fixture: {"family", "variant", "max_abs_diff",
    "max_abs_expected", "tolerance", "pass", "outputs": {name: max abs diff}}."""
    fx = load_fixture(path)
    if fx.family not in FAMILIES:
        raise InputError(f"{fx.path}: unknown family {fx.family!r}; known: {', '.join(sorted(FAMILIES))}")
    modname = FAMILIES[fx.family]
    if modname is None:
        raise ConfigError(f"family {fx.family!r} is not yet supported by `models parity`")
    run = importlib.import_module(modname).run
    with torch.inference_mode():
        outputs = run(fx)
    diffs: dict[str, float] = {}
    for name, want in fx.expected.items():
        if name not in outputs:
            continue  # a debugging output the port does not reproduce (the README says which)
        got = outputs[name].detach().float().cpu()
        # a wrong shape is a failed comparison, not a crash of the tool
        diffs[name] = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
    if not diffs:
        raise ConfigError(f"{fx.family}: the port produced none of {sorted(fx.expected)}")
    worst = max(diffs.values())
    return {"family": fx.family, "variant": fx.variant, "fixture": fx.path.name,
            "max_abs_diff": worst,
            "max_abs_expected": max(float(fx.expected[k].abs().max()) for k in diffs),
            "tolerance": tolerance, "pass": worst <= tolerance, "outputs": diffs}
