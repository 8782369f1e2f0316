"""A Redis Streams job conductor for batch LLM inference: full, pure, cache-friendly batches."""

from conductor.client import Conductor, connect
from conductor.errors import BadInput, ConductorError, QueueFull, RedisUnavailable, SchemaMismatch
from conductor.records import Batch, BatchItem, Contract, Result
from conductor.request import AsyncRequestClient, RequestClient
from conductor.signature import shape_signature

__all__ = ["AsyncRequestClient", "BadInput", "Batch", "BatchItem", "Conductor", "ConductorError", "Contract",
           "QueueFull", "RedisUnavailable", "RequestClient", "Result", "SchemaMismatch", "connect", "shape_signature"]
