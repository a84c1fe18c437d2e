"""Chapter 16: a sliding window's mask, and the share of attention a sink takes."""

import dataclasses

import torch

from llmtrace.model import Model
from llmtrace.trace import Trace

from .registry import PROMPT, Case, caller, exercise
from .verdicts import shape, tensor_compare, tuple_compare

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


def sink_share(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """gpt-oss's attention sinks. Each head h has a learned logit sinks[h] that joins every row
    of its scores as one more column of the softmax; the sink's column is then dropped, so the
    real keys' weights sum below 1. scores [H, S]: the last query's scores over the S keys it
    sees (no key masked), sinks [H] -> [H] float: the share of each head's attention the sink
    takes, 1 minus what the real keys get."""
    both = torch.cat([scores, sinks[:, None]], dim=-1)  # [H, S + 1]: the sink as column S
    return torch.softmax(both, dim=-1)[:, -1]  # [H]


@exercise(16, sink_share)
def _(model) -> Case:
    """The last query's scores at layer 0 of the running model, run alone with every key in
    view, and what its weights leave out. A model without sinks (any but gpt-oss) is given a
    sink logit per head, spread from -2 to 2, so that the exercise runs on every family."""
    c = model.config
    lw = model.weights.layers[0]
    sinks = lw.sinks if lw.sinks is not None else torch.linspace(-2.0, 2.0, c.n_heads)
    one = c.replace(n_layers=1, attn_sinks=True, sliding_window=0,
                    layer_types=("full",) if c.layer_types else (),
                    mlp_types=c.mlp_types[:1])  # layer 0 alone, its window lifted
    layer = dataclasses.replace(lw, sinks=sinks.to(lw.q_proj.dtype))
    first = dataclasses.replace(model.weights, layers=[layer])
    names = ["layers.0.attn.scores", "layers.0.attn.weights"]
    trace = Trace(names=names)
    Model(one, first, model.tokenizer).forward(model.encode(PROMPT), trace)
    scores = trace[names[0]][0, :, -1]  # [H, S]: the last query sees every key
    want = 1 - trace[names[1]][0, :, -1].sum(-1)  # [H]: what the keys' weights leave out
    return Case(caller(scores, layer.sinks), want,
                f"each head's sink share {shape(want)}",
                tensor_compare(1e-4), [  # want is 1 - a sum of floats: 1e-7 off
                    (lambda s, k: 1 - torch.softmax(s, -1).sum(-1),
                     "the sink joins the softmax as one more column: a softmax over the keys "
                     "alone sums to 1 and leaves nothing"),
                    (lambda s, k: torch.softmax(torch.cat([s, k[:, None]], -1), -1)[:, :-1]
                     .sum(-1), "that is what the keys get: the sink's share is the rest"),
                    (lambda s, k: torch.sigmoid(k),
                     "the sink's logit competes with the scores: it enters their softmax")])
