"""Generation: prefill the prompt, then decode one token at a time, reading the KV cache.

Without the cache (`use_cache=False`) each step runs the whole sequence again: the same logits,
many more positions processed. Each step can keep its own trace: "prefill", "decode 1", ...
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .check import check_int
from .errors import LlmTraceError
from .model import check_finite, check_trace_budget
from .sampling import check_sampling, draw, warp
from .trace import NO_TRACE, Patched, Trace


@dataclass
class Generation:
    prompt_ids: list[int]
    new_ids: list[int]
    text: str  # the generated continuation, decoded
    stop_reason: str  # "eos" or "max_new_tokens"
    steps: list[Trace] = field(default_factory=list)  # one per traced step
    step_logits: list[torch.Tensor] = field(
        default_factory=list)  # [V] per traced step (every step when not tracing)
    positions_processed: int = 0  # token positions pushed through the model, over all steps
    seconds: float = 0.0

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.new_ids


@dataclass(frozen=True)
class Tracing:
    """What generate keeps of each step: a `Trace` per step, keeping values (or shapes only),
    of the records `names` chooses (see `Trace`), for the first `steps` steps (None: all)."""
    keep_values: bool = True
    names: object = None
    steps: int | None = None

    def trace(self, step: int):
        if self.steps is not None and step >= self.steps:
            return NO_TRACE
        label = "prefill" if step == 0 else f"decode {step}"
        return Trace(self.keep_values, self.names, label)


NOT_TRACED = Tracing(steps=0)


def prefill(model, ids, cache, trace=NO_TRACE):
    """All prompt positions in one pass, filling the cache.
    ids [1, T] -> logits [V] of the last position."""
    return model.forward(ids, trace, cache, start=0)[0, -1]


def decode_one_token(model, ids: list[int], cache, trace=NO_TRACE):
    """The newest token, at position len(ids) - 1, attending to the earlier ones in
    the cache (without one: all positions again). -> logits [V] of the last position."""
    pos = len(ids) - 1
    if cache is None:
        return model.forward(torch.tensor([ids]), trace)[0, -1]  # [V]
    new = torch.tensor([ids[pos:]])  # [1, 1]
    return model.forward(new, trace, cache, start=pos)[0, -1]  # [V]


def generate(model, prompt, max_new_tokens: int = 20, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int = 0,
             use_cache: bool = True, stop_at_eos: bool = True,
             trace: Tracing | bool = True, patch: dict | None = None) -> Generation:
    """prompt: text, or a list / [1, T] tensor of ids. Deterministic for a given seed.
    trace: True keeps a Trace of every value of every step (`steps`), False none; a
    `Tracing` chooses. patch: {name or glob: fn}, applied in every step (`Patched`)."""
    ids = model.ids(prompt)  # [1, T]
    T = ids.shape[1]
    tracing = check_generate(model, T, max_new_tokens, temperature, top_k, top_p, seed,
                             trace)  # every argument once, before the first step
    generator = torch.Generator().manual_seed(int(seed))  # a numpy int too
    cache = model.new_cache(T + max_new_tokens) if use_cache else None
    g = Generation(ids[0].tolist(), [], "", "max_new_tokens")
    started = time.perf_counter()

    for step in range(max_new_tokens):
        t = tracing.trace(step)
        flow = t if patch is None else Patched(patch, t, model.config.vocab_size)
        if step == 0:  # prefill: every prompt position in one pass, filling the cache
            last = prefill(model, ids, cache, flow)  # [V]
            g.positions_processed += T
        else:  # decode: one new position (without a cache: all of them again)
            last = decode_one_token(model, g.ids, cache, flow)  # [V]
            g.positions_processed += 1 if use_cache else len(g.ids)
        if step == 0 and patch is not None:
            flow.check_all_matched()
        check_finite(model, g.ids, last, t, patch)
        g.new_ids.append(draw(warp(last, temperature, top_k, top_p, t), generator, t))
        keep_step(g, tracing, step, t, last)
        if stop_at_eos and g.new_ids[-1] in model.config.end_ids:
            g.stop_reason = "eos"
            break
    g.seconds = time.perf_counter() - started
    g.text = model.tokenizer.decode(g.new_ids) if model.tokenizer is not None else ""
    return g


def keep_step(g: Generation, tracing: Tracing, step: int, trace, last) -> None:
    if not tracing.steps or step < tracing.steps:  # every step's, unless a few are traced
        g.step_logits.append(last)
    if isinstance(trace, Trace):
        g.steps.append(trace)


def check_generate(model, T, max_new_tokens, temperature, top_k, top_p, seed,
                   trace) -> Tracing:
    """Every argument once, before the first step; -> the tracing policy."""
    check_sampling(temperature, top_k, top_p, seed)
    if check_int("max_new_tokens", max_new_tokens) < 1:
        raise LlmTraceError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if model.is_meta:
        raise LlmTraceError(f"{model.name} is on the meta device (shapes, no values): there "
                            f"is nothing to sample from; trace its shapes with trace_shapes")
    if T + max_new_tokens > model.config.max_positions:
        raise LlmTraceError(f"{T} prompt tokens + {max_new_tokens} new ones exceed "
                            f"{model.name}'s context of {model.config.max_positions}: shorten "
                            f"the prompt or lower max_new_tokens")
    if not isinstance(trace, (bool, Tracing)):
        raise LlmTraceError(f"trace must be True, False or a Tracing(...), got "
                            f"{type(trace).__name__}")
    tracing = Tracing() if trace is True else NOT_TRACED if trace is False else trace
    first = tracing.trace(0)
    if isinstance(first, Trace):  # the memory its kept values will take, before running
        steps = max_new_tokens if tracing.steps is None else min(tracing.steps, max_new_tokens)
        check_trace_budget(model.config, first, T, steps - 1)
    return tracing
