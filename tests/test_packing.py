"""conductor/redis_contract/packing.py is the Python copy of the packing rule that lua/lib.lua and
lua/lib_lanes.lua apply in Redis (verify/ and bench/ plan with it). Each function is run here
against its Lua twin through EVAL on the test Redis, over many cases, and must agree."""

from __future__ import annotations

import random

import pytest

from conductor.client import connect
from conductor.redis_contract.packing import fits, lane_ready, lane_weight, pad8
from conductor.redis_contract.scripts import _read, expand

CASES = 400


def _lua(body: str) -> str:
    """``body`` run after lib_lanes.lua (which includes lib.lua), inlined as a script would be."""
    return expand("packing_probe.lua", lambda f: "--@include lib_lanes.lua\n" + body if f == "packing_probe.lua"
                  else _read(f))


@pytest.fixture()
def r(redis_url):
    client = connect(redis_url)
    yield client
    client.close()


def test_pad8_lane_weight_and_readiness_agree_with_lib_lua(r):
    probe = r.register_script(_lua("""
local out = {}
for i = 1, #ARGV, 6 do
  local items, tokens, rep = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local cfg = {mode = ARGV[i + 3], budget_tokens = tonumber(ARGV[i + 4]), budget_items = tonumber(ARGV[i + 5])}
  out[#out + 1] = {pad8(rep), lane_weight(cfg, items, tokens, rep), lane_is_ready(cfg, items, tokens, rep) and 1 or 0}
end
return out
"""))
    rng = random.Random(28)
    cases = []
    for _ in range(CASES):
        items = rng.choice([0, 1, 2, 7, 8, 63, 64, 65, rng.randrange(1, 5000)])
        rep = rng.choice([1, 7, 8, 9, 15, 16, 17, rng.randrange(1, 70_000)])
        tokens = rng.randrange(items, items * rep + 1) if items else 0
        disk = rng.random() < 0.5
        budget_tokens = rng.choice([8, 512, 4096, 65_536, rng.randrange(1, 1_000_000)])
        budget_items = rng.choice([1, 8, 64, 256, rng.randrange(1, 5000)])
        cases.append((items, tokens, rep, disk, budget_tokens, budget_items))
    args = [x for items, tokens, rep, disk, bt, bi in cases
            for x in (items, tokens, rep, "disk" if disk else "memory", bt, bi)]
    got = probe(keys=[], args=args)
    for (items, tokens, rep, disk, bt, bi), (lpad, lweight, lready) in zip(cases, got, strict=True):
        assert lpad == pad8(rep), rep
        assert lweight == lane_weight(items, tokens, rep, disk=disk), (items, tokens, rep, disk)
        assert bool(lready) == lane_ready(items, tokens, rep, disk=disk, budget_tokens=bt, budget_items=bi), \
            (items, tokens, rep, disk, bt, bi)


def test_an_item_joins_a_batch_as_lib_lanes_plans_it(r):
    """``fits`` against plan_lane (lua/lib_lanes.lua), memory mode: a lane of ``n`` items whose
    longest is ``rep`` gives a batch as many items as ``fits`` admits one after another (every item
    padded to the lane's rep, the first always taken)."""
    probe = r.register_script(_lua("""
local base = KEYS[1]
local out = {}
for i = 1, #ARGV, 4 do
  local n, rep, size, budget = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local mk, tk = base .. ':lanemeta:probe:0', base .. ':lanetok:probe:0'
  redis.call('DEL', mk, tk)
  redis.call('HSET', mk, 'rep', rep, 'items', n, 'tokens', n * rep, 'last_ms', 0)
  for _ = 1, n do redis.call('RPUSH', tk, rep) end
  local c = {base = base, disk = false, max_items = size, max_tokens = budget}
  local acc = {k = 0, maxlen = 0, sum = 0, full = false}
  local part = plan_lane(c, 'probe', '0', acc)
  out[#out + 1] = part and part.k or 0
  redis.call('DEL', mk, tk)
end
return out
"""))
    rng = random.Random(2028)
    cases = []
    for _ in range(CASES // 2):
        n = rng.choice([1, 2, 5, rng.randrange(1, 200)])
        rep = rng.choice([1, 8, 9, 100, 512, rng.randrange(1, 20_000)])
        size = rng.choice([1, 4, 64, rng.randrange(1, 300)])
        budget = rng.choice([1, 64, 512, 8192, rng.randrange(1, 200_000)])
        cases.append((n, rep, size, budget))
    got = probe(keys=["cdr:{packing-probe}"], args=[x for case in cases for x in case])
    for (n, rep, size, budget), k in zip(cases, got, strict=True):
        want = 0
        while want < n and fits(want, rep if want else 0, rep, size, budget):
            want += 1
        assert k == want, (n, rep, size, budget)
