"""Issue 29, the parts below the command line: request options as the engines honour them, the
progress line's first ETA, one prewarm event per instance."""

from __future__ import annotations

import json
import logging

import pytest

from conductor.cli.progress import Rate
from conductor.errors import BadInput
from conductor.formats.lines import parse_line
from conductor.formats.openai_options import request_options
from conductor.redis_contract.records import Batch, BatchItem
from conductor.workers.engines.sim import SimEngine


def line(**body: object) -> str:
    return json.dumps({"custom_id": "c1", "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                   **body}})


def payload(raw: str) -> object:
    return json.loads(parse_line(raw).body)[1]


def test_options_are_stored_with_the_item_and_neutral_or_identifying_fields_pass():
    assert request_options(payload(line(temperature=0.7, top_p=0.9, stop="END", seed=-3))) == \
        {"temperature": 0.7, "top_p": 0.9, "stop": ["END"], "seed": -3}
    # what OpenAI's clients send by default asks for nothing, and a null is an absent field
    assert payload(line(n=1, stream=False, frequency_penalty=0, logprobs=False, logit_bias={}, user="u-1",
                        response_format={"type": "text"}, temperature=None)) == {"custom_id": "c1"}
    for body, field in (({"n": True}, "body.n"), ({"top_p": 0}, "body.top_p"), ({"stop": ["a"] * 5}, "body.stop"),
                        ({"seed": 1.5}, "body.seed"), ({"tools": [{"type": "function"}]}, "body.tools")):
        with pytest.raises(BadInput) as e:
            parse_line(line(**body), 3)
        assert e.value.field == field and e.value.line == 3, body
    # a native line's payload is the producer's own: it carries no options
    assert request_options({"options": {"temperature": 1}}) == {}


def _batch(items: list[BatchItem], shape: str = "s", bid: str = "1-0") -> Batch:
    return Batch(model="m", batch_id=bid, shape=shape, epoch=1, lane=0, padded_len=32, max_tokens=32, claimed_at=0,
                 items=items, prefix=["system"])


def _item(iid: str, prompt: str = "p", max_tokens: int = 32, **opts: object) -> BatchItem:
    return BatchItem(id=iid, job="j", input_tokens=8, max_tokens=max_tokens, prompt=prompt,
                     payload={"custom_id": iid, "options": opts} if opts else {"custom_id": iid})


def _run(eng: object, *batches: Batch) -> dict[str, tuple[str, int]]:
    got = {}
    for b in batches:
        for f in eng.admit(b, b.items):  # type: ignore[attr-defined]
            got[f.item.id] = (f.output, f.output_tokens)
    while eng.active():  # type: ignore[attr-defined]
        for f in eng.step():  # type: ignore[attr-defined]
            got[f.item.id] = (f.output, f.output_tokens)
    return got


def test_sim_draws_its_output_from_the_seed_and_cuts_it_at_a_stop():
    eng = SimEngine("m")
    got = _run(eng, _batch([_item("a", seed=1), _item("b", seed=1), _item("c", seed=2), _item("d"),
                            _item("e", stop=[" tokens"])]))
    again = _run(SimEngine("m"), _batch([_item("a", seed=1)]))
    assert again["a"] == got["a"]  # one seed, one answer
    lengths = {_run(SimEngine("m"), _batch([_item("a", seed=s)]))["a"][1] for s in range(8)}
    assert len(lengths) > 1  # another seed, another draw
    out, n = got["e"]
    assert " tokens" not in out and out.startswith("<sim output: ") and 1 <= n < 32


def test_torch_samples_with_the_requests_seed_in_any_batch_and_stops_at_its_stop():
    torch_engine = pytest.importorskip("conductor.workers.engines.torch_engine")
    eng = torch_engine.TorchEngine("tiny", model_path="tiny", max_batch_size=8, max_input_len=512, device="cpu")
    sampled = dict(temperature=1.0, top_p=0.95, seed=11)
    alone = _run(eng, _batch([_item("s", "tell me", 24, **sampled)], bid="1-0"))["s"]
    eng.close()
    beside = _run(eng, _batch([_item("g1", "other words"), _item("s", "tell me", 24, **sampled),
                               _item("g2", "x")], bid="2-0"))
    assert beside["s"] == alone  # its own generator: the same draw whatever rides with it
    eng.close()
    greedy = _run(eng, _batch([_item("s", "tell me", 24)], bid="3-0"))["s"]
    assert greedy == _run(eng, _batch([_item("s", "tell me", 24, temperature=0.0)], bid="4-0"))["s"]
    eng.close()
    other = {_run(eng, _batch([_item("s", "tell me", 24, temperature=1.0, seed=s)], bid=f"5-{s}"))["s"]
             for s in range(4)}
    assert len(other) > 1 and greedy != alone
    eng.close()
    text, n = greedy
    stop = text[3:5]
    cut, m = _run(eng, _batch([_item("s", "tell me", 24, stop=[stop])], bid="6-0"))["s"]
    assert stop not in cut and text.startswith(cut) and len(cut) <= text.index(stop) and m < n


def test_the_first_progress_after_a_slow_start_promises_no_day_long_eta():
    r = Rate()
    r.add(0, 100.0)  # the line starts; workers take 20 s to load
    r.add(1, 120.0)  # the first result
    assert r.eta_s(1, 5000) is None  # before: 5,000 items at one per 20 s, "ETA 27:45:xx"
    r.add(400, 121.5)
    eta = r.eta_s(400, 5000)
    assert eta is not None and 10 < eta < 30  # the pace since things moved: 266 results/s


def test_each_prewarm_is_logged_once(caplog):
    from conductor.workers.prewarm import Prewarm

    class C:
        def prewarm_info(self, model: str, inst: str) -> tuple[str, int, list[int]]:
            return inst.split(":")[0], int(inst.split(":")[1]), [32]

    class E:
        def prewarm(self, shape: str, lanes: list[int], epoch: int) -> None:
            pass

    pw = Prewarm(C(), E(), "m", "w")  # type: ignore[arg-type]

    def claim(shape: str, warming: str = "") -> None:
        pw.after_claim(Batch(model="m", batch_id="1-0", shape=shape, epoch=1, lane=0, padded_len=32, max_tokens=4,
                             claimed_at=0, items=[], warming=warming))
    with caplog.at_level(logging.INFO, logger="conductor.worker"):
        claim("a", warming="b:1")  # serving a, warming b
        claim("a")
        claim("b")  # the switch to b, warmed already
    shapes = [json.loads(r.getMessage())["shape"] for r in caplog.records if '"prewarm"' in r.getMessage()]
    assert shapes == ["a", "b"]
