import re

import xxhash

from conductor.formats.signature import shape_signature
from conductor.redis_contract.keys import ModelKeys


def test_signature_is_stable_and_documented():
    # Recompute by the documented algorithm, independently of the module.
    import struct
    acc = xxhash.xxh64_intdigest(b"") ^ 2
    for comp in ("system", "shots"):
        acc = xxhash.xxh64_intdigest(struct.pack("<QQ", acc, xxhash.xxh64_intdigest(comp.encode())))
    assert shape_signature(["system", "shots"]) == f"{acc:016x}"
    assert re.fullmatch(r"[0-9a-f]{16}", shape_signature([]))


def test_signature_depends_on_order_and_count():
    assert shape_signature(["a", "b"]) != shape_signature(["b", "a"])
    assert shape_signature(["ab"]) != shape_signature(["a", "b"])
    assert shape_signature([]) != shape_signature([""])
    assert shape_signature(["é"]) == shape_signature(["é"])


def test_all_model_keys_share_one_hash_tag():
    mk = ModelKeys("llama-3.1-8b")
    names = [mk.cfg, mk.state, mk.staged, mk.batches, mk.reclaimed, mk.dead, mk.workers, mk.shape("ab"),
             mk.inst("ab:1"), mk.inst_lanes("ab:1"), mk.lane("ab:1", 3), mk.lanemeta("ab:1", 3),
             mk.heartbeat("w"), mk.job("j"), mk.job_items("j"), mk.job_results("j"), mk.maint_lease]
    assert all(n.startswith("cdr:{llama-3.1-8b}:") for n in names)


def test_bad_model_names_are_refused():
    import pytest
    for bad in ["", "a{b}", "a b", "x" * 200, "a:b"]:
        with pytest.raises(ValueError, match="model"):
            ModelKeys(bad)
