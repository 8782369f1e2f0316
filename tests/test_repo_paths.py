"""Issue 34: every repo path named in a comment, docstring or document exists. A module moved or renamed
leaves pointers behind (23 comments and docs named files that no longer existed); this finds them."""

from __future__ import annotations

import re
import subprocess

from tests.conftest import ROOT

TOP = ("conductor", "workers", "lua", "migrations", "tests", "bench", "deploy", "docs", "examples", ".ci")
# a path of the repository: a top-level folder, then names, ending in a file with an extension we keep
_TOPS = "|".join(re.escape(t) for t in TOP)
PATH = re.compile(r"(?<![\w./{-])((?:" + _TOPS + r")/[\w./@{}%*-]*[\w*])")
SCANNED = (".py", ".lua", ".md", ".yml", ".yaml", ".toml", ".service", ".example", ".acl", ".conf", "")
# conductor.workers etc. install from these folders; a dotted module path in prose is not checked here
INSTALLED_AS = {"conductor/workers/": "workers/", "conductor/lua/": "lua/", "conductor/migrations/": "migrations/"}


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=str(ROOT), capture_output=True, text=True, check=True).stdout
    return [p for p in out.splitlines() if p.endswith(SCANNED) and "/RESULTS" not in p]


def _exists(path: str) -> bool:
    for alias, real in INSTALLED_AS.items():
        if path.startswith(alias):
            path = real + path[len(alias):]
    if "NNNN" in path or "NEW." in path:  # a placeholder: migrations/NNNN_name.py, retries/NEW.jsonl
        return True
    if any(ch in path for ch in "*{}%<"):  # a pattern (lua/*.lua, deploy/systemd/conductor-worker@%i)
        return bool(list(ROOT.glob(re.sub(r"\{[^}]*\}|%\w|<[^>]*>", "*", path).rstrip("/"))))
    path = path.rstrip(".")
    return (ROOT / path).exists()


def test_every_repo_path_named_in_code_and_docs_exists():
    stale = []
    for rel in _tracked():
        text = (ROOT / rel).read_text(errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            for m in PATH.finditer(line):
                name = m.group(1)
                last = name.rsplit("/", 1)[-1]
                if "." not in last and not (ROOT / name).is_dir():
                    continue  # prose like "lua/ and Python" or a folder named loosely
                if not _exists(name):
                    stale.append(f"{rel}:{n}: {name}")
    assert not stale, "paths that do not exist:\n" + "\n".join(stale)
