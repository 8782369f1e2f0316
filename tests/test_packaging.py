"""An install claims only the ``conductor`` import name (issue 14): the worker code lives in the
top-level ``workers/`` folder but installs as ``conductor.workers`` (pyproject's package-dir, the
way ``lua/`` installs as ``conductor.lua``), and nothing imports a top-level ``workers``."""

import ast
import importlib.metadata
import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_pyproject_packages_all_under_conductor():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = tool["packages"]
    assert packages and all(p == "conductor" or p.startswith("conductor.") for p in packages), packages
    assert {"conductor.workers", "conductor.workers.engines"} <= set(packages)
    assert tool["package-dir"]["conductor.workers"] == "workers"
    assert tool["package-dir"]["conductor.workers.engines"] == "workers/engines"


def test_installed_top_level_is_only_conductor():
    dist = importlib.metadata.distribution("conductor")
    top_level = dist.read_text("top_level.txt")
    assert top_level is not None, "the installed distribution names no top-level packages"
    assert top_level.split() == ["conductor"]


def test_worker_importable_as_conductor_workers():
    import conductor.workers.engines.sim
    import conductor.workers.worker

    assert pathlib.Path(conductor.workers.worker.__file__).resolve() == ROOT / "workers" / "worker.py"
    assert conductor.workers.engines.sim.SimEngine


def test_nothing_imports_top_level_workers():
    offenders = []
    for folder in ("conductor", "workers", "tests", "bench", "migrations"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names
                              if n == "workers" or n.startswith("workers.")]
    assert not offenders, offenders


def test_every_package_folder_is_installed():
    # pyproject lists packages by name: a subpackage left out installs nothing of it (an editable
    # install still finds it, so only a real install would fail).
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    for init in (ROOT / "conductor").rglob("__init__.py"):
        rel = init.parent.relative_to(ROOT)
        assert ".".join(rel.parts) in packages, rel


def test_the_package_is_split_by_concern():
    # Issue 28: one home per concept. The top level keeps what every part shares (the public API,
    # the errors, the embedded redis-server for `conductor run` and tests); the rest lives in the
    # subpackage of its concern.
    top = sorted(p.name for p in (ROOT / "conductor").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "embedded.py", "errors.py"], top
    subpackages = sorted(p.parent.name for p in (ROOT / "conductor").glob("*/__init__.py"))
    assert subpackages == ["api", "cli", "client", "formats", "intake", "jobs", "observability", "redis_contract",
                           "tier", "verify"], subpackages


def test_the_console_script_and_python_m_reach_the_cli():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"conductor": "conductor.cli.main:main"}
    assert "from conductor.cli.main import main" in (ROOT / "conductor" / "__main__.py").read_text()
