"""Shape signatures: the producer's declaration of cacheable structure (seed 002).

Algorithm, precise enough to reimplement in any language:

1. Encode each cacheable prefix component as UTF-8 bytes.
2. h_i = XXH64(component_i, seed=0), an unsigned 64-bit integer.
3. Start with acc = XXH64(b"", seed=0) ^ n, where n is the number of components, so that an
   empty prefix and different component counts never collide trivially.
4. For each h_i in order: acc = XXH64(acc as 8 bytes little-endian || h_i as 8 bytes
   little-endian, seed=0).
5. The signature is acc as 16 lowercase hexadecimal digits, zero padded.

The broker never parses a prompt: it only compares signatures.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

from conductor.redis_contract.rules import SIG_HEX

_PAIR = struct.Struct("<QQ")


def shape_signature(components: Sequence[str]) -> str:
    acc = xxhash.xxh64_intdigest(b"") ^ len(components)
    for component in components:
        h = xxhash.xxh64_intdigest(component.encode("utf-8"))
        acc = xxhash.xxh64_intdigest(_PAIR.pack(acc, h))
    return f"{acc:0{SIG_HEX}x}"
