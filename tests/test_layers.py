"""The package graph docs/ARCHITECTURE.md draws ("The folders") is the code's: import-linter's
contracts in pyproject.toml (``[tool.importlinter]``: the layers, the folders that must not know
each other, no cycle between the packages or modules of any one package), imports inside
functions and under TYPE_CHECKING included.

The contracts are checked on the package as it installs: workers/, lua/ and migrations/ install as
conductor.workers, conductor.lua and conductor.migrations (``[tool.setuptools.package-dir]``),
which import-linter, reading conductor/ from the disk, would not see. So the check lays the
installed tree out in a temporary folder (links to the source files) and runs ``lint-imports``
there. ``python -m tests.test_layers`` runs it by hand and prints import-linter's report."""

from __future__ import annotations

import os
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
