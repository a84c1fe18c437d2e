"""Generation: prefill the prompt, then decode one token at a time, reading the KV cache.

Without the cache (`use_cache=False`) each step runs the whole sequence again: the same logits,
many more positions processed. Each step gets its own trace: "prefill", "decode 1", ...
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .check import check_finite, check_ids, check_int, check_trace_budget
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
    step_logits: list[torch.Tensor] = field(
        default_factory=list)  # [V] per step: the logits sampled from
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


def generate(model, prompt, max_new_tokens: int = 20, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             use_cache: bool = True, keep_steps: bool = True, keep_values: bool = True, names=None,
             stop_at_eos: bool = True, first_step_only: bool = False,
             patch: dict | None = None) -> Generation:
    """prompt: text, or a list / [1, T] tensor of ids. Deterministic for a given seed.
    keep_steps: one Trace per step in `steps` ("prefill", "decode 1", ...), else none at all
    (`keep_values` and `names` then choose what each step's trace keeps).
    first_step_only: keep the trace and logits of the prefill alone (memory flat in the number of
    new tokens), as the CLI does: it prints no more.
    patch: {name or glob: fn} applied in every step's forward pass (see `Model.forward`)."""
    check_sampling(temperature, top_k, top_p, seed)
    if check_int("max_new_tokens", max_new_tokens) < 1:
        raise LlmTraceError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    V = model.config.vocab_size
    ids = model.encode(prompt) if isinstance(prompt, str) else check_ids(prompt, V)  # [1, T]
    T = ids.shape[1]
    if T + max_new_tokens > model.config.max_positions:
        raise LlmTraceError(f"{T} prompt tokens + {max_new_tokens} new ones exceed {model.name}'s "
                            f"context of {model.config.max_positions}: shorten the prompt or lower "
                            f"max_new_tokens")
    if keep_steps and keep_values and names is None:
        check_trace_budget(model.config, T, 0 if first_step_only else max_new_tokens - 1)
    generator = torch.Generator().manual_seed(seed)
    cache = model.new_cache(T + max_new_tokens) if use_cache else None
    result = Generation(ids[0].tolist(), [], "", "max_new_tokens")

    def kept(step: int) -> bool:
        return step == 0 or not first_step_only

    def new_trace(step: int):
        label = "prefill" if step == 0 else f"decode {step}"
        return Trace(keep_values, names, label) if keep_steps and kept(step) else NO_TRACE

    def sample_next(logits, trace, step: int) -> int:
        """Sample from the last position's logits [V] and keep the step."""
        last = logits[0, -1]  # [V]
        check_finite(model, result.ids, last, trace, patch)
        token = sample(last, temperature, top_k, top_p, generator, trace)
        result.new_ids.append(token)
        if kept(step):
            result.step_logits.append(last)
            if keep_steps:
                result.steps.append(trace)
        return token

    start = time.perf_counter()
    # Prefill: every prompt position in one pass, filling the cache.
    trace = new_trace(0)
    if use_cache:
        logits = prefill(model, ids, cache, trace, patch)  # [1, T, V]
    else:
        logits = model.forward(ids, trace, patch=patch)  # [1, T, V]
    result.positions_processed = T
    token = sample_next(logits, trace, 0)

    # Decode: one new position per step. The last sampled token is never fed back.
    for step in range(1, max_new_tokens):
        if stop_at_eos and token == model.config.eos_id:
            break
        trace = new_trace(step)
        if use_cache:
            logits = decode_one_token(model, token, cache, trace, patch)  # [1, 1, V]
            result.positions_processed += 1
        else:  # no cache: recompute the whole sequence so far
            seq = torch.tensor([result.ids])  # [1, T + step]
            logits = model.forward(seq, trace, patch=patch)  # [1, T + step, V]
            result.positions_processed += len(result.ids)
        token = sample_next(logits, trace, step)
    if stop_at_eos and token == model.config.eos_id:
        result.stop_reason = "eos"
    result.seconds = time.perf_counter() - start
    if model.tokenizer is not None:
        result.text = model.tokenizer.decode(result.new_ids)
    return result
