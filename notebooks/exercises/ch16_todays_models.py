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
    windowed = Model(c.replace(sliding_window=WINDOW, n_layers=1, **every), first,
                     model.tokenizer)
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


def kv_source_layers(layer_types: list, n_shared: int) -> list:
    """Gemma 4's KV sharing. layer_types: "sliding" or "full" for each layer; the last
    n_shared layers compute no K, V of their own -> for each layer, the layer whose K and V
    it attends over: itself, or, for a shared layer, the last layer of its own kind before
    the shared ones."""
    first = len(layer_types) - n_shared  # the first layer that computes no K, V
    sources = list(range(first))
    for kind in layer_types[first:]:
        sources.append(max(j for j in range(first) if layer_types[j] == kind))
    return sources


def read_sources(trace, n_layers: int) -> list:
    """Each layer's source, from its records: its own k_proj, or whose K its cache says."""
    out = []
    for i in range(n_layers):
        op = trace.get(f"layers.{i}.attn.kv_cache.k").op  # "K cache: shared: layers.13's"
        out.append(int(op.split("layers.")[1].split("'")[0]) if "shared" in op else i)
    return out


def _compare_sources(got, want) -> str | None:
    if not isinstance(got, (list, tuple)) or len(got) != len(want):
        return f"return one layer index per layer: a list of {len(want)}"
    wrong = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    if wrong:
        i = wrong[0]
        return f"layer {i}: you said {got[i]}, its records read layer {want[i]}'s K, V"
    return None


@exercise(16, kv_source_layers)
def _(model) -> Case:
    """Checked on the records of gemma-4-e2b's walk on the meta device (any running model):
    which layer's K each layer's kv_cache.k holds."""
    from llmtrace import Config
    from llmtrace.model import trace_shapes

    c = Config.from_name("gemma-4-e2b")
    (trace,) = trace_shapes(c, 2, 0)
    want = read_sources(trace, c.n_layers)
    kinds = list(c.layer_types)
    first = c.n_layers - c.kv_shared_layers

    def first_of_kind(types, n):  # the first earlier layer of the kind, not the last
        f = len(types) - n
        return list(range(f)) + [min(j for j in range(f) if types[j] == t)
                                 for t in types[f:]]

    return Case(caller(kinds, c.kv_shared_layers), want,
                f"the {c.n_layers} layers' K, V sources of {c.name}", _compare_sources, [
                    (first_of_kind, "a shared layer reads the LAST layer of its kind before "
                                    f"the shared ones (layer {first - 1} or before)"),
                    (lambda types, n: list(range(len(types))),
                     f"the last {c.kv_shared_layers} layers compute no K, V: they read an "
                     "earlier layer's")])
