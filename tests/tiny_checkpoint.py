"""A tiny random-weight Llama checkpoint in Hugging Face format, made in seconds, as
LLMs-from-scratch's tests do: HF's own `LlamaConfig` and `LlamaForCausalLM`, saved with
`save_pretrained`, beside TinyLlama's real tokenizer (32,000 pieces). Two layers, hidden 64, GQA 4/2.
Its logits are noise; its shapes, ids and plumbing are a real Llama checkpoint's.

    python tests/tiny_checkpoint.py DIR      # write one, e.g. for LLMTRACE_MODEL=DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

TINY = dict(vocab_size=32000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)


def make_tiny_checkpoint(directory: str | Path, seed: int = 0, **overrides) -> Path:
    """Write config.json, model.safetensors, tokenizer.model and tokenizer_config.json."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtrace.weights.tokenizer_llama import build

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF initialises norms to 1; random ones exercise the weight in RMSNorm too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(d, safe_serialization=True)
    if config.vocab_size == 32000:
        shutil.copy(build(fetch=False), d / "tokenizer.model")
        (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    return d


if __name__ == "__main__":
    print(make_tiny_checkpoint(sys.argv[1]))
