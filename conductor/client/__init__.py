"""The conductor's Python API: submit, claim, complete, status and results over Redis.

Every state change is one Lua script (lua/); the client only validates, encodes, pipelines and
decodes. It holds no state that Redis does not also hold, so producers, workers and readers can
be separate processes on separate machines. ``Conductor`` is put together from one module per
concern:

- conductor/redis_contract/connection.py: the URL, credentials and TLS probed once, cluster routing (``connect``);
- conductor/redis_contract/script_calls.py: one typed wrapper per script and the one error mapping;
- conductor/client/core.py: the scripts, model setup and admin, writes confirmed on replicas;
- conductor/client/submit_stream.py: checks before the first write, the streamed submit, declare, seal;
- conductor/client/claiming.py: the one-round-trip claim and lost-claim recovery;
- conductor/client/writeback.py: complete, fail, reclaim;
- conductor/client/job_reads.py: a job's counters and results;
- conductor/redis_contract/records.py: item records decoded into batches.
"""

from __future__ import annotations

from conductor.client.claiming import Claiming
from conductor.client.core import check_name as _check_name
from conductor.client.job_reads import JobReads
from conductor.client.job_reads import stream_reply as _stream_reply
from conductor.client.submit_stream import SUBMIT_CHUNK, SUBMIT_WINDOW, SubmitReport, Submitting, content_sum
from conductor.client.submit_stream import grouped_by_shape as _grouped_by_shape
from conductor.client.writeback import Writeback
from conductor.redis_contract.connection import connect, redact_url
from conductor.redis_contract.records import decode_items
from conductor.redis_contract.script_calls import raise_script_error as _raise_script_error
from conductor.redis_contract.script_calls import record_head as _record_head
from conductor.redis_contract.script_calls import submit_args as _submit_args

__all__ = ["SUBMIT_CHUNK", "SUBMIT_WINDOW", "Conductor", "SubmitReport", "connect", "content_sum", "decode_items",
           "redact_url", "_check_name", "_grouped_by_shape", "_raise_script_error", "_record_head", "_stream_reply",
           "_submit_args"]


class Conductor(Submitting, Claiming, Writeback, JobReads):
    """One client of one Redis; cheap to create, safe to use from one thread at a time."""
