"""The torch engine on the CPU with the random-initialised tiny Llama: its batched, cached,
padded, prefix-reusing generation gives exactly what a plain full-recompute greedy loop gives
for each prompt alone; the prefix KV is computed once per shape; finished rows leave."""

import pytest
import torch  # the torch extra is part of the README's test install: no skip here

from conductor.redis_contract.records import Batch, BatchItem
from conductor.workers.engines.torch_engine import TorchEngine


def batch(shape: str, prefix: list[str], prompts: list[str], max_tokens: int = 12, bid: str = "1-0") -> Batch:
    items = [BatchItem(id=f"{shape}-{k}", job="j", input_tokens=len(p) + 1, max_tokens=max_tokens, prompt=p)
             for k, p in enumerate(prompts)]
    return Batch(model="tiny", batch_id=bid, shape=shape, epoch=1, lane=0, padded_len=64, max_tokens=max_tokens,
                 claimed_at=0, items=items, prefix=prefix)


def reference(eng: TorchEngine, prefix: list[str], prompt: str, max_tokens: int) -> tuple[str, int]:
    """Greedy decoding the slow, obvious way: the whole sequence through the model every token."""
    text = ("\n".join(prefix) + "\n" if prefix else "") + prompt
    ids = eng.tok.encode(text, bos=True)
    out = []
    with torch.inference_mode():
        for _ in range(max_tokens):
            nxt = int(eng.lm(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            if nxt == eng.eos:
                break
            out.append(nxt)
    return eng.tok.decode(out), len(out)


def run(eng: TorchEngine, *batches: Batch) -> dict[str, tuple[str, int]]:
    got = {}
    for b in batches:
        for f in eng.admit(b, b.items):
            got[f.item.id] = (f.output, f.output_tokens)
    for _ in range(1000):
        if not eng.active():
            break
        for f in eng.step():
            got[f.item.id] = (f.output, f.output_tokens)
    return got


@pytest.fixture(scope="module")
def eng():
    return TorchEngine("tiny", model_path="tiny", max_batch_size=8, max_input_len=512, device="cpu")


def test_batched_cached_generation_equals_a_plain_greedy_loop(eng):
    prompts = ["hello", "a much longer prompt than the others, padded against", "x", "mid length prompt"]
    for prefix in (["system: be brief", "shot one"], []):
        b = batch("S" + str(len(prefix)), prefix, prompts)
        got = run(eng, b)
        for it in b.items:
            assert got[it.id] == reference(eng, prefix, it.prompt, 12), (prefix, it.prompt)


def test_prefix_kv_is_computed_once_per_shape_and_reused(eng):
    eng.close()
    before = eng.counters.prefix_computes
    hits = eng.counters.prefix_hit_tokens
    run(eng, batch("A", ["shared system prompt"], ["one", "two"], bid="2-0"))
    run(eng, batch("A", ["shared system prompt"], ["three", "four", "five"], bid="3-0"))
    assert eng.counters.prefix_computes == before + 1
    plen = len(eng.tok.encode("shared system prompt\n", bos=True)) - 1
    # in each item's own input_tokens: the share of its prompt the cached prefix covers (counted in
    # the tokenizer's tokens, a run once reported prefix hits of 291.7 % of its input tokens)
    want = sum((len(p) + 1) * plen // (plen + 1 + len(eng.tok.encode(p, bos=False)))
               for p in ("one", "two", "three", "four", "five"))
    assert eng.counters.prefix_hit_tokens - hits == want
    run(eng, batch("B", ["another prefix"], ["six"], bid="4-0"))
    assert eng.counters.prefix_computes == before + 2


def test_a_joining_batch_is_merged_into_one_forward_and_outputs_stay_exact(eng):
    eng.close()
    merges = eng.counters.merges
    a = batch("C", ["p"], ["short", "rows"], max_tokens=3, bid="5-0")
    b = batch("C", ["p"], ["longer", "rows", "and a much longer one"], max_tokens=9, bid="6-0")
    fin = eng.admit(a, a.items) + eng.step()
    assert len(fin) + eng.active() == 2
    fin += eng.admit(b, b.items)  # a new batch joins while the first is still decoding
    assert len(eng.cohorts) == 1 and eng.counters.merges == merges + (1 if len(fin) < 2 else 0)
    while eng.active():
        fin += eng.step()
        assert eng.active() == sum(len(c.items) for c in eng.cohorts)
    assert sorted((f.batch.batch_id, f.item.id) for f in fin) == [
        ("5-0", "C-0"), ("5-0", "C-1"), ("6-0", "C-0"), ("6-0", "C-1"), ("6-0", "C-2")]
    for f in fin:  # decoded in a merged, left-padded, trimmed cache: still exactly the plain greedy answer
        assert (f.output, f.output_tokens) == reference(eng, ["p"], f.item.prompt, f.item.max_tokens)
    assert not eng.cohorts


def test_too_long_items_come_back_as_errors(eng):
    eng.close()
    b = batch("D", ["p"], ["ok", "y" * 600])
    fin = eng.admit(b, b.items)
    assert [f.item.id for f in fin if f.error] == ["D-1"]
    assert fin[0].output == "" and fin[0].error.code == "input_too_long"
    assert eng.active() == 1


def test_model_path_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="--model-path"):
        TorchEngine("m", model_path=None)
    with pytest.raises(ValueError, match="is not a folder"):
        TorchEngine("m", model_path=str(tmp_path / "nope"))


def test_staggered_batches_of_different_shapes_decode_exactly_in_one_cohort(eng):
    eng.close()
    plan = [batch("E", ["a long system prompt for shape E", "with a shot"], ["q1", "question two"], 7, "7-0"),
            batch("F", [], ["no prefix at all", "x"], 5, "8-0"),
            batch("G", ["g"], ["third shape, third batch", "y", "zz"], 11, "9-0")]
    prefixes = {"E": plan[0].prefix, "F": [], "G": ["g"]}
    fin = []
    for b in plan:
        fin += eng.admit(b, b.items)
        fin += eng.step()
        assert len(eng.cohorts) <= 1
    while eng.active():
        fin += eng.step()
    assert len(fin) == 7
    for f in fin:
        assert (f.output, f.output_tokens) == reference(eng, prefixes[f.batch.shape], f.item.prompt, f.item.max_tokens)


def test_rows_beyond_max_num_seqs_wait_their_turn_and_room_paces_the_claims(eng):
    """A real engine runs max_num_seqs rows at once (issue 37): the rest wait in the engine, first in
    first out, and room asks for another batch only while under half the last batch waits."""
    eng.close()
    eng.max_num_seqs = 3
    try:
        a = batch("H", ["p"], ["one", "two", "three", "four", "five"], 6, "10-0")
        fin = eng.admit(a, a.items)
        assert eng.active() + len(fin) == 5 and sum(len(c.items) for c in eng.cohorts) <= 3
        assert eng.room() == 8  # 2 waiting, under half of 5
        b = batch("H", ["p"], ["six", "seven", "eight", "nine"], 4, "11-0")
        fin += eng.admit(b, b.items)
        assert eng.room() == 0  # 6 waiting: enough beyond what runs
        while eng.active():
            fin += eng.step()
            assert sum(len(c.items) for c in eng.cohorts) <= 3
        assert sorted(f.item.id for f in fin) == sorted(it.id for it in a.items + b.items)
        for f in fin:
            assert (f.output, f.output_tokens) == reference(eng, ["p"], f.item.prompt, f.item.max_tokens)
        assert eng.room() == 8
    finally:
        eng.max_num_seqs = 8
