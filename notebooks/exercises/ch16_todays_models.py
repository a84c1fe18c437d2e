"""Chapter 16: a sliding window's mask."""

import dataclasses

import torch

from llmtrace.model import Model
from llmtrace.trace import Trace

from .registry import PROMPT, Case, caller, exercise
from .verdicts import shape, tuple_compare

WINDOW = 3  # the window the mask is checked with: shorter than any prompt here


def sliding_window_mask(T: int, start: int, window: int) -> torch.Tensor:
    """A sliding-window layer's mask (Mistral, Gemma 3's local layers). T queries at positions
    start .. start+T-1, over the start+T keys the cache holds, window W -> [T, start+T] float:
    0 where query p may see key j, the causal rule and the window's, p - W < j <= p (itself
    and the W - 1 keys before it); float('-inf') elsewhere."""
    p = torch.arange(start, start + T)[:, None]  # [T, 1]: absolute positions
    j = torch.arange(start + T)[None, :]  # [1, S]
    blocked = (j > p) | (j <= p - window)  # the future, and keys W or more behind
    return torch.zeros(T, start + T).masked_fill(blocked, float("-inf"))  # [T, S]


@exercise(16, sliding_window_mask)
def _(model) -> Case:
    """The masks the running model's layer 0 records when its config is given a window: the
    prefill of the prompt, then one decode step reading the cache."""
    c = model.config
    every = {"layer_types": ()} if c.layer_types else {}  # every layer slides
    first = dataclasses.replace(model.weights, layers=model.weights.layers[:1])  # layer 0 alone
    windowed = Model(c.replace(sliding_window=WINDOW, n_layers=1, no_rope_layers=(), **every),
                     first, model.tokenizer)
    ids = model.encode(PROMPT)  # [1, T]
    T, name = ids.shape[1], "layers.0.attn.window_mask"
    cache = windowed.new_cache(T + 1)
    prefill, step = Trace(names=[name]), Trace(names=[name])
    windowed.forward(ids, prefill, cache)
    windowed.forward(ids[:, -1:], step, cache, start=T)  # [1, 1]: any token will do
    want = (prefill[name], step[name])  # [T, T], [1, T + 1]
    inf = float("-inf")

    def relative(T, start, W):  # query i taken to sit at position i
        p, j = torch.arange(T)[:, None], torch.arange(start + T)[None, :]
        return torch.zeros(T, start + T).masked_fill((j > p) | (j <= p - W), inf)

    def window_only(T, start, W):
        p, j = torch.arange(start, start + T)[:, None], torch.arange(start + T)[None, :]
        return torch.zeros(T, start + T).masked_fill(j <= p - W, inf)

    return Case(lambda fn: (caller(T, 0, WINDOW)(fn), caller(1, T, WINDOW)(fn)), want,
                f"the window-{WINDOW} masks {shape(want[0])}, {shape(want[1])}",
                tuple_compare(("prefill", "decode step"), 1e-6), [
                    (lambda T, s, W: sliding_window_mask(T, s, s + T + 1),
                     "that is the causal mask alone: keys `window` or more behind the query "
                     "are blocked too"),
                    (window_only, "the future is blocked too: the window adds to the causal "
                                  "mask"),
                    (lambda T, s, W: sliding_window_mask(T, s, W + 1),
                     "off by one: a query sees itself and the window - 1 keys before it, "
                     "block j <= p - window"),
                    (lambda T, s, W: sliding_window_mask(T, s, W - 1),
                     "off by one: a query sees `window` keys, itself included"),
                    (relative, "positions are absolute: query i of a pass sits at start + i, "
                               "and the cache holds keys 0 .. start + T - 1")])


def layers_without_rope(acts: dict, n_layers: int) -> list:
    """Which layers have no RoPE (SmolLM3's NoPE layers), read off a traced run. acts: for each
    layer i, `layers.{i}.attn.rope_q` (the queries after RoPE's step) and what that step
    received: `layers.{i}.attn.q` (`attn.q_norm` in a family that normalizes each head first,
    Qwen3 or Gemma 3), each [B, T, H, hd]; n_layers: how many -> the indices of the layers whose
    step left the queries as they were, in order."""
    unturned = []
    for i in range(n_layers):
        before = f"layers.{i}.attn.q_norm"  # what RoPE received, where a head norm came first
        before = before if before in acts else f"layers.{i}.attn.q"
        if torch.equal(acts[f"layers.{i}.attn.rope_q"], acts[before]):
            unturned.append(i)
    return unturned


@exercise(16, layers_without_rope)
def _(model) -> Case:
    """The running model's weights with SmolLM3's pattern of layers: no RoPE on every fourth
    (every n-th in a model of n < 4 layers, so that one layer has none)."""
    c = model.config
    every = min(4, c.n_layers)
    flags = tuple(int((i + 1) % every != 0) for i in range(c.n_layers))
    nope = Model(c.replace(no_rope_layers=flags), model.weights, model.tokenizer)
    step = "q_norm" if c.qk_norm else "q"
    names = [f"layers.{i}.attn.{n}" for i in range(c.n_layers) for n in (step, "rope_q")]
    _, trace = nope.run(PROMPT, names=names)
    acts = {n: trace[n] for n in names}
    want = [i for i in range(c.n_layers) if not nope.config.has_rope(i)]

    def compare(got, want):
        got = list(got) if isinstance(got, (list, tuple)) else got
        if got == want:
            return None
        return f"got {got!r:.40}, wanted layers {want!r:.40}"

    return Case(caller(acts, c.n_layers), want,
                f"the {len(want)} NoPE layers of {c.n_layers} (one in {every})",
                compare, [
                    (lambda a, n: [i for i in range(n) if i not in want],
                     "those are the layers RoPE turned: keep the ones it left alone"),
                    (lambda a, n: [i + 1 for i in want],
                     "layers count from 0, as their record names do")])
