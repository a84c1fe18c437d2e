"""A tiny random-weight Llama checkpoint in Hugging Face format, made in seconds, as
LLMs-from-scratch's tests do: HF's own `LlamaConfig` and `LlamaForCausalLM`, saved with
`save_pretrained`, beside TinyLlama's real tokenizer (32,000 pieces). Two layers, hidden 64, GQA 4/2.
Its logits are noise; its shapes, ids and plumbing are a real Llama checkpoint's. Other families
(`FAMILIES`) come from their own HF config and model classes, with what makes each one differ.

    python tests/tiny_checkpoint.py DIR [FAMILY]   # write one, e.g. for LLMTRACE_MODEL=DIR
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

# family -> (HF config class, HF model class, what the family changes on top of TINY). The
# windows and the Llama 3 rope are chosen to matter at a dozen positions: a window of 4 slides
# past a prompt of 11; with head_dim 16 and original_max_position_embeddings 64, the llama3
# rule leaves pair 0 alone, blends pairs 1 and 2 and slows the rest 8 times. Weights drawn 5 times
# wider than HF's default (initializer_range 0.02) make attention sharp, so each family's switch
# moves the logits by far more than the tests' tolerance (measured: 0.7 to 5 where it would be
# 0.002 to 1 at 0.02).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
SHARP = {"initializer_range": 0.1}
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {**SHARP, "rope_parameters": LLAMA3_ROPE}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**SHARP, "sliding_window": 4}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", SHARP),  # the bias on Q, K, V is in the class
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**SHARP, "head_dim": 24}),  # != hidden/heads
}


def make_tiny_checkpoint(directory: str | Path, seed: int = 0, family: str = "llama",
                         **overrides) -> Path:
    """Write config.json, model.safetensors, tokenizer.model and tokenizer_config.json."""
    import torch
    import transformers

    from llmtrace.weights.tokenizer_llama import build

    config_class, model_class, changes = FAMILIES[family]
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**TINY, **changes, **overrides})
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # HF initialises norms to 1; random ones exercise the weight in RMSNorm too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):  # HF initialises biases to 0
                p.normal_(0.0, 0.5)
    model.save_pretrained(d, safe_serialization=True)
    if config.vocab_size == 32000:
        shutil.copy(build(fetch=False), d / "tokenizer.model")
        (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    return d


if __name__ == "__main__":
    print(make_tiny_checkpoint(*sys.argv[1:2], family=(sys.argv[2:] or ["llama"])[0]))
