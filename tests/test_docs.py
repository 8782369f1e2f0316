"""Issue 34: the README is a front door and the reference lives in docs/; the parts of docs/ that
restate code are generated from it and checked here, so a page never lacks a field or a key."""

from __future__ import annotations

import re

from tests.conftest import ROOT

PAGES = ("cli", "formats", "jobs", "configuration", "engines", "batch-api", "durability", "redis-layout",
         "operations", "ARCHITECTURE")


def _between(text: str, name: str) -> str:
    start = text.index(f"<!-- BEGIN {name}")
    start = text.index("-->", start) + 3
    return text[start:text.index(f"<!-- END {name} -->", start)].strip("\n")


def test_the_readme_is_a_front_door_that_links_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in PAGES:
        assert (ROOT / "docs" / f"{page}.md").exists(), page
        assert f"docs/{page}.md" in readme, page
    # every docs page is linked, none is orphaned
    assert {p.stem for p in (ROOT / "docs").glob("*.md")} == set(PAGES)


def test_the_thresholds_table_is_config_fields():
    from conductor.redis_contract.config import markdown_table
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert _between(page, "thresholds") == markdown_table(), (
        "docs/configuration.md's thresholds table differs from conductor/redis_contract/config.py; paste:\n"
        + markdown_table())


def test_the_key_layout_page_is_keys_py():
    from conductor.redis_contract import keys
    doc = keys.__doc__ or ""
    block = doc[doc.index("::\n") + 3:].strip("\n").splitlines()
    layout = []
    for line in block:
        if line and not line.startswith("    "):
            break
        layout.append(line)
    want = "\n".join(layout).rstrip()
    page = (ROOT / "docs" / "redis-layout.md").read_text()
    assert _between(page, "keys") == want, (
        "docs/redis-layout.md's key list differs from conductor/redis_contract/keys.py's docstring; paste:\n" + want)


def test_every_command_the_readme_names_exists():
    from conductor.cli.main import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    known = set(sub.choices)  # type: ignore[attr-defined]
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"^\s+conductor (\w[\w-]*)", readme, re.M))
    assert named and named <= known, named - known
