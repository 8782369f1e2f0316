"""The rules the Lua scripts and the Python side both apply, each written once, here.

conductor/redis_contract/lua_generated.py writes every value below into lib_generated.lua (the
table RULES and the name check), so a script reads them from there and never spells one itself;
tests/test_shared_rules.py fails when a file of lua/ writes one of them by hand or when Python and
the loaded Lua disagree. The result record's layout is one more such rule: its one definition is
``records.Result``, from which the Lua builder is generated the same way.
"""

from __future__ import annotations

import re

# Names (models, jobs, tenants, workers) end up inside key names and hash tags: printable, and
# free of the characters that would break the tag ({}) or the ':' separated layout. '~' only in a
# model's shard names (conductor/redis_contract/shards.py; keys.check_name refuses it elsewhere).
NAME_CHARS = "A-Za-z0-9._/@+=~-"  # a character class body, as both re and Lua patterns read it
NAME_MAX = 128
NAME_RE = re.compile(f"^[{NAME_CHARS}]{{1,{NAME_MAX}}}$")

# A claim's batch token (conductor/client/claiming.py draws one per call; M:bat:T holds its items):
# claim.lua and repair_items_batch.lua take it, verify's repair reads it back from the stream.
TOKEN_CHARS = "A-Za-z0-9._-"
TOKEN_MAX = 64
TOKEN_RE = re.compile(f"^[{TOKEN_CHARS}]{{1,{TOKEN_MAX}}}$")

# An item, as the edge (conductor/formats/checks.py) and submit.lua check it.
MAX_ID_BYTES = 512
MAX_INPUT_TOKENS = 16_777_216
MAX_OUTPUT_TOKENS = 1_048_576
MAX_PREFIX_PARTS = 256  # strings of a shape's prefix
# An item record as submit.lua takes it: a body of 8 MiB, and an id and a job escaped at worst.
MAX_RECORD_BYTES = 8 * 1024 * 1024 + 8192

# Items one submit.lua or register_segment.lua call carries (and results one fail_stored.lua or
# offload_results.lua call moves): the producer's calls and the store's segments are cut to fit.
MAX_CALL_ITEMS = 5000
# A worker's contract: its batch size and batch tokens (register.lua, claim.lua), and so the
# results one complete.lua call may carry.
MAX_BATCH_ITEMS = 65536
MAX_BATCH_TOKENS = 1 << 30
# A failed batch's reason as stored with its dead letter (longer ones are cut).
MAX_REASON_BYTES = 4096

# Lowercase hex strings the scripts take and Python writes: a shape signature (XXH64,
# conductor/formats/signature.py) and an item's content sum (conductor/redis_contract/item_record.py),
# a store segment's name (its content's digest, conductor/redis_contract/segment_record.py and
# conductor/tier/result_segments.py) and its file's SHA-1.
SIG_HEX = 16
SUM_HEX = 16
SEGMENT_NAME_HEX = 32
FILE_SUM_HEX = 40

# A store segment holds at most 1/SEGMENT_PARTS of its model's resident_tokens ceiling
# (conductor/tier/spill.py): the feeder tops the lanes up in steps, and a claim knows the room a
# served shape's next segment needs (lua/lib_serve.lua awaits_store).
SEGMENT_PARTS = 4

# The error codes of the answers a job's early end gives its waiting items (cancel, expiry).
END_CODES = ("cancelled", "expired")

# Request jobs (conductor/client/request.py): complete.lua pushes each new result of a job whose
# name starts with this to the reply list M:reply:J:I, which lives this long for its caller.
REQUEST_JOB_PREFIX = "rq."
REPLY_TTL_MS = 60_000

# The output cap of an OpenAI line that names none: config.py's default_max_tokens default, and
# what the edge uses when it has no Redis to ask.
DEFAULT_MAX_TOKENS = 1024

# Every rule above that a script reads, by the name it has in Lua's RULES table.
LUA_RULES: dict[str, int | str] = {
    "NAME_MAX": NAME_MAX,
    "TOKEN_MAX": TOKEN_MAX,
    "MAX_ID_BYTES": MAX_ID_BYTES,
    "MAX_INPUT_TOKENS": MAX_INPUT_TOKENS,
    "MAX_OUTPUT_TOKENS": MAX_OUTPUT_TOKENS,
    "MAX_PREFIX_PARTS": MAX_PREFIX_PARTS,
    "MAX_RECORD_BYTES": MAX_RECORD_BYTES,
    "MAX_CALL_ITEMS": MAX_CALL_ITEMS,
    "MAX_BATCH_ITEMS": MAX_BATCH_ITEMS,
    "MAX_BATCH_TOKENS": MAX_BATCH_TOKENS,
    "MAX_REASON_BYTES": MAX_REASON_BYTES,
    "REQUEST_JOB_PREFIX": REQUEST_JOB_PREFIX,
    "REPLY_TTL_MS": REPLY_TTL_MS,
    "SIG_HEX": SIG_HEX,
    "SUM_HEX": SUM_HEX,
    "SEGMENT_NAME_HEX": SEGMENT_NAME_HEX,
    "FILE_SUM_HEX": FILE_SUM_HEX,
    "SEGMENT_PARTS": SEGMENT_PARTS,
}


def lua_class(chars: str) -> str:
    """A character class body (``NAME_CHARS``) as a Lua pattern set: every punctuation character
    escaped with %, except the '-' of a range."""
    out = []
    for i, ch in enumerate(chars):
        is_range = ch == "-" and 0 < i < len(chars) - 1
        out.append(ch if ch.isalnum() or is_range else "%" + ch)
    return "".join(out)
