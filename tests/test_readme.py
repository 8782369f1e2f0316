from tests.conftest import ROOT


def _commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.startswith("    python3 -m venv")]


def test_readme_opens_with_the_main_job_and_the_tests_and_ci_runs_the_latter():
    main, tests = _commands()[:2]
    assert "conductor run" in main
    assert "pytest" in tests
    assert tests in (ROOT / ".ci" / "run").read_text()
    # issue 37: the main job installs the package alone, not the test extras (117 packages, 743 MB)
    assert "pip install -q -e . &&" in main and "[" not in main.split("conductor run")[0]


def test_what_the_readme_commands_write_in_the_clone_is_ignored_by_git():
    import shutil
    import subprocess
    ignored = ["results.jsonl", "labels-1.jsonl", "redis.log", "appendonlydir/x.aof", "dump.rdb", "fleet.jsonl",
               "fleet-out.jsonl", "results.partial.jsonl"]
    if shutil.which("git") and subprocess.run(["git", "rev-parse"], cwd=str(ROOT), capture_output=True).returncode == 0:
        p = subprocess.run(["git", "check-ignore", "--no-index", *ignored], cwd=str(ROOT), capture_output=True,
                           text=True)
        assert sorted(p.stdout.split()) == sorted(ignored), p.stdout
    else:  # a tree without git: the patterns are there
        text = (ROOT / ".gitignore").read_text()
        assert all(f"/{name.split('/')[0]}" in text for name in ignored[:-1])


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


def _block_after(heading: str, page: str = "README.md") -> list[str]:
    """The first indented code block after ``heading`` in ``page``, one command per line."""
    text = (ROOT / page).read_text()
    lines = text[text.index(heading):].splitlines()[1:]
    start = next(i for i, ln in enumerate(lines) if ln.startswith("    "))
    block = []
    for ln in lines[start:]:
        if not ln.startswith("    "):
            break
        block.append(ln[4:])
    return block


def test_using_it_runs_as_written_after_the_setup_line(redis_url, tmp_path):
    """Issue 29: "Using it" began with a `conductor` that was not on PATH, a prompts.jsonl that is
    examples/prompts.jsonl, a Redis nothing started, and redis-cli recipes for fields that moved.
    The block runs here line by line in bash, from a folder holding the clone's examples; the
    test's own Redis stands for the one the block starts, and this checkout's .venv for the one
    the setup line makes."""
    import subprocess
    import sys

    block = _block_after("## Using it")
    assert block[0].startswith("source .venv/bin/activate") and "redis-server" in block[1]
    # issue 37: a Redis of its own that keeps its data (AOF), never whatever answers on 6379
    assert "--appendonly yes" in block[1] and "--save ''" not in block[1] and "ping ||" not in block[1]
    assert "redis://127.0.0.1:6390/0" in block[2]
    script = []
    for ln in block:
        if ln.startswith("source .venv/bin/activate"):
            script.append(f'export PATH="{ROOT / ".venv" / "bin"}:{sys.exec_prefix}/bin:$PATH"')
        elif "redis-server" in ln:
            continue
        else:
            script.append(ln.replace("redis://127.0.0.1:6390/0", redis_url))
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", "\n".join(script)], cwd=str(tmp_path),
                       capture_output=True, timeout=240)
    assert p.returncode == 0, (p.stdout.decode()[-2000:], p.stderr.decode()[-2000:])
    assert len((tmp_path / "labels-1.jsonl").read_text().splitlines()) == 1000
    assert "labels-1" in p.stdout.decode() and "completed" in p.stdout.decode()
    # the redis-cli recipes read keys that hold what their comments say, after that job
    layout = _block_after("## Inspecting with redis-cli", "docs/redis-layout.md")
    recipes = [ln.split("#")[0].split()[1:] for ln in layout if ln.startswith("redis-cli HGETALL")]
    assert len(recipes) >= 4
    for cmd in recipes:
        got = subprocess.run(["redis-cli", "-u", redis_url, cmd[0], cmd[1].strip("'")], capture_output=True,
                             timeout=30).stdout.split()
        assert got, cmd
        if cmd[1].endswith(":job:labels-1'"):
            assert b"ended_ms" in got and b"completed" in got
