"""The sim engine's KV-capacity model: preemption loses generated tokens and recomputes the
prompt; 'newest' protects old sequences so all finish exactly once; 'largest' thrashes."""

from conductor.redis_contract.records import Batch, BatchItem
from conductor.workers.engines.sim import SimEngine, SimParams, output_len


def fill(eng: SimEngine, n: int) -> list[BatchItem]:
    items = [BatchItem(id=f"s{i}", job="j", input_tokens=100, max_tokens=64, prompt="x") for i in range(n)]
    for k in range(0, n, 16):
        b = Batch(model="m", batch_id=f"{k}-0", shape="S", epoch=1, lane=0, padded_len=104, max_tokens=64,
                  claimed_at=0, items=items[k:k + 16], prefix=[])
        eng.admit(b, b.items)
    return items


def test_without_capacity_nothing_is_preempted():
    eng = SimEngine("m")
    items = fill(eng, 64)
    done = []
    while eng.active():
        done += eng.step()
    assert sorted(f.item.id for f in done) == sorted(i.id for i in items)
    assert eng.counters.preemptions == 0 and eng.counters.steps == max(output_len(i.id, 64) for i in items)


def test_newest_first_preemption_finishes_everything_exactly_once():
    eng = SimEngine("m", params=SimParams(kv_capacity_tokens=20 * 168, preempt="newest"))
    items = fill(eng, 64)
    done = []
    for _ in range(10_000):
        if not eng.active():
            break
        before = eng.active()
        fin = eng.step()
        assert eng.active() == before - len(fin)
        assert sum(q.prompt + q.done for q in eng._resident) <= 20 * 168
        done += fin
    assert sorted(f.item.id for f in done) == sorted(i.id for i in items)
    c = eng.counters
    assert c.preemptions > 0 and c.recompute_tokens >= 104 * c.preemptions // 2
    assert c.output_tokens == c.useful_output_tokens + c.lost_tokens  # every decoded token is used or lost


def test_largest_first_preemption_thrashes():
    eng = SimEngine("m", params=SimParams(kv_capacity_tokens=20 * 168, preempt="largest"))
    fill(eng, 400)  # twenty times what fits
    for _ in range(3000):
        eng.step()
    c = eng.counters
    assert eng.active() > 0 and c.lost_tokens > c.useful_output_tokens  # busy, mostly on tokens that go nowhere
