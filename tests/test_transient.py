"""Which Redis replies a worker rides out: each reply as redis-py's own parser turns it into an
exception (it maps some codes to classes and strips the code from the message)."""

import pytest
from redis._parsers.base import BaseParser

from conductor.workers.transient import is_transient

TRANSIENT = ["READONLY You can't write against a read only replica.", "CLUSTERDOWN The cluster is down",
             "TRYAGAIN Multiple keys request during rehashing of slot", "MASTERDOWN Link with MASTER is down",
             "NOREPLICAS Not enough good replicas to write.", "BUSY Redis is busy running a script.",
             "OOM command not allowed when used memory > 'maxmemory'.", "LOADING Redis is loading the dataset",
             "MOVED 3999 127.0.0.1:6381", "ASK 3999 127.0.0.1:6381"]
NOT_TRANSIENT = ["ERR_ARG id: must be 1..512 bytes at item 0", "ERR unknown command", "NOPERM no permissions",
                 "WRONGTYPE Operation against a key holding the wrong kind of value",
                 "CROSSSLOT Keys in request don't hash to the same slot"]


@pytest.mark.parametrize("reply", TRANSIENT)
def test_transient_replies_are_ridden_out(reply):
    assert is_transient(BaseParser.parse_error(reply))


@pytest.mark.parametrize("reply", NOT_TRANSIENT)
def test_bugs_and_bad_arguments_are_not(reply):
    assert not is_transient(BaseParser.parse_error(reply))
