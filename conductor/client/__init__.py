"""The conductor's Python API: submit, claim, complete, status and results over Redis.

Every state change is one Lua script (lua/); the client only validates, encodes, pipelines and
decodes. It holds no state that Redis does not also hold, so producers, workers and readers can
be separate processes on separate machines. ``Conductor`` is put together from one module per
concern:

- conductor/redis_contract/connection.py: the URL, credentials and TLS probed once, cluster routing
  (``connect``, also exported here);
- conductor/redis_contract/script_calls.py: one typed wrapper per script and the one error mapping;
- conductor/client/core.py: the scripts, model setup and admin, writes confirmed on replicas;
- conductor/client/submit_stream.py: checks before the first write, the streamed submit, declare,
  seal (past a model's ceiling, to the disk tier: conductor/tier/spill.py);
- conductor/client/claiming.py: the one-round-trip claim and lost-claim recovery;
- conductor/client/writeback.py: complete, fail, reclaim;
- conductor/client/job_reads.py: a job's counters and results;
- conductor/redis_contract/records.py: item records decoded into batches.
"""

from __future__ import annotations

from conductor.client.claiming import Claiming
from conductor.client.job_reads import JobReads
from conductor.client.submit_stream import Submitting
from conductor.client.writeback import Writeback
from conductor.redis_contract.connection import connect

__all__ = ["Conductor", "connect"]


class Conductor(Submitting, Claiming, Writeback, JobReads):
    """One client of one Redis; cheap to create, safe to use from one thread at a time."""
