from tests.conftest import ROOT


def _commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.startswith("    python3 -m venv")]


def test_readme_opens_with_the_main_job_and_the_tests_and_ci_runs_the_latter():
    main, tests = _commands()[:2]
    assert "conductor run" in main
    assert "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text()


def test_ci_lints_with_ruff_and_fails_on_lint_errors():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci
    assert "if ! .venv/bin/ruff check .; then" in ci and "exit 1" in ci.split("ruff check .", 1)[1]


def test_ci_type_checks_the_package_with_mypy_strict():
    import tomllib

    ci = (ROOT / ".ci" / "run").read_text()
    assert "if ! .venv/bin/mypy; then" in ci and "exit 1" in ci.split(".venv/bin/mypy;", 1)[1]
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    # conductor/ and the worker (workers/, installed as conductor.workers)
    assert cfg["tool"]["mypy"]["strict"] is True and cfg["tool"]["mypy"]["files"] == ["conductor", "workers"]
    skipped = [o for o in cfg["tool"]["mypy"].get("overrides", []) if o.get("follow_imports") == "skip"
               or o.get("ignore_errors")]
    assert not skipped, skipped
    assert any(dep.startswith("mypy==") for dep in cfg["project"]["optional-dependencies"]["test"])
