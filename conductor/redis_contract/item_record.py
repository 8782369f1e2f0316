"""The item record, built in one place: the bytes a lane holds for one item (keys.py: the JSON
array ``[id, job, input_tokens, max_tokens, prompt, payload]``). submit.lua's ARGV
(script_calls.submit_args), a store segment's records (conductor/tier/segments.py) and the
content sum a re-sent id is judged by (``content_sum``) all take their bytes from ``item_record``,
so the three cannot drift apart."""

from __future__ import annotations

import hashlib

from conductor.redis_contract import rules
from conductor.redis_contract.records import PreparedItem, json_encoder


def record_head(job: str) -> bytes:
    """The part of an item record after its id, up to its body (the tokens are %d holes): the
    same for every item of a job, so a caller building many records encodes the job once."""
    return b"," + json_encoder.encode(job) + b",%d,%d,"


def item_record(it: PreparedItem, head: bytes) -> bytes:
    """``it``'s record under the job whose ``record_head`` is ``head``: the body (the JSON
    [prompt, payload]) supplies the record's tail after its '[', so the payload keeps its bytes."""
    return b"[" + json_encoder.encode(it.id) + head % (it.input_tokens, it.max_tokens) + it.body[1:]


def content_sum(head: bytes, it: PreparedItem) -> str:
    """What submit.lua keeps per id (M:in:J:sums) to tell a re-sent item from another item under
    the same id: 16 hex digits of SHA-1(sig || record)."""
    return record_sum(it.sig, item_record(it, head))


def record_sum(sig: str, record: bytes) -> str:
    """``content_sum`` of a record already built (submit.lua's ARGV carries both)."""
    return hashlib.sha1(sig.encode() + record).hexdigest()[:rules.SUM_HEX]
