"""Every committed parity fixture can be traced to a generator in tools/parity/ (issue 37 item 17).

A fixture's `source` metadata names the official repository and commit that produced its expected
tensors. For each fixture, some `tools/parity/make_*.py` must declare the fixture's family in
`FAMILIES` and every `owner/repo@commit` of its `source` in `SOURCES` (a fixture may abbreviate the
commit; the script spells it in full). No official code is needed: the scripts are read, not run.
docs/parity-fixtures.md ("Regenerating the fixtures") says how to run them against a checkout.
"""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "fixtures" / "golden"
TOOLS = ROOT / "tools" / "parity"
REF = re.compile(r"([A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+)@([0-9A-Za-z_.-]+)")
FIXTURES = sorted(GOLDEN.glob("*.safetensors"))


def declared() -> dict[str, dict[str, tuple[str, ...]]]:
    """{script name: {"FAMILIES": (...), "SOURCES": (...)}}, read with ast (nothing is imported)."""
    out = {}
    for path in sorted(TOOLS.glob("make_*.py")):
        found = {}
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                name = getattr(node.targets[0], "id", None)
                if name in ("FAMILIES", "SOURCES"):
                    found[name] = tuple(ast.literal_eval(node.value))
        out[path.name] = found
    return out


def covers(script_sources: tuple[str, ...], repo: str, commit: str) -> bool:
    for entry in script_sources:
        srepo, scommit = entry.split("@", 1)
        if srepo == repo and (scommit == commit or (len(commit) >= 7 and scommit.startswith(commit))):
            return True
    return False


def test_the_generators_declare_full_commits():
    scripts = declared()
    assert scripts, f"no generator scripts in {TOOLS}"
    for name, found in scripts.items():
        assert found.get("FAMILIES") and found.get("SOURCES"), f"{name} declares no FAMILIES/SOURCES"
        for entry in found["SOURCES"]:
            repo, commit = entry.split("@", 1)
            assert re.fullmatch(r"[0-9a-f]{40}", commit) or re.fullmatch(r"v\d+(\.\d+)+", commit), \
                f"{name}: {entry} is not pinned to a full commit or a release tag"


@pytest.mark.parametrize("path", FIXTURES, ids=[p.stem for p in FIXTURES])
def test_every_fixture_source_is_declared_by_a_generator(path):
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    family, refs = meta["family"], REF.findall(meta["source"])
    assert json.loads(meta["settings"]) is not None and refs, f"{path.name}: no repo@commit in source"
    candidates = [n for n, d in declared().items() if family in d["FAMILIES"]]
    assert candidates, f"{path.name}: no script in tools/parity/ makes family {family!r}"
    for repo, commit in refs:
        assert any(covers(declared()[n]["SOURCES"], repo, commit) for n in candidates), \
            f"{path.name}: {repo}@{commit} is declared by none of {candidates}"


def test_a_source_the_scripts_do_not_declare_is_caught():
    """The check above would notice a fixture made from another commit or repository."""
    sources = declared()["make_liveavatar_dit.py"]["SOURCES"]
    assert covers(sources, "Alibaba-Quark/LiveAvatar", "9c2c38d")
    assert not covers(sources, "Alibaba-Quark/LiveAvatar", "1234567")
    assert not covers(sources, "Someone/LiveAvatar", "9c2c38d")
