"""A random-initialised Llama written to a local folder, for real engines without downloading weights.

vLLM and any OpenAI-compatible server load a model from a folder in the transformers layout (a
config, safetensors weights, a tokenizer with a chat template). This writes one whose forward
passes, KV cache and prefix cache are real and whose text is noise: what tests, benchmarks and a
first try need. Nothing is downloaded: the tokenizer is byte-level BPE with no merges (every byte
is a token), built with ``tokenizers``.

    python -m conductor.workers.engines.random_model DIR [--layers 4 --hidden 256 ...]
"""

from __future__ import annotations

import argparse
import importlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The chat template run_batch, vllm serve and the conductor's engines all apply: the system
# prompt comes first, so one shape's prompts share their leading tokens (the prefix cache's key).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")
SPECIALS = ("<s>", "</s>", "<pad>")
LOGIT_SCALE = 8.0  # the mean norm of a printable token's output row: sampled text varies, stays printable


def _byte_of(ch: str) -> int:
    """The byte a byte-level BPE alphabet character stands for (GPT-2's bytes_to_unicode, inverted)."""
    o = ord(ch)
    if 33 <= o <= 126 or 161 <= o <= 172 or 174 <= o <= 255:
        return o
    return _SHIFTED.get(o, -1)


def _shifted() -> dict[int, int]:
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, n = {}, 0
    for b in range(256):
        if b not in printable:
            out[256 + n] = b
            n += 1
    return out


_SHIFTED = _shifted()


@dataclass(frozen=True)
class ModelSize:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    max_positions: int = 4096


def write_random_llama(path: str | Path, size: ModelSize | None = None, seed: int = 0) -> Path:
    """Write the model and tokenizer to ``path`` (created); returns it. Same seed, same weights."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    # Any: transformers' constructors are untyped, and it types PreTrainedModel.to through a decorator
    tf: Any = importlib.import_module("transformers")

    size = size or ModelSize()
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[1],
                                   pad_token=SPECIALS[2])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(vocab_size=len(vocab), hidden_size=size.hidden, intermediate_size=size.intermediate,
                      num_hidden_layers=size.layers, num_attention_heads=size.heads,
                      num_key_value_heads=size.kv_heads, max_position_embeddings=size.max_positions,
                      bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    lm = tf.LlamaForCausalLM(cfg)
    with torch.no_grad():
        # Only printable ASCII is ever chosen: the other tokens' output rows are zero (logit 0), and
        # the printable ones' are scaled so that their best logit stands far above 0, greedy or
        # sampled at temperature 1. The text is readable noise, and no answer ends early on EOS:
        # an item's output length is its max_tokens, the same on every engine.
        head = lm.lm_head.weight
        keep = torch.zeros(len(vocab), dtype=torch.bool)
        for ch, i in vocab.items():
            keep[i] = ch not in SPECIALS and 32 <= _byte_of(ch) < 127
        head[~keep] = 0
        head[keep] *= LOGIT_SCALE / head[keep].norm(dim=1, keepdim=True).mean()
    lm.to(torch.bfloat16).save_pretrained(out)
    (out / "conductor-random-model.json").write_text(json.dumps({"seed": seed, **asdict(size)}) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m conductor.workers.engines.random_model",
                                description="Write a random-initialised Llama and a byte-level tokenizer to DIR.")
    p.add_argument("dir")
    d = ModelSize()
    for f in ("layers", "hidden", "heads", "kv_heads", "intermediate", "max_positions"):
        p.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(d, f))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    size = ModelSize(a.layers, a.hidden, a.heads, a.kv_heads, a.intermediate, a.max_positions)
    print(write_random_llama(a.dir, size, a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
