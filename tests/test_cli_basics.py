"""The CLI's manners: --version, help and a shown default for every option and setting, bad values
refused in one line, expected errors as one line on stderr (never a traceback), a closed pipe
ending quietly. Each runs the real ``conductor`` command."""

import argparse
import json
import re
import subprocess
import sys

import pytest

from conductor.cli.main import build_parser
from conductor.redis_contract.config import FIELDS
from conductor.redis_contract.records import Contract
from tests.conftest import ROOT, cli, item
from tests.helpers import drain, quick


def one_line_error(p: subprocess.CompletedProcess, code: int = 2) -> str:
    err = p.stderr.decode()
    assert p.returncode == code, (p.returncode, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_version(redis_url):
    p = cli("--version", url=redis_url)
    assert re.fullmatch(rb"conductor \d+\.\d+\.\d+\n", p.stdout)


def test_every_option_has_help_and_its_default_is_shown():
    top = build_parser()
    parsers = {"conductor": top, **subparsers(top)}
    assert {"submit", "worker", "run", "status", "results", "config", "pause"} <= set(parsers)
    for name, parser in parsers.items():
        text = parser.format_help()
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
                continue
            label = action.option_strings or [action.dest]
            assert action.help, f"{name} {label[0]} has no help text"
            # SUPPRESS: a global option, again; an empty default ('', []) is noise, not shown (issue 37)
            if action.default not in (None, False, argparse.SUPPRESS, "") and action.default != []:
                shown = f"default: {action.default}"
                assert shown in re.sub(r"\s+", " ", text), f"{name} {label[0]}: {shown!r} not in its help"
    # options without a value of their own say where the value comes from
    top_help = re.sub(r"\s+", " ", top.format_help())
    assert "default: env CONDUCTOR_REDIS_URL" in top_help and "default: env CONDUCTOR_WAIT_REPLICAS" in top_help


def test_config_help_lists_every_setting_with_its_default(redis_url):
    text = re.sub(r"\s+", " ", cli("config", "--help", url=redis_url).stdout.decode())
    for name, (default, description) in FIELDS.items():
        shown = "the first worker's contract" if name.startswith("budget_") else default
        assert f"{name} (default: {shown}): {' '.join(description.split())}" in text, name


@pytest.mark.parametrize("argv", [
    ["--log-level", "bogus", "status", "j"],
    ["run", "in.jsonl", "--workers", "0", "-o", "out.jsonl"],
    ["run", "in.jsonl", "--workers", "-2", "-o", "out.jsonl"],
    ["worker", "--model", "m", "--max-batch-size", "0"],
    ["worker", "--model", "m", "--drain-s", "-1"],
    ["worker", "--model", "m", "--metrics-port", "70000"],
    ["status", "j", "--interval", "-1"],
    ["status", "j", "--interval", "nan"],
    ["trim-results", "j", "--older-than-s", "-5"],
    ["reclaim", "m", "--min-idle-ms", "-1"],
    ["--wait-replicas", "-1", "status", "j"],
    ["nosuchcommand"],
])
def test_bad_values_are_refused_in_one_line(redis_url, argv):
    err = one_line_error(cli(*argv, url=redis_url, check=False))
    assert err.startswith("conductor") and "--help" in err


def test_workers_zero_leaves_an_existing_output_file_alone(redis_url, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "model": "m", "prompt": "hi", "max_tokens": 4}) + "\n")
    out.write_text("earlier results\n")
    one_line_error(cli("run", str(src), "--workers", "0", "-o", str(out), url=redis_url, check=False))
    assert out.read_text() == "earlier results\n"


def test_a_directory_or_a_missing_file_is_one_clear_line(redis_url, tmp_path):
    err = one_line_error(cli("submit", "--create", str(tmp_path), url=redis_url, check=False))
    assert err == f"conductor: {tmp_path} is a directory, not a file"
    err = one_line_error(cli("submit", "--create", str(tmp_path / "nope.jsonl"), url=redis_url, check=False))
    assert "No such file" in err and "nope.jsonl" in err
    err = one_line_error(cli("run", str(tmp_path), "-o", str(tmp_path / "o.jsonl"), url=redis_url, check=False))
    assert "is a directory" in err


def test_an_output_that_is_a_directory_is_one_line(redis_url, cdr, tmp_path):
    cdr.submit([item("a", 10)], "j")
    err = one_line_error(cli("results", "j", "-o", str(tmp_path), url=redis_url, check=False))
    assert err == f"conductor: {tmp_path} is a directory, not a file"


def test_results_into_a_closed_pipe_exit_quietly(redis_url, cdr):
    quick(cdr)
    cdr.submit([item(f"i{k}", 10, payload="x" * 200) for k in range(1500)], "j")
    drain(cdr, Contract(model="m", max_batch_size=64, max_batch_tokens=8192, max_input_len=4096), timeout=60)
    # `conductor results j | head -1`: the reader takes one line and goes away
    import os
    env = dict(os.environ, CONDUCTOR_REDIS_URL=redis_url)
    p = subprocess.Popen([sys.executable, "-m", "conductor", "results", "j"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=env, cwd=str(ROOT))
    assert json.loads(p.stdout.readline())["job"] == "j"
    p.stdout.close()
    err = p.stderr.read().decode()
    p.stderr.close()
    assert p.wait(60) == 141 and err == ""


def test_the_cli_page_documents_every_exit_status():
    readme = (ROOT / "docs" / "cli.md").read_text()
    section = readme[readme.index("## Exit status"):]  # the page's last section
    codes = set(re.findall(r"^\| (\d+) \|", section, re.M))
    epilog = build_parser().epilog
    assert codes == set(re.findall(r"\b(\d+) [a-z]", epilog.split(":", 1)[1])) == {"0", "1", "2", "130", "141"}


def test_dead_letter_purge_asks_first(redis_url, cdr):
    from tests.test_progress import on_pty
    quick(cdr, max_deliveries=1)
    cdr.submit([item(f"i{k}", 10) for k in range(3)], "j")
    cdr.claim(Contract(model="m", max_batch_size=8, max_batch_tokens=8192, max_input_len=4096), "gone")
    cdr.reclaim_dead("m")
    assert cdr.r.xlen("cdr:{m}:dead") == 3
    # from a script: refused, nothing purged
    err = one_line_error(cli("dead-letter", "purge", url=redis_url, check=False))
    assert "deletes 3 items for good: nothing purged (pass --yes" in err
    # at a terminal: a question; a bare Enter is a no, a y a yes
    code, out = on_pty(["dead-letter", "purge"], redis_url, timeout=30, typed=b"\n")
    assert code == 2 and b"purge 3 dead-lettered items for good" in out and b"[y/N]" in out
    assert cdr.r.xlen("cdr:{m}:dead") == 3
    code, out = on_pty(["dead-letter", "purge"], redis_url, timeout=30, typed=b"y\n")
    assert code == 0 and b'{"purged": 3}' in out and cdr.r.xlen("cdr:{m}:dead") == 0
    assert json.loads(cli("dead-letter", "purge", url=redis_url).stdout) == {"purged": 0}  # nothing to ask about
