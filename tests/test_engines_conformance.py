"""One conformance suite every engine passes: sim and torch here and in CI; trtllm wherever
``tensorrt_llm`` imports (then CONDUCTOR_TRTLLM_MODEL must name a local model folder, or its
tests fail: a GPU box that has the package is expected to test it). Where the package is
absent the trtllm parameter is not collected at all, so it cannot pass silently.

Then the whole loop for each engine: submit, claim, engine, complete, results."""

import importlib.util
import json
import os

import pytest

from conductor.redis_contract.records import Batch, BatchItem
from conductor.workers.engines import make_engine
from conductor.workers.engines.base import Engine
from conductor.workers.engines.sim import SimEngine
from tests.conftest import cli, item
from tests.helpers import quick
from tests.worker_kit import run_until_done, worker

ENGINES = ["sim", "torch"] + (["trtllm"] if importlib.util.find_spec("tensorrt_llm") else [])
MAX_INPUT = 64


def build(kind: str) -> Engine:
    kw = dict(model="conf", max_batch_size=4, max_batch_tokens=1024, max_input_len=MAX_INPUT)
    if kind == "torch":
        kw.update(model_path="tiny", device="cpu")
    if kind == "trtllm":
        path = os.environ.get("CONDUCTOR_TRTLLM_MODEL")
        assert path, "tensorrt_llm is installed: set CONDUCTOR_TRTLLM_MODEL to a local model folder to test it"
        kw.update(model_path=path)
    return make_engine(kind, **kw)


@pytest.fixture(params=ENGINES)
def engine(request):
    eng = build(request.param)
    yield eng
    eng.close()


def mk_batch(bid: str, prompts: list[tuple[str, int]], max_tokens: int = 8, shape: str = "s1") -> Batch:
    items = [BatchItem(id=f"{bid}:{k}", job="j", input_tokens=tok, max_tokens=max_tokens, prompt=p)
             for k, (p, tok) in enumerate(prompts)]
    return Batch(model="conf", batch_id=bid, shape=shape, epoch=1, lane=0, padded_len=64, max_tokens=max_tokens,
                 claimed_at=0, items=items, prefix=["a shared system prompt"])


def drive(eng: Engine, limit: int = 500) -> list:
    out = []
    for _ in range(limit):
        if not eng.active():
            return out
        before = eng.active()
        fin = eng.step()
        assert eng.active() == before - len(fin)
        out += fin
    raise AssertionError("sequences never finished")


def test_identity_and_contract_come_from_the_engine(engine):
    c = engine.contract
    assert engine.model == c.model == "conf"
    assert (c.max_batch_size, c.max_batch_tokens) == (4, 1024)
    assert 1 <= c.max_input_len <= MAX_INPUT
    assert isinstance(engine, Engine) and engine.kind in ("sim", "torch", "trtllm")


def test_every_admitted_item_finishes_exactly_once_within_its_max_tokens(engine):
    b = mk_batch("1-0", [("alpha", 3), ("a longer prompt here", 6), ("z", 2)], max_tokens=8)
    fin = engine.admit(b, b.items)
    assert engine.active() + len(fin) == 3
    fin += drive(engine)
    assert sorted(f.item.id for f in fin) == sorted(i.id for i in b.items)
    for f in fin:
        assert f.error is None and f.batch is b
        assert 1 <= f.output_tokens <= 8 or (f.output_tokens == 0 and f.output == "")
        assert isinstance(f.output, str)
    assert engine.step() == [] and engine.active() == 0


def test_an_item_longer_than_max_input_len_is_answered_at_once_with_an_error(engine):
    limit = engine.contract.max_input_len
    b = mk_batch("2-0", [("fits", 2), ("y" * 10, limit + 1)])
    fin = engine.admit(b, b.items)
    bad = [f for f in fin if f.item.id == "2-0:1"]
    assert len(bad) == 1 and bad[0].output == "" and bad[0].output_tokens == 0
    assert bad[0].error.code == "input_too_long" and str(limit) in bad[0].error.message
    rest = [f.item.id for f in fin + drive(engine) if f.item.id != "2-0:1"]
    assert rest == ["2-0:0"]


def test_a_batch_joins_while_another_decodes_and_outputs_do_not_depend_on_neighbours(engine):
    a = mk_batch("3-0", [("same prompt", 3), ("neighbour one", 4)], max_tokens=6)
    b = mk_batch("4-0", [("same prompt", 3), ("a different, longer neighbour", 8), ("x", 1)], max_tokens=6)
    fin = engine.admit(a, a.items)
    fin += engine.step()
    fin += engine.admit(b, b.items)
    fin += drive(engine)
    got = {f.item.id: f for f in fin}
    assert len(got) == 5
    # sim draws lengths from the id; real engines decode greedily: same prompt, same output
    if engine.kind != "sim":
        assert (got["3-0:0"].output, got["3-0:0"].output_tokens) == (got["4-0:0"].output, got["4-0:0"].output_tokens)


def test_prewarm_and_close(engine):
    engine.prewarm("s1", [64], 1)
    b = mk_batch("5-0", [("p", 1), ("q", 1)], max_tokens=50)  # padded to 64, shape s1, epoch 1
    engine.admit(b, b.items)
    if isinstance(engine, SimEngine):
        # what prewarm prepared is what the batch needed: its graph was built ahead, not on admit
        assert (engine.counters.graphs_prewarmed, engine.counters.graph_rebuilds) == (1, 0)
        other = mk_batch("6-0", [("r", 1)], shape="s2")
        engine.admit(other, other.items)
        assert engine.counters.graph_rebuilds == 1  # a shape nobody prewarmed builds on admit
    engine.close()
    assert engine.active() == 0 and engine.step() == []


@pytest.mark.parametrize("kind", ENGINES)
def test_the_whole_loop_through_a_worker(cdr, kind):
    quick(cdr, "conf")
    cdr.submit([item(f"w{k}", 4 + k % 5, model="conf", max_tokens=6) for k in range(18)]
               + [item("huge", MAX_INPUT + 10, model="conf", max_tokens=6)], "j")
    w = worker(cdr, build(kind), high_water=6, low_water=2)
    run_until_done(w, turns=2000)
    rows = {r["id"]: r for r in map(json.loads, cdr.results("j"))}
    assert len(rows) == 19
    assert rows["huge"]["error"]["code"] == "input_too_long" and rows["huge"]["output"] == ""
    for k in range(18):
        r = rows[f"w{k}"]
        assert r["error"] is None and 0 <= r["output_tokens"] <= 6 and r["worker"] == "w1"
    assert cdr.status("j")["pending"] == 0


def test_torch_tiny_through_the_command_line(redis_url, tmp_path):
    """submit, a real ``conductor worker --engine torch --model-path tiny`` process, results."""
    src = tmp_path / "in.jsonl"
    with open(src, "w") as f:
        for k in range(12):
            prompt = "the same question" if k % 3 == 0 else f"question number {k}"
            f.write(json.dumps({"id": f"t{k}", "model": "tiny-llm", "prefix": ["You are terse."], "prompt": prompt,
                                "max_tokens": 10}) + "\n")
    cli("config", "tiny-llm", "--create", "quiet_ms=50", "release_batches=0", "activate_batches=0", url=redis_url)
    cli("submit", "--create", str(src), "--job", "tj", url=redis_url)
    cli("worker", "--engine", "torch", "--model", "tiny-llm", "--model-path", "tiny", "--max-batch-size", "4",
        "--high-water", "8", "--low-water", "2", "--idle-exit", "2", "--name", "gpu0", url=redis_url, timeout=180)
    out = cli("results", "tj", url=redis_url).stdout.decode().splitlines()
    rows = {r["id"]: r for r in map(json.loads, out)}
    assert sorted(rows) == sorted(f"t{k}" for k in range(12))
    assert all(r["error"] is None and 1 <= r["output_tokens"] <= 10 and r["worker"] == "gpu0" for r in rows.values())
    same = {(rows[f"t{k}"]["output"], rows[f"t{k}"]["output_tokens"]) for k in (0, 3, 6, 9)}
    assert len(same) == 1  # greedy decoding: one prompt, one output, whatever batch it rode in
