"""Every script of lua/ is registered in one place (conductor/redis_contract/scripts.py NAMES), and every script
call goes through the client's one error mapping (issue 14)."""

import re

import pytest

from conductor.errors import Paused
from conductor.jobs.deadletter import DeadLetter
from conductor.redis_contract.records import Contract
from conductor.redis_contract.scripts import NAMES, Scripts, source
from tests.conftest import ROOT, item
from tests.helpers import MK, quick

C = Contract(model="m", max_batch_size=4, max_batch_tokens=8192, max_input_len=4096)

def test_names_are_exactly_the_scripts_of_lua():
    run = sorted(p.stem for p in (ROOT / "lua").glob("*.lua") if not p.stem.startswith("lib"))
    assert sorted(NAMES) == run
    assert len(set(NAMES)) == len(NAMES)


def test_every_name_loads_and_is_an_attribute_of_scripts():
    for name in NAMES:
        assert source(name).startswith("#!lua"), name
        assert not re.search(r"^--@include", source(name), re.M), name  # includes are inlined
    assert set(Scripts.__annotations__) == set(NAMES)


def test_no_module_registers_a_script_of_its_own():
    offenders = [f"{p.relative_to(ROOT)}" for folder in ("conductor", "workers")
                 for p in (ROOT / folder).rglob("*.py")
                 if "register_script(" in p.read_text() and p.name != "scripts.py"]
    assert not offenders, offenders


def test_fail_reclaim_and_dead_retry_raise_paused_on_a_paused_model(cdr):
    quick(cdr, max_deliveries=1)
    cdr.submit([item(i, 10) for i in range(12)], "j")
    inflight, _ = cdr.claim(C, "w")
    cdr.claim(C, "gone")
    cdr.reclaim_consumer("m", "gone", force=True)  # max_deliveries 1: dead-lettered
    assert cdr.r.xlen(MK.dead)
    cdr.pause("m")
    with pytest.raises(Paused, match="^PAUSED"):
        cdr.fail(inflight, "w", "boom")
    with pytest.raises(Paused, match="^PAUSED"):
        cdr.reclaim_consumer("m", "w", force=True)
    with pytest.raises(Paused, match="^PAUSED"):
        DeadLetter(cdr).retry(model="m")
    cdr.resume("m")
    assert cdr.fail(inflight, "w", "boom") == (0, len(inflight.items))  # max_deliveries 1: dead-lettered
