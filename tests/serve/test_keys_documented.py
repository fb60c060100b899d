"""Bug 13 of issue 30: without `--api-key` the server accepts any non-empty bearer key, each its
own tenant, and nothing said so. `serve --help` and the README's "Limits and guarantees" now do."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import run_cli

README = Path(__file__).resolve().parents[2] / "README.md"


def _says_open_keys(text: str) -> bool:
    flat = re.sub(r"\s+", " ", text.replace("*", "")).lower()
    return "any non-empty bearer key is accepted" in flat and "tenant" in flat


def test_serve_help_says_any_bearer_is_a_tenant_without_api_key():
    r = run_cli("serve", "--help")
    assert r.returncode == 0 and _says_open_keys(r.stdout)


def test_readme_limits_section_says_how_keys_work():
    text = README.read_text()
    section = text[text.index("## Limits and guarantees"):]
    section = section[: section.index("\n## ", 3)]
    assert "--api-key" in section and _says_open_keys(section)
