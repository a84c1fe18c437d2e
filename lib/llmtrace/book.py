"""What every chapter of the book opens with: the model that produced its values, and TinyLlama's
exact shapes for the same prompt, traced on the meta device."""

from __future__ import annotations

import functools

from .model import Model, trace_shapes
from .models import load_model, resolve
from .trace import Trace

PROMPT = "The capital of France is"


@functools.lru_cache(maxsize=1)
def tinyllama_walk(prompt: str = PROMPT) -> tuple[Trace, Trace]:
    """TinyLlama-1.1B on the meta device: (prefill, first decode step), with its real token ids."""
    import torch

    from .weights.tokenizer_llama import llama_tokenizer

    ids = torch.tensor([llama_tokenizer().encode(prompt)])  # [1, 6]: BOS + 5
    prefill, decode = trace_shapes("tinyllama-1.1b", ids, decode_steps=1, label="TinyLlama-1.1B")
    return prefill, decode


def describe(model: Model) -> str:
    c = model.config
    head = "tied to the embedding" if c.tied_lm_head else "untied"
    return (f"{c.name}: {c.n_layers} layers, hidden {c.hidden_size}, {c.n_heads} query / {c.n_kv_heads} KV heads "
            f"of {c.head_dim}, FFN {c.ffn_size}, vocabulary {c.vocab_size:,}, LM head {head}")


def banner_text(model: Model) -> str:
    which = "TinyLlama-1.1B itself" if model.config.name == "tinyllama-1.1b" else \
        "the embedded model (TinyLlama's weights are not on this machine)"
    return (f"**Values on this page** come from {which}: {describe(model)}; weights from {model.source}.  \n"
            f"**TinyLlama-1.1B's shapes** come from its shape-only trace on PyTorch's meta device "
            f"(no weights needed), for the same prompt with TinyLlama's own tokenizer.")


def start_chapter(name: str | None = None) -> tuple[Model, Trace]:
    """Load the model in force (LLMTRACE_MODEL, default auto), show the banner, return
    (model, TinyLlama's prefill shape trace)."""
    from IPython.display import Markdown, display

    model = load_model(resolve(name))
    display(Markdown(banner_text(model)))
    return model, tinyllama_walk()[0]
