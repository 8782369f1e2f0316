"""The package graph docs/ARCHITECTURE.md draws ("The folders") is the code's: import-linter's
contracts in pyproject.toml (``[tool.importlinter]``: the layers, the folders that must not know
each other, no cycle between the packages or modules of any one package), imports inside
functions and under TYPE_CHECKING included.

The contracts are checked on the package as it installs: workers/, lua/ and migrations/ install as
conductor.workers, conductor.lua and conductor.migrations (``[tool.setuptools.package-dir]``),
which import-linter, reading conductor/ from the disk, would not see. So the check lays the
installed tree out in a temporary folder (links to the source files) and runs ``lint-imports``
there. ``python -m tests.test_layers`` runs it by hand and prints import-linter's report.

The table itself is read too: its layers must be the contract's, and each folder's "imports" the
folders it does import (grimp, the graph import-linter reads), so that the page cannot drift."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def installed_tree(dest: Path) -> Path:
    """The package ``conductor`` as setuptools installs it, under ``dest``, its modules linked to
    the source files; returns ``dest``."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    dirs = {name: ROOT / name.replace(".", "/") for name in setup["packages"]}
    dirs.update({name: ROOT / path for name, path in setup.get("package-dir", {}).items()})
    for name, src in dirs.items():
        out = dest.joinpath(*name.split("."))
        out.mkdir(parents=True, exist_ok=True)
        for f in src.glob("*.py"):
            (out / f.name).symlink_to(f)
    return dest


def lint_imports() -> subprocess.CompletedProcess[str]:
    """import-linter's run over the installed tree, with the contracts of pyproject.toml."""
    with tempfile.TemporaryDirectory(prefix="cdr-layers-") as tmp:
        tree = installed_tree(Path(tmp))
        env = {**os.environ, "PYTHONPATH": str(tree)}
        # lint-imports as its console script runs it, with this interpreter (whatever holds the scripts)
        cli = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
        return subprocess.run([sys.executable, "-c", cli, str(ROOT / "pyproject.toml"), "--no-cache"],
                              cwd=tree, env=env, capture_output=True, text=True, timeout=300)


def test_the_package_graph_keeps_every_contract():
    run = lint_imports()
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout, run.stdout


# The direct imports between the folders (conductor's children), read by grimp in the installed tree.
_EDGES = """
import json, grimp
g = grimp.build_graph("conductor", cache_dir=None)
kids = sorted(m.split(".")[1] for m in g.find_children("conductor"))
print(json.dumps({a: sorted(b for b in kids if b != a and g.direct_import_exists(
    importer=f"conductor.{a}", imported=f"conductor.{b}", as_packages=True)) for a in kids}))
"""


def folder_edges() -> dict[str, set[str]]:
    with tempfile.TemporaryDirectory(prefix="cdr-layers-") as tmp:
        tree = installed_tree(Path(tmp))
        run = subprocess.run([sys.executable, "-c", _EDGES], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                             capture_output=True, text=True, timeout=300, check=True)
    return {a: set(b) for a, b in json.loads(run.stdout).items()}


def _names(cell: str) -> set[str]:
    """The folders a cell of the table names: `cli/`, `embedded.py` (not `conductor.lua`, its installed name)."""
    return {re.sub(r"(/|\.py)$", "", n) for n in re.findall(r"`([^`]+)`", cell) if not n.startswith("conductor.")}


def architecture_table() -> list[tuple[int, set[str], set[str]]]:
    """docs/ARCHITECTURE.md's "The folders": (layer, folders, the folders they import) per row."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("## The folders", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].isdigit():
            rows.append((int(cells[0]), _names(cells[1]), set() if cells[3].startswith("—") else _names(cells[3])))
    return rows


def test_architecture_md_draws_the_layers_the_contract_checks():
    contract = next(c for c in tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]
                    ["importlinter"]["contracts"] if c["type"] == "layers")
    layers = [{n.strip().strip("()") for n in layer.split("|")} for layer in contract["layers"]]
    drawn: dict[int, set[str]] = {}
    for n, folders, _ in architecture_table():
        drawn.setdefault(n, set()).update(folders)
    assert [drawn[n] for n in sorted(drawn)] == layers


def test_architecture_md_names_the_imports_of_each_folder():
    # every folder imports conductor/errors.py (the table says so once): the rest row by row
    edges = {a: b - {"errors"} for a, b in folder_edges().items()}
    drawn = {f: imports for _, folders, imports in architecture_table() for f in folders}
    assert drawn == edges


def test_the_installed_tree_holds_every_package():
    # the check sees the folders that install under conductor: a module in each, linked
    with tempfile.TemporaryDirectory() as tmp:
        tree = installed_tree(Path(tmp)) / "conductor"
        for sub in ("workers/worker.py", "workers/engines/base.py", "lua/__init__.py", "migrations/0001_initial.py",
                    "redis_contract/keys.py"):
            assert (tree / sub).resolve().is_file(), sub


if __name__ == "__main__":
    result = lint_imports()
    print(result.stdout + result.stderr, end="")
    sys.exit(result.returncode)
