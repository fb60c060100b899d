"""What the parity tests share: where the fixtures are, the CLI run, rewritten fixture copies."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file


GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"


# One fresh Python process runs the CLI's `main` (argument parsing, the command, its JSON line and
# exit code, the default thread count) on every fixture a CLI test asks about: a process per
# fixture spent most of its time importing torch. `python -m avatarstream.cli models parity` itself
# is still run by the error-path tests (test_fixture.py and the per-family bad-fixture tests).
_RUNNER = """
import json, sys
from avatarstream.cli import main
for path in sys.argv[1:]:
    code = main(["models", "parity", path, "--json"])
    print(json.dumps({"cli_parity_fixture": path, "exit": code}), flush=True)
"""


@functools.cache
def _cli_parity_runs() -> dict[str, tuple[int, list[str]]]:
    """{fixture path: (exit code, the lines the CLI printed)} for every golden fixture but umt5's
    (no CLI test runs it)."""
    paths = [str(p) for p in sorted(GOLDEN.glob("*.safetensors")) if not p.name.startswith("umt5-")]
    r = subprocess.run([sys.executable, "-c", _RUNNER, *paths], capture_output=True, text=True,
                       timeout=900)
    runs: dict[str, tuple[int, list[str]]] = {}
    lines: list[str] = []
    for line in r.stdout.splitlines():
        end = json.loads(line) if line.startswith('{"cli_parity_fixture"') else None
        if end is None:
            lines.append(line)
        else:
            runs[end["cli_parity_fixture"]], lines = (end["exit"], lines), []
    assert r.returncode == 0 and len(runs) == len(paths), (r.returncode, sorted(runs), r.stderr[-3000:])
    return runs


def cli_parity(path: Path) -> dict[str, Any]:
    """`avatarstream models parity PATH --json` must exit 0; its JSON line."""
    code, lines = _cli_parity_runs()[str(path)]
    assert code == 0, lines
    assert len(lines) == 1, lines  # --json: only the JSON line
    return json.loads(lines[-1])


def rewrite_fixture(src: Path, dst: Path, weights: dict[str, torch.Tensor | None] | None = None,
                    expected: dict[str, torch.Tensor] | None = None, **meta: Any) -> Path:
    """A copy of fixture `src` at `dst` with some weights replaced (None: removed), some expected
    tensors replaced and some metadata entries replaced (dicts written as JSON)."""
    with safe_open(str(src), framework="pt") as f:
        header, tensors = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    for k, v in (weights or {}).items():
        if v is None:
            del tensors[f"weights.{k}"]
        else:
            tensors[f"weights.{k}"] = v
    for k, v in (expected or {}).items():
        tensors[f"expected.{k}"] = v
    header |= {k: json.dumps(v) if isinstance(v, dict) else v for k, v in meta.items()}
    save_file(tensors, str(dst), metadata=header)
    return dst
