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
# The pass bound of `models parity` per family: max abs difference, fp32 on the CPU. Each is at
# least 4x the worst figure measured over the family's fixtures (`tests/fixtures/golden/`) on the
# CPUs we ran (an AMD EPYC with AVX512-bf16 at 1 and 2 threads; an Intel Xeon where noted: CPUs
# sum in other orders), and 1e-5 at the least:
#   flashhead-dit   1.7e-6 (lite-a velocity)           liveavatar-dit  1.7e-6 (-b, 2 threads)
#   umt5            1.2e-6; Intel Xeon 2.4e-6          ltx-vae         0 (bit for bit on the EPYC)
#   wan-vae         4.3e-6 (the decodes, oneDNN's causal convolution)
#   wav2vec2        5.3e-6 (liveavatar-a hidden states, values up to 7.6)
# A port that is off by 5e-5 fails every family. `--tolerance` overrides it.
FAMILY_TOLERANCE: dict[str, float] = {"flashhead-dit": 1e-5, "liveavatar-dit": 1e-5, "umt5": 1e-5,
                                      "ltx-vae": 1e-5, "wan-vae": 2e-5, "wav2vec2": 3e-5}


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


def family_tolerance(family: str) -> float:
    """The default pass bound of `family` (FAMILY_TOLERANCE)."""
    return FAMILY_TOLERANCE[family]


def run_parity(path: str | Path, *, tolerance: float | None = None) -> dict[str, Any]:
    """Run our implementation on a fixture: {"family", "variant", "max_abs_diff",
    "max_abs_expected", "tolerance", "pass", "outputs": {name: max abs diff}}. `tolerance`: the
    pass bound (None: the family's, FAMILY_TOLERANCE)."""
    fx = load_fixture(path)
    if fx.family not in FAMILIES:
        raise InputError(f"{fx.path}: unknown family {fx.family!r}; known: {', '.join(sorted(FAMILIES))}")
    modname = FAMILIES[fx.family]
    if modname is None:
        raise ConfigError(f"family {fx.family!r} is not yet supported by `models parity`")
    if tolerance is None:
        tolerance = family_tolerance(fx.family)
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
