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


def rebuild_kv(latent: torch.Tensor, kv_b: torch.Tensor, n_heads: int,
               nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent attention's keys and values from its cache (DeepSeek-V3). latent [B, S, R], the
    cached latents; kv_b [H * (dn + dv), R], kv_b_proj's weight, whose rows are head 0's
    dn key rows and dv value rows, then head 1's... -> (k_nope [B, S, H, dn], v [B, S, H, dv]):
    every head's key part without RoPE, and its value."""
    B, S, _ = latent.shape
    kv = (latent @ kv_b.T).view(B, S, n_heads, -1)  # [B, S, H, dn + dv]
    return kv[..., :nope_dim], kv[..., nope_dim:]


@exercise(16, rebuild_kv)
def _(model) -> Case:
    """The running model's layer-0 input (its normed stream for the prompt) through a latent
    attention layer of random weights of the running model's width, built from the library's
    pieces (mla.py): the cached latents it records, its kv_b_proj weight, and the keys and
    values it rebuilt from them."""
    from llmtrace.attention import Positions
    from llmtrace.mla import MlaDims, MlaWeights, mla_attention

    D = model.config.hidden_size
    H, R, dn, dr, dv = 4, 16, 8, 4, 6
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    w = MlaWeights(kv_a=rand(R + dr, D), kv_a_norm=torch.ones(R), kv_b=rand(H * (dn + dv), R),
                   o_proj=rand(D, H * dv), q_proj=rand(H * (dn + dr), D))
    d = MlaDims(H, R, dn, dr, dv)
    _, trace = model.run(model.encode(PROMPT), names=["layers.0.attn_norm"])
    x = trace["layers.0.attn_norm"]  # [1, T, D]
    T = x.shape[1]
    pos = Positions.of(0, T, model.config.replace(head_dim=dr), x.device)
    records = Trace(names=["attn.kv_cache.latent", "attn.k", "attn.v"])
    mla_attention(x, w, d, pos, trace=records)
    latent = records["attn.kv_cache.latent"]  # [1, T, R]
    want = (records["attn.k"][..., :dn], records["attn.v"])  # [1, T, H, dn], [1, T, H, dv]

    def keys_first(latent, kv_b, n_heads, nope_dim):  # all keys' rows, then all values'
        B, S, _ = latent.shape
        kv = latent @ kv_b.T  # [B, S, H*(dn+dv)]
        k = kv[..., :n_heads * nope_dim].reshape(B, S, n_heads, nope_dim)
        return k, kv[..., n_heads * nope_dim:].reshape(B, S, n_heads, -1)

    return Case(caller(latent, w.kv_b, H, dn), want,
                f"k_nope {shape(want[0])} and v {shape(want[1])}",
                tuple_compare(("k_nope", "v"), 1e-5), [
                    (keys_first, "kv_b_proj's rows go head by head: head 0's dn key rows and "
                                 "dv value rows, then head 1's; view as [B, S, H, dn + dv] "
                                 "before splitting"),
                    (lambda lat, kv_b, H, dn: tuple(reversed(rebuild_kv(lat, kv_b, H, dn))),
                     "each head's first nope_dim numbers are its key part, the rest its "
                     "value")])
