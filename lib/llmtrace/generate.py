"""Generation: prefill the prompt, then decode one token at a time, reading the KV cache.

Without the cache (`use_cache=False`) each step runs the whole sequence again: the same logits,
many more positions processed. Each step gets its own trace: "prefill", "decode 1", ...
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .errors import LlmTraceError
from .sampling import check_sampling, sample
from .trace import NO_TRACE, Trace


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int]
    text: str  # the generated continuation, decoded
    stop_reason: str  # "eos" or "max_new_tokens"
    steps: list[Trace] = field(default_factory=list)  # one per step, empty when tracing is off
    step_logits: list[torch.Tensor] = field(default_factory=list)  # [V] per step: the logits sampled from
    positions_processed: int = 0  # token positions pushed through the model, over all steps
    seconds: float = 0.0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.new_ids


def prefill(model, ids, cache, trace=NO_TRACE, patch=None):
    """All prompt positions in one pass; fills the cache. ids [1, T] -> logits [1, T, V]."""
    return model.forward(ids, trace, cache, start=0, patch=patch)


def decode_one_token(model, token: int, cache, trace=NO_TRACE, patch=None):
    """One new position, attending to everything in the cache. -> logits [1, 1, V]."""
    ids = torch.tensor([[token]])  # [1, 1]
    return model.forward(ids, trace, cache, start=cache.length, patch=patch)


def generate(model, prompt, max_new_tokens: int = 20, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, seed: int = 0, use_cache: bool = True, trace: bool = True,
             keep_values: bool = True, names=None, stop_at_eos: bool = True,
             patch: dict | None = None) -> Generation:
    """prompt: text, or a list / [1, T] tensor of ids. Deterministic for a given seed.
    patch: {name or glob: fn} applied in every step's forward pass (see `Model.forward`)."""
    check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise LlmTraceError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    ids = model.encode(prompt) if isinstance(prompt, str) else torch.as_tensor(prompt).reshape(1, -1)
    T = ids.shape[1]
    if T + max_new_tokens > model.config.max_positions:
        raise LlmTraceError(f"{T} prompt tokens + {max_new_tokens} new ones exceed {model.name}'s context of "
                            f"{model.config.max_positions}: shorten the prompt or lower max_new_tokens")
    generator = torch.Generator().manual_seed(seed)
    cache = model.new_cache(T + max_new_tokens) if use_cache else None
    result = Generation(ids[0].tolist(), [], "", "max_new_tokens")
    start = time.perf_counter()
    for step in range(max_new_tokens):
        label = "prefill" if step == 0 else f"decode {step}"
        tr = Trace(keep_values, names, label) if trace else NO_TRACE
        if step == 0:
            if use_cache:
                logits = prefill(model, ids, cache, tr, patch)
            else:
                logits = model.forward(ids, tr, patch=patch)
            result.positions_processed += T
        elif use_cache:
            logits = decode_one_token(model, result.new_ids[-1], cache, tr, patch)
            result.positions_processed += 1
        else:  # recompute the whole sequence so far
            logits = model.forward(torch.tensor([result.ids]), tr, patch=patch)
            result.positions_processed += len(result.ids)
        last = logits[0, -1]  # [V]
        token = sample(last, temperature, top_k, top_p, generator, tr)
        result.new_ids.append(token)
        result.step_logits.append(last)
        if trace:
            result.steps.append(tr)
        if stop_at_eos and token == model.config.eos_id:
            result.stop_reason = "eos"
            break
    result.seconds = time.perf_counter() - start
    if model.tokenizer is not None:
        result.text = model.tokenizer.decode(result.new_ids)
    return result
