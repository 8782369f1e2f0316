"""No code path may execute data: no pickle, marshal, shelve, eval/exec, yaml.load, and no
Lua loadstring. A queue's payloads come from other people."""

import os
import re
from pathlib import Path

from tests.conftest import ROOT

SKIP_DIRS = {".venv", ".git", "__pycache__", ".hypothesis", ".pytest_cache", ".ruff_cache", "node_modules"}
PY_BANNED = {
    "pickle": re.compile(r"\b(import|from)\s+(c?pickle|cloudpickle|jsonpickle|dill|shelve|marshal)\b"
                         r"|\b(c?pickle|cloudpickle|jsonpickle|dill|shelve|marshal)\s*\.\s*\w+\s*\("),
    "eval/exec": re.compile(r"(?<![\w.])(eval|exec)\s*\("),
    "yaml.load": re.compile(r"\byaml\s*\.\s*(load|load_all|unsafe_load|full_load)\s*\(|yaml\.(Unsafe|Full)?Loader\b"),
    "__import__ of data": re.compile(r"(?<![\w.])__import__\s*\("),
    "shell=True": re.compile(r"shell\s*=\s*True"),
}
LUA_BANNED = re.compile(r"(?<![\w.])(loadstring|load|dofile|loadfile)\s*\(")
THIS = Path(__file__).resolve()


def source_files(suffix: str) -> list[Path]:
    out = []
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS]
        out += [Path(d) / f for f in files if f.endswith(suffix) and (Path(d) / f).resolve() != THIS]
    return out


def strip_comments_py(line: str) -> str:
    return line.split("#", 1)[0] if "#" in line and not re.search(r"[\"'].*#.*[\"']", line) else line


def test_no_python_code_executes_data():
    files = source_files(".py")
    assert len(files) > 20 and any(p.relative_to(ROOT).as_posix() == "conductor/client/__init__.py" for p in files)
    hits = []
    for p in files:
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            code = strip_comments_py(line)
            for what, rx in PY_BANNED.items():
                if rx.search(code):
                    hits.append(f"{p.relative_to(ROOT)}:{n}: {what}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_no_lua_script_loads_code():
    files = source_files(".lua")
    assert any(p.name == "claim.lua" for p in files)
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
            for p in files for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
            if LUA_BANNED.search(line.split("--", 1)[0])]
    assert not hits, "\n".join(hits)


def test_the_scan_would_catch_each_banned_form():
    samples = ["import pickle", "from cloudpickle import dumps", "pickle.loads(b)",
               "data = marshal.loads(b)", "eval(text)", "exec(code)", "yaml.load(f)",
               "yaml.load(f, Loader=yaml.Loader)", "subprocess.run(cmd, shell=True)", "__import__(name)"]
    for s in samples:
        assert any(rx.search(s) for rx in PY_BANNED.values()), s
    allowed = ["r.eval(script, 0)", '"""msgspec, no pickle anywhere"""', "yaml.safe_load(f)", "s.evaluate(x)"]
    for s in allowed:
        assert not any(rx.search(s) for rx in PY_BANNED.values()), s
    assert LUA_BANNED.search("local f = loadstring(ARGV[1])") and not LUA_BANNED.search("cmsgpack.unpack(x)")
