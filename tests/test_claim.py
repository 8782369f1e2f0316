import pytest

from conductor.client import Conductor, connect
from conductor.redis_contract import keys as K
from conductor.redis_contract.records import Contract
from tests.conftest import item
from tests.helpers import contract, drain, quick, results_for


def test_memory_mode_pads_to_longest_rounded_to_8_and_closes_on_tokens(cdr):
    quick(cdr, budget_tokens=1024, budget_items=64)
    # all in one lane (within the 16-token floor): 97..103 tokens, padded length 104
    cdr.submit([item(i, 97 + i % 7) for i in range(30)], "j")
    b, _ = cdr.claim(contract(tokens=1024), "w")
    assert b.padded_len == 104
    assert len(b.items) == 1024 // 104  # 9 items: the 10th would pass the padded budget
    assert b.padded_tokens <= 1024


def test_batch_closes_on_item_count(cdr):
    quick(cdr)
    cdr.submit([item(i, 10) for i in range(50)], "j")
    b, _ = cdr.claim(contract(size=16), "w")
    assert len(b.items) == 16


def test_disk_mode_counts_actual_tokens(cdr):
    quick(cdr, mode="disk")
    cdr.submit([item(i, 97 + i % 7) for i in range(30)], "j")
    b, _ = cdr.claim(contract(tokens=1024), "w")
    assert sum(i.input_tokens for i in b.items) <= 1024
    assert sum(i.input_tokens for i in b.items) + b.items[-1].input_tokens > 1024 - 103
    assert len(b.items) == 10  # 97+98+...: ten fit in actual tokens, nine in padded


def test_leftovers_stay_in_order_for_the_next_consumer(cdr):
    quick(cdr)
    cdr.submit([item(f"{i:03d}", 100) for i in range(25)], "j")
    seen = []
    for w in ("a", "b", "c"):
        b, _ = cdr.claim(contract(size=10), w)
        seen += [i.id for i in b.items]
    assert seen == [f"{i:03d}" for i in range(25)]


def test_oversized_item_travels_alone_and_never_strands(cdr):
    quick(cdr)
    cdr.submit([item("big", 50000), item("small", 10)], "j")
    batches = drain(cdr, contract(tokens=8192))
    assert sorted(len(b.items) for b in batches) == [1, 1]
    assert cdr.status("j")["pending"] == 0


def test_batches_are_pure_and_stay_on_one_shape_until_empty(cdr):
    quick(cdr, budget_tokens=512, budget_items=8)
    items = []
    for s, count in (("A", 40), ("B", 80), ("C", 20)):
        items += [item(f"{s}{i}", 20 + (i % 3) * 60, prefix=(s,)) for i in range(count)]
    cdr.submit(items, "j")
    cdr.submit([item(f"x{i}", 20, model="other") for i in range(10)], "j")
    batches = drain(cdr, contract(size=8, tokens=512))
    order = []
    for b in batches:
        assert b.model == "m"
        assert len({(b.shape, b.epoch, b.lane)}) == 1
        assert {i.id[0] for i in b.items} == {b.prefix[0]}
        if not order or order[-1] != b.prefix[0]:
            order.append(b.prefix[0])
    assert order == ["B", "A", "C"]  # most waiting tokens first, each shape once
    assert cdr.status("j")["models"]["m"]["pending"] == 0
    assert cdr.status("j")["models"]["other"]["pending"] == 10


def test_ready_lane_search_is_round_robin(cdr):
    quick(cdr, budget_tokens=64, budget_items=4)
    cdr.set_config("m", {"lane_floor": 0, "lane_thr_min": 0.01, "lane_thr_max": 0.01})
    items = []
    for lane_len in (8, 200, 800):
        items += [item(f"{lane_len}-{i}", lane_len) for i in range(8)]
    cdr.submit(items, "j")
    lanes = []
    for _ in range(6):
        b, _ = cdr.claim(contract(size=4, tokens=100000), "w")
        lanes.append(b.lane)
    assert lanes[:3] == sorted(set(lanes[:3]), key=lanes[:3].index) and len(set(lanes[:3])) == 3
    assert lanes[3:] == lanes[:3]


def test_release_gate_holds_until_threshold_then_stays_open(cdr):
    cdr.set_config("m", {"release_batches": 2, "budget_tokens": 1000, "quiet_ms": 60000, "activate_batches": 0})
    assert cdr.claim(contract(tokens=1000), "w") == (None, "idle")  # nothing waits: idle, not the gate
    cdr.submit([item(i, 100) for i in range(10)], "j")  # 1000 < 2000 tokens
    b, why = cdr.claim(contract(tokens=1000), "w")
    assert (b, why) == (None, "gate")
    cdr.submit([item(i, 100) for i in range(10, 20)], "j")
    b, _ = cdr.claim(contract(tokens=1000), "w")
    assert b is not None
    cdr.complete(b, results_for(b))
    drain(cdr, contract(tokens=1000))
    cdr.submit([item(i, 100) for i in range(20, 22)], "j")  # below threshold, but the gate stays open
    assert cdr.r.hget(K.ModelKeys("m").state, "gate") == b"1"


def test_disk_mode_gate_is_always_open(cdr):
    cdr.set_config("m", {"mode": "disk", "release_batches": 100, "quiet_ms": 60000, "activate_batches": 0,
                         "budget_tokens": 200})
    cdr.submit([item(i, 100) for i in range(4)], "j")
    b, _ = cdr.claim(contract(tokens=200), "w")
    assert b is not None and len(b.items) == 2


def test_cleanup_mode_drains_the_tail_after_intake_goes_quiet(cdr):
    import time
    cdr.set_config("m", {"quiet_ms": 200, "release_batches": 8, "activate_batches": 4})
    cdr.submit([item(i, 30) for i in range(7)], "j")  # far below every threshold
    assert cdr.claim(contract(), "w")[0] is None
    time.sleep(0.25)
    batches = drain(cdr, contract())
    assert sum(len(b.items) for b in batches) == 7
    assert all(b.cleanup for b in batches)
    st = cdr.r.hgetall(K.ModelKeys("m").state)
    assert int(st[b"cleanup_entries"]) == 1 and int(st[b"cleanup_items"]) == 7
    assert st[b"cleanup"] == b"0"  # left cleanup once empty


def test_draining_instance_takes_no_new_items(cdr):
    quick(cdr, budget_tokens=400, budget_items=4)
    cdr.set_config("m", {"quiet_ms": 60000, "drain_batches": 100})
    cdr.submit([item(i, 96) for i in range(6)], "j")
    b1, _ = cdr.claim(contract(size=4, tokens=400), "w")  # full lane first
    b2, _ = cdr.claim(contract(size=4, tokens=400), "w")  # then the instance drains
    assert b1.epoch == 1 and b2.epoch == 1 and (len(b1.items), len(b2.items)) == (4, 2)
    cdr.submit([item("late", 100)], "j")
    from conductor.formats.signature import shape_signature
    sig = shape_signature(["sys"])
    mk = K.ModelKeys("m")
    assert int(cdr.r.hget(mk.shape(sig), "epoch")) == 2  # the late arrival went to a new staged epoch
    assert cdr.r.hget(mk.inst(f"{sig}:2"), "state") == b"staged"
    assert int(cdr.r.hget(mk.inst(f"{sig}:2"), "items")) == 1


def test_claim_arguments_are_checked(cdr):
    mk = K.ModelKeys("m")
    cdr.ensure_model("m")
    keys = [mk.base, mk.cfg, mk.state, mk.batches, mk.reclaimed]
    for args in (["w", 0, 100, 10], ["w", 10, -1, 10], ["", 10, 10, 10], ["w", "x", 10, 10]):
        with pytest.raises(Exception, match="ERR_ARG"):
            cdr.scripts.claim(keys=keys, args=args)
    # the token names the list the batch's items go to: present, short, no key-breaking characters
    for bad in ([], [""], ["a b"], ["x" * 65], ["{m}"], ["a:b"]):
        with pytest.raises(Exception, match="ERR_ARG token"):
            cdr.scripts.claim(keys=keys, args=["w", 10, 100, *bad])
    # and never the token of a batch still pending: its items would be overwritten
    quick(cdr)
    cdr.submit([item(i, 10) for i in range(8)], "j")
    b, _ = cdr.claim(contract(size=4, tokens=800), "w")
    token = cdr.r.xrange(mk.batches, b.batch_id, b.batch_id)[0][1][b"k"].decode()
    before = (cdr.r.lrange(mk.batch_items(token), 0, -1), cdr.r.hgetall(mk.state), cdr.r.xlen(mk.batches))
    with pytest.raises(Exception, match="ERR_ARG token: .* in use"):
        cdr.scripts.claim(keys=keys, args=["w", 4, 800, token])
    assert (cdr.r.lrange(mk.batch_items(token), 0, -1), cdr.r.hgetall(mk.state), cdr.r.xlen(mk.batches)) == before


def test_a_batch_list_emptied_before_the_read_is_not_handed_out_and_nothing_is_lost(cdr):
    # A reclaim between claim.lua and the LRANGE behind it (same round trip, another client) would
    # empty the batch's list: reproduced here by a reclaim run just before the read, through the
    # real connection, so the reply the client gets is the real one for that order of events.
    quick(cdr)
    cdr.submit([item(i, 10) for i in range(8)], "j")
    real = cdr._send_two

    def reclaim_in_between(first, second):
        reply, _ = real(first, ("PING",))
        cdr.reclaim_consumer("m", "w", force=True)
        return reply, cdr.r.lrange(second[1], 0, -1)

    cdr._send_two = reclaim_in_between
    b, why = cdr.claim(contract(size=4, tokens=800), "w")
    assert (b, why) == (None, "raced")
    cdr._send_two = real
    assert int(cdr.r.hget(K.ModelKeys("m").state, "reclaimed_items")) == 4
    got = [it.id for bb in drain(cdr, contract(size=4, tokens=800), "w2") for it in bb.items]
    assert sorted(got, key=int) == [str(i) for i in range(8)]


def test_a_claim_whose_reply_was_lost_is_recovered_by_its_token(redis_server, redis_url):
    # claim.lua ran and moved a batch into this consumer's pending list, then the connection
    # dropped before the reply arrived: the next claim hands that same batch out first, instead of
    # leaving it to the stale sweep minutes later. Every item is delivered once.
    import redis as redis_mod

    from tests.netfault import ReplyDroppingProxy
    proxy = ReplyDroppingProxy(redis_server.port)
    try:
        c = Conductor(connect(proxy.url))
        quick(c)
        c.submit([item(i, 10) for i in range(40)], "j")
        contract = Contract(model="m", max_batch_size=8, max_batch_tokens=8192, max_input_len=4096)
        first, _ = c.claim(contract, "w")  # the model is set up; the next call sends only the claim
        proxy.drop_reply_to(c.scripts.claim.sha.encode())
        with pytest.raises(redis_mod.ConnectionError):
            c.claim(contract, "w")
        assert proxy.dropped == 1
        mk = K.ModelKeys("m")
        assert c.r.xpending(mk.batches, "workers")["pending"] == 2  # the lost one is pending on w
        lost, why = c.claim(contract, "w")
        assert why == "recovered" and lost is not None and len(lost.items) == 8
        assert {b["message_id"].decode() for b in c.r.xpending_range(mk.batches, "workers", "-", "+", 10)} == {
            first.batch_id, lost.batch_id}
        seen = [it.id for it in first.items + lost.items]
        for b in (first, lost):
            c.complete(b, results_for(b))
        seen += [it.id for b in drain(c, contract) for it in b.items]
        assert sorted(seen, key=int) == [str(i) for i in range(40)]
        assert c.r.xpending(mk.batches, "workers")["pending"] == 0
        # a claim lost before the script ran leaves nothing to find: forgotten, the next claim is new
        c.submit([item(i, 10) for i in range(40, 48)], "j")
        c._lost_claims[("m", "w")] = ["0" * 16]
        b, why = c.claim(contract, "w")
        assert why == "batch" and not c._lost_claims[("m", "w")]
        c.r.close()
    finally:
        proxy.close()


def _lane_heads(c, inst):
    mk = K.ModelKeys("m")
    out = {}
    for lane, rep in c.r.zrange(mk.inst_fill(inst), 0, -1, withscores=True):
        out[int(rep)] = [int(t) for t in c.r.lrange(mk.lane_tok(inst, lane.decode()), 0, -1)]
    return out


def test_neighbour_fill_takes_the_shortest_lanes_first_and_leaves_the_rest_in_order(cdr):
    from conductor.formats.signature import shape_signature
    # Three lanes of 3 items (reps 96, 200, 400): none holds a batch of 8 alone; a claim fills one
    # from the shortest lanes up, padded to the longest lane it took from.
    quick(cdr, budget_tokens=100_000, budget_items=8, lane_depth=0, lane_floor=32)
    toks = [96, 90, 80, 200, 190, 180, 400, 390, 380]
    cdr.submit([item(f"i{n}", t) for n, t in enumerate(toks)], "j")
    inst = f"{shape_signature(['sys'])}:1"
    assert sorted(_lane_heads(cdr, inst)) == [96, 200, 400]
    b, why = cdr.claim(contract(size=8, tokens=100_000), "w")
    assert why == "batch" and len(b.items) == 8
    assert [it.input_tokens for it in b.items] == [96, 90, 80, 200, 190, 180, 400, 390]
    assert b.padded_len == 400 and {it.id for it in b.items} <= {f"i{n}" for n in range(9)}
    assert _lane_heads(cdr, inst) == {400: [380]}  # the leftover stays at its lane's head
    st = cdr.r.hgetall(K.ModelKeys("m").state)
    assert int(st[b"neighbour_fills"]) == 1 and int(cdr.r.hget(K.ModelKeys("m").intake, "items")) == 1


def test_neighbour_fill_stops_at_the_token_budget_padded_to_the_longest_lane(cdr):
    from conductor.formats.signature import shape_signature
    quick(cdr, budget_tokens=100_000, budget_items=64, lane_depth=0, lane_thr_min=0.01, lane_thr_max=0.01)
    cdr.submit([item(f"a{n}", 100) for n in range(3)] + [item(f"b{n}", 300) for n in range(3)], "j")
    b, _ = cdr.claim(contract(size=64, tokens=1000), "w")
    # 3 x 104 = 312 fits; adding the 300 lane pads every item to 304: 3 items fit (912), not 4
    assert [it.input_tokens for it in b.items] == [100, 100, 100]
    assert b.padded_len == 104
    b2, _ = cdr.claim(contract(size=64, tokens=1000), "w")
    assert [it.input_tokens for it in b2.items] == [300, 300, 300] and b2.padded_len == 304
    inst = f"{shape_signature(['sys'])}:1"
    assert _lane_heads(cdr, inst) == {}


def test_workers_take_shapes_of_their_own_and_share_a_deep_one(cdr):
    from conductor.formats.signature import shape_signature
    quick(cdr, budget_tokens=1000, budget_items=8, activate_batches=2)
    for w in ("w1", "w2", "w3"):  # three live workers: the fleet a fair share is counted over
        cdr.r.set(K.ModelKeys("m").heartbeat(w), 1)
        cdr.r.hset(K.ModelKeys("m").workers, w, "{}")
    cdr.submit([item(f"a{n}", 96, prefix=("A",)) for n in range(80)], "j")  # 10 batches
    cdr.submit([item(f"b{n}", 96, prefix=("B",)) for n in range(30)], "j")  # about 3 batches
    b1, _ = cdr.claim(contract(size=8, tokens=1000), "w1")
    b2, _ = cdr.claim(contract(size=8, tokens=1000), "w2")
    b3, _ = cdr.claim(contract(size=8, tokens=1000), "w3")
    sig = {shape_signature(["A"]): "A", shape_signature(["B"]): "B"}
    # w1 takes A (the deepest); w2 shares A (36 tokens... 72 items x 96 / 2 workers beat B's 30 x 96);
    # w3 takes B rather than a third share of A
    assert [sig[b.shape] for b in (b1, b2, b3)] == ["A", "A", "B"]
    aff = {k.decode(): v.decode().split(":")[0] for k, v in cdr.r.hgetall(K.ModelKeys("m").affinity).items()}
    assert {w: sig[s] for w, s in aff.items()} == {"w1": "A", "w2": "A", "w3": "B"}
    # a worker stays on its shape until it is empty: w3 never comes back to A while B has items
    seen = [sig[cdr.claim(contract(size=8, tokens=1000), "w3")[0].shape] for _ in range(3)]
    assert seen == ["B", "B", "B"]


def test_a_batch_of_ten_thousand_items_from_neighbouring_lanes_moves_whole(cdr):
    # Past Lua's unpack limit (about 8,000 values): the second lane's items still move in full.
    quick(cdr, budget_tokens=10_000_000, budget_items=20_000, lane_depth=0, lane_floor=0)
    cdr.submit([item(f"a{n}", 8) for n in range(100)] + [item(f"b{n}", 200) for n in range(9900)], "j")
    b, _ = cdr.claim(contract(size=20_000, tokens=10_000_000), "w")
    assert len(b.items) == 10_000 and len({it.id for it in b.items}) == 10_000
    assert b.padded_len == 200 and int(cdr.r.hget(K.ModelKeys("m").intake, "items")) == 0


def test_an_idle_claim_answers_early_after_the_full_pass_finished_the_consumers_shape(cdr):
    """lib_claim_idle.lua: once nothing waits and the consumer serves no instance, a claim answers 'idle'
    from a few reads; the claim that found its instance emptied still ran the full pass, which finished
    it. A missing consumer group is still reported, and arguments are still checked."""
    cdr.submit([item(i, 100) for i in range(8)], "j", seal=True)
    b, _ = cdr.claim(contract(tokens=100000), "w")
    assert b is not None and len(b.items) == 8
    mk = K.ModelKeys("m")
    assert cdr.r.hget(mk.affinity, "w") is not None and cdr.r.zcard(mk.active) == 1
    cdr.complete(b, results_for(b))
    assert cdr.claim(contract(tokens=100000), "w") == (None, "idle")
    assert cdr.r.hget(mk.affinity, "w") is None and cdr.r.zcard(mk.active) == 0  # finished by the full pass
    finished = cdr.r.hget(mk.state, "shapes_finished")
    assert cdr.claim(contract(tokens=100000), "w") == (None, "idle")
    assert cdr.r.hget(mk.state, "shapes_finished") == finished
    keys = [mk.base, mk.cfg, mk.state, mk.batches, mk.reclaimed]
    with pytest.raises(Exception, match="ERR_ARG"):
        cdr.r.evalsha(cdr.scripts.claim.sha, len(keys), *keys, "w", 10, 10, "bad token!")
    cdr.r.delete(mk.batches)
    with pytest.raises(Exception, match="NOGROUP"):
        cdr.r.evalsha(cdr.scripts.claim.sha, len(keys), *keys, "w", 10, 10, "t1")


def test_an_affinity_to_an_instance_another_worker_finished_is_dropped(cdr):
    """A worker whose instance another worker's claim finished keeps no name of it: its next claim drops
    it, so that its idle claims after that are answered early (lib_claim_idle.lua)."""
    cdr.submit([item(i, 100) for i in range(4)], "j", seal=True)
    b, _ = cdr.claim(contract(tokens=100000), "w")
    cdr.complete(b, results_for(b))
    mk = K.ModelKeys("m")
    cdr.r.hset(mk.affinity, "w2", "deadbeefdeadbeef:1")  # as another worker's claim left it
    assert cdr.claim(contract(tokens=100000), "w2") == (None, "idle")
    assert cdr.r.hget(mk.affinity, "w2") is None
