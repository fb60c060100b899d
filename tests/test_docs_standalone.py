"""The repository's docs stand alone (issue 37 item 11): no file points into the developers'
`shared` folder, which is not part of the repository, nor names one of the developers' spec files
there without the path (a model spec's `§5`, the architecture notes, a reference document's
`NNN_<16 hex>` name). The fixture format, the real-model specs and the architecture are in docs/
(parity-fixtures.md, real-models.md, architecture.md)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = "shared" + "/"  # spelled in pieces so that this file does not match itself
FORBIDDEN = tuple(SHARED + tail for tail in ("golden", "real-models", "ARCHITECTURE")) + ("../" + "shared",)
# the developers' spec files by bare name (a docs/ file of the same name would be ours), and the
# reference documents' names (three digits, `_`, 16 hex digits)
SPEC_NAMES = re.compile(r"(?<![\w.-])(?<!docs/)(?:flashhead|liveavatar|verification|ARCHITECTURE)[.]md\b"
                        r"|\b[0-9]{3}_[0-9a-f]{16}\b")


def repository_files() -> list[Path]:
    """Tracked files plus new ones git does not ignore (what the next commit can hold)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files are unknown")
    return [ROOT / name for name in out.decode().split("\0") if name and (ROOT / name).is_file()]


def offending(paths, root: Path = ROOT) -> list[str]:
    hits = []
    for path in paths:
        text = path.read_bytes().decode("utf-8", errors="replace")
        hits += [f"{path.relative_to(root)}: {word}" for word in FORBIDDEN if word in text]
        hits += [f"{path.relative_to(root)}: {m.group()}" for m in SPEC_NAMES.finditer(text)]
    return hits


def test_no_file_points_into_the_shared_folder():
    files = repository_files()
    assert any(p.name == "README.md" for p in files)
    assert offending(files) == []


def test_the_check_finds_a_reference(tmp_path):
    bad = tmp_path / "note.md"
    bad.write_text("see " + SHARED + "golden/README.md for the format\n")
    good = tmp_path / "ok.md"
    good.write_text("see docs/parity-fixtures.md; a " + SHARED + " memory segment is something else\n")
    assert offending([bad, good], tmp_path) == ["note.md: " + SHARED + "golden"]


def test_the_check_finds_a_bare_spec_file_name(tmp_path):
    """The spec files named without their folder, in a comment or a docstring, and a reference
    document's name; our own docs/ pages of similar names, and longer hex strings, pass."""
    md, ref = ".md", "00" + "1_7f52af573bcab0ad"  # in pieces, as above
    planted = {
        "a.py": "# one step (flashhead" + md + " §5, step 4)\n",
        "b.py": '"""the ring (liveavatar' + md + ' §3)."""\n',
        "c.py": "counts (verification" + md + ": large 424 tensors)\n",
        "d.md": "see ARCHITECTURE" + md + ", and real-models/liveavatar" + md + "\n",
        "e.md": "the Avatar V paper (" + ref + ".txt), §3.5\n",
        "ok.md": ("docs/flashhead" + md + " and docs/architecture.md are ours; my-liveavatar" + md
                  + " is not theirs; sha 1234_" + "0123456789abcdef0123 is longer\n"),
    }
    for name, text in planted.items():
        (tmp_path / name).write_text(text)
    found = offending([tmp_path / name for name in planted], tmp_path)
    assert found == ["a.py: flashhead" + md, "b.py: liveavatar" + md, "c.py: verification" + md,
                     "d.md: ARCHITECTURE" + md, "d.md: liveavatar" + md, "e.md: " + ref]
