"""HF transformers' model class of the checkpoint's family (`LlamaForCausalLM` for a Llama) on the
same fp32 weights as an llmtrace model: the parity tests' reference and the benchmark's rival. transformers is a test requirement, not a dependency of
the library."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from llmtrace_book.load import embedded_checkpoint


def hf_reference(model, attn: str = "eager") -> PreTrainedModel:
    """The Hugging Face directory the model came from, or the embedded model's converted checkpoint,
    loaded by HF with the given attention implementation ("eager" or "sdpa")."""
    source = Path(model.source)
    directory = source if (source / "config.json").is_file() else embedded_checkpoint()
    hf = AutoModelForCausalLM.from_pretrained(directory, attn_implementation=attn,
                                              dtype=torch.float32)
    return hf.eval()
