"""A byte-level tokenizer for the tiny test model: token = byte, plus three specials.

Deterministic and dependency-free, so the tiny random model runs without downloading a
vocabulary. Ids 0..255 are the bytes of the UTF-8 text; PAD, BOS and EOS follow.
"""

from __future__ import annotations


class ByteTokenizer:
    pad_token_id = 256
    bos_token_id = 257
    eos_token_id = 258
    vocab_size = 259

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
