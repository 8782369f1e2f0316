"""A Redis Streams job conductor for batch LLM inference: full, pure, cache-friendly batches."""

from conductor.client import Conductor, connect
from conductor.client.request import AsyncRequestClient, RequestClient
from conductor.errors import BadInput, ConductorError, QueueFull, RedisUnavailable, SchemaMismatch
from conductor.formats.signature import shape_signature
from conductor.redis_contract.records import Batch, BatchItem, Contract, Result

__all__ = ["AsyncRequestClient", "BadInput", "Batch", "BatchItem", "Conductor", "ConductorError", "Contract",
           "QueueFull", "RedisUnavailable", "RequestClient", "Result", "SchemaMismatch", "connect", "shape_signature"]
