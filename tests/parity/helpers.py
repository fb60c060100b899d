"""What the parity tests share: where the fixtures are, the CLI run, rewritten fixture copies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import run_cli

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"


def cli_parity(path: Path) -> dict[str, Any]:
    """`avatarstream models parity PATH --json` must exit 0; its JSON line."""
    r = run_cli("models", "parity", str(path), "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def rewrite_fixture(src: Path, dst: Path, weights: dict[str, torch.Tensor | None] | None = None,
                    **meta: Any) -> Path:
    """A copy of fixture `src` at `dst` with some weights replaced (None: removed) and some
    metadata entries replaced (dicts written as JSON)."""
    with safe_open(str(src), framework="pt") as f:
        header, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    for k, v in (weights or {}).items():
        if v is None:
            del tensors[f"weights.{k}"]
        else:
            tensors[f"weights.{k}"] = v
    header |= {k: json.dumps(v) if isinstance(v, dict) else v for k, v in meta.items()}
    save_file(tensors, str(dst), metadata=header)
    return dst
