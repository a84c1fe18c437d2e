"""Chapter 5: attention's steps on the first layer's tensors; and one layer's attention built
from its weights, which needs RoPE and so closes chapter 6."""

import math

import torch
import torch.nn.functional as F

from llmtrace_book.rope import rope_frequencies

from .ch06_rope import rope_rotate
from .registry import Case, caller, exercise, run, trace_of
from .verdicts import shape, tensor_compare, tuple_compare


def attn_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention scores. q [B, H, T, head_dim], k [B, H, S, head_dim] (after RoPE, one K per query
    head), scale: the scores' factor, 1 / sqrt(head_dim) in Llama -> [B, H, T, S]:
    scores[..., i, j] = q_i · k_j * scale."""
    return q @ k.transpose(-2, -1) * scale  # [B, H, T, S]


def future_mask(T: int) -> torch.Tensor:
    """The causal mask of a prompt of T tokens -> [T, T] float: 0 where query i may see key j
    (j <= i), -inf where key j is in its future (j > i). It is added to the scores."""
    return torch.full((T, T), float("-inf")).triu(diagonal=1)  # [T, T]


def softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the keys, without torch.softmax. scores [B, H, T, S] (masked: -inf in the
    future) -> weights of the same shape, each row (fixed head and query) summing to 1."""
    e = (scores - scores.amax(-1, keepdim=True)).exp()  # the largest is exp(0): no overflow
    return e / e.sum(-1, keepdim=True)  # [B, H, T, S]


def expand_kv_heads(k: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Grouped-query attention's expand. k [B, KV, S, head_dim], n_rep = H / KV ->
    [B, H, S, head_dim]: KV head g serves query heads g*n_rep .. g*n_rep + n_rep - 1."""
    return k.repeat_interleave(n_rep, dim=1)  # [B, KV*n_rep, S, head_dim]


def weighted_sum(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention's output. weights [B, H, T, S], v [B, H, S, head_dim] -> [B, H, T, head_dim]:
    for each query, the values summed with its weights."""
    return weights @ v  # [B, H, T, head_dim]


def attention_from_weights(x, w, config, layer: int) -> torch.Tensor:
    """One layer's attention from its weights. x [B, T, D]: the layer's normalized input
    (`attn_norm`), at positions 0..T-1; w: the layer's weights (`model.weights.layers[layer]`:
    q_proj [H*hd, D], k_proj and v_proj [KV*hd, D], o_proj [D, H*hd]); config: the model's
    Config (n_heads, n_kv_heads, head_dim, rope_theta, rope_scaling); layer: its index
    -> [B, T, D], what the layer's attention adds to the stream (`attn.out`): project, split into
    heads, rotate q and k (RoPE: `llmtrace_book.rope.rope_frequencies` gives the frequencies, Llama
    3's stretch included), repeat each KV head for its query heads, scores scaled by
    1/sqrt(head_dim), the causal mask, softmax, the weighted sum of the values, heads side by
    side, o_proj. Today's families add: biases on q, k, v (w.q_bias...), a norm on each head of
    q and k (config.qk_norm), a sliding window (config.is_sliding(layer)), a score factor of
    their own (config.attn_scale), a RoPE base for the sliding layers (rope_local_theta), layers
    without RoPE (not config.has_rope(layer): SmolLM3)."""
    c, (B, T, D) = config, x.shape
    H, KV, hd = c.n_heads, c.n_kv_heads, c.head_dim
    q = F.linear(x, w.q_proj, w.q_bias).view(B, T, H, hd)  # [B, T, H, hd]; bias: Qwen2
    k = F.linear(x, w.k_proj, w.k_bias).view(B, T, KV, hd)  # [B, T, KV, hd]
    v = F.linear(x, w.v_proj, w.v_bias).view(B, T, KV, hd)  # [B, T, KV, hd]
    if c.qk_norm:  # Qwen3, Gemma 3: each head to RMS 1, times its gain
        gq, gk = (w.q_norm + 1, w.k_norm + 1) if c.norm_offset else (w.q_norm, w.k_norm)
        q = gq * q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + c.norm_eps)
        k = gk * k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + c.norm_eps)
    local = bool(c.layer_types and c.is_sliding(layer) and c.rope_local_theta)  # Gemma 3
    freqs = rope_frequencies(hd, c.rope_local_theta if local else c.rope_theta,
                             scaling=() if local else c.rope_scaling)  # [hd/2]
    angles = torch.arange(T).float()[:, None] * freqs  # [T, hd/2]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    if c.has_rope(layer):  # SmolLM3 leaves every fourth layer's q and k unturned
        q, k = rope_rotate(q, cos, sin), rope_rotate(k, cos, sin)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, hd], [B, KV, T, hd]
    k = k.repeat_interleave(H // KV, dim=1)  # [B, H, T, hd]
    v = v.transpose(1, 2).repeat_interleave(H // KV, dim=1)  # [B, H, T, hd]
    scores = q @ k.transpose(-2, -1) * (c.attn_scale or 1 / math.sqrt(hd))  # [B, H, T, T]
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    blocked = (j > i) | (c.is_sliding(layer) & (j <= i - c.sliding_window))  # [T, T]
    weights = scores.masked_fill(blocked, float("-inf")).softmax(-1)  # [B, H, T, T]
    out = (weights @ v).transpose(1, 2).reshape(B, T, H * hd)  # [B, T, H*hd]
    return F.linear(out, w.o_proj)  # [B, T, D]


def attention_variant(x, w, c, layer, tiled=False, scaled=True, masked=True, adjacent=False,
                      roped=True):
    """attention_from_weights with one typical mistake switched on: the checks' wrong versions."""
    B, T, D = x.shape
    H, KV, hd = c.n_heads, c.n_kv_heads, c.head_dim
    proj = F.linear
    q = proj(x, w.q_proj, w.q_bias).view(B, T, H, hd)
    k = proj(x, w.k_proj, w.k_bias).view(B, T, KV, hd)
    v = proj(x, w.v_proj, w.v_bias).view(B, T, KV, hd)
    if c.qk_norm:
        gq, gk = (w.q_norm + 1, w.k_norm + 1) if c.norm_offset else (w.q_norm, w.k_norm)
        q = gq * q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + c.norm_eps)
        k = gk * k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + c.norm_eps)
    local = bool(c.layer_types and c.is_sliding(layer) and c.rope_local_theta)
    freqs = rope_frequencies(hd, c.rope_local_theta if local else c.rope_theta,
                             scaling=() if local else c.rope_scaling)
    angles = torch.arange(T).float()[:, None] * freqs
    if adjacent:
        angles = angles.repeat_interleave(2, -1)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]

        def rot(t):
            a, b = t[..., 0::2], t[..., 1::2]
            pair = torch.stack([-b, a], -1).flatten(-2)
            return t * cos + pair * sin
    else:
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

        def rot(t):
            return rope_rotate(t, cos, sin)
    if roped:
        q, k = rot(q), rot(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    rep = (lambda t: t.repeat(1, H // KV, 1, 1)) if tiled else \
        (lambda t: t.repeat_interleave(H // KV, dim=1))
    k, v = rep(k), rep(v)
    scores = q @ k.transpose(-2, -1) * ((c.attn_scale or 1 / math.sqrt(hd)) if scaled else 1)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    blocked = (j > i) | (c.is_sliding(layer) & (j <= i - c.sliding_window))
    if masked:
        scores = scores.masked_fill(blocked, float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * hd)
    return F.linear(out, w.o_proj)


def _layer0(trace):
    """Layer 0's attention tensors, heads first: q [B, H, T, hd], k and v expanded."""
    q = trace["layers.0.attn.rope_q"].transpose(1, 2)  # [B, H, T, hd]
    return q, trace["layers.0.attn.k_expanded"], trace["layers.0.attn.v_expanded"]


@exercise(5, attn_scores)
def _(model) -> Case:
    trace, c = trace_of(model), model.config
    q, k, _ = _layer0(trace)
    scale = c.attn_scale or 1 / math.sqrt(c.head_dim)
    want = trace["layers.0.attn.scores"]
    return Case(caller(q, k, scale), want, f"layers.0.attn.scores {shape(want)}",
                tensor_compare(1e-5), [
                    (lambda q, k, s: q @ k.transpose(-2, -1),
                     "multiply by scale: the 1/sqrt(head_dim) factor is missing"),
                    (lambda q, k, s: q @ k.transpose(-2, -1) / s,
                     "scale is the factor itself (1/sqrt(head_dim)): multiply by it, do not "
                     "divide"),
                    (lambda q, k, s: q @ k.transpose(-2, -1) * s * s,
                     "the factor is scale, 1/sqrt(head_dim), not its square 1/head_dim"),
                    (lambda q, k, s: k @ q.transpose(-2, -1) * s,
                     "transposed: row i is query i, column j key j: q @ k^T, not k @ q^T")])


@exercise(5, future_mask)
def _(model) -> Case:
    want = trace_of(model)["layers.0.attn.causal_mask"]
    T = want.shape[0]
    inf, blocked = float("-inf"), torch.isinf(want)
    lowest = torch.finfo(torch.float32).min

    def right_places(got, blocked_ok):
        return (isinstance(got, torch.Tensor) and got.shape == want.shape
                and got.is_floating_point() and bool((got[~blocked] == 0).all())
                and bool(blocked_ok(got[blocked]).all()))

    def accepted(got):  # HF's masks hold finfo.min: after softmax, the same weights
        if right_places(got, lambda b: b <= lowest):
            return "finfo.min where the model holds -inf: softmax gives the same weights"
        return None

    def diagnose(got):
        if isinstance(got, torch.Tensor) and got.shape == want.shape and \
                got.is_floating_point() and bool(got[~blocked].isnan().any()):
            return ("NaN where a key is visible: 0 * -inf is NaN, so ones.triu(1) * "
                    "float('-inf') breaks the allowed places; fill instead: "
                    "torch.full((T, T), float('-inf')).triu(1)")
        if right_places(got, lambda b: b <= -1e4):
            return ("the right places, but a large negative number where the model's mask "
                    "holds float('-inf') (or torch.finfo(dtype).min, as HF's masks do): a "
                    "finite number leaves a little weight on every future key")
        return None
    return Case(caller(T), want, f"layers.0.attn.causal_mask {shape(want)}",
                tensor_compare(1e-6), [
                    (lambda T: torch.full((T, T), inf).triu(0),
                     "a mask off by one: a token sees itself, keep the diagonal at 0 "
                     "(triu(diagonal=1))"),
                    (lambda T: torch.full((T, T), inf).triu(2),
                     "a mask off by one: the next token is visible, block from the diagonal + 1"),
                    (lambda T: torch.full((T, T), inf).tril(-1),
                     "the future is ABOVE the diagonal (key j > query i): you masked the past"),
                    (lambda T: torch.ones(T, T, dtype=torch.bool).triu(1),
                     "the mask is added to the scores: 0 where allowed, float('-inf') where "
                     "blocked, not True/False")], diagnose, accepted)


SHIFT = 100.0  # added to the scores in the softmax check's second call


@exercise(5, softmax)
def _(model) -> Case:
    trace = trace_of(model)
    scores, want = trace["layers.0.attn.masked_scores"], trace["layers.0.attn.weights"]
    # softmax ignores a constant added to a row: the check also hands it the scores + SHIFT,
    # which float32's exp cannot take (exp(89) is already inf), so that only a softmax that
    # never overflows passes
    shifted = scores + SHIFT

    def both(fn):
        return caller(scores)(fn), caller(shifted)(fn)
    return Case(both, (want, torch.softmax(shifted, dim=-1)),
                f"layers.0.attn.weights {shape(want)}, shifted too",
                tuple_compare(("the weights", f"the weights of the scores + {SHIFT:g}"), 1e-5), [
                    (lambda s: s.softmax(-2), "softmax over the wrong axis: over the keys, "
                                              "the LAST axis, so that each row sums to 1"),
                    (lambda s: s.softmax(1), "softmax over the wrong axis (the heads): over the "
                                             "keys, the last axis"),
                    (lambda s: s.exp() / s.exp().sum(-1, keepdim=True),
                     f"exp overflowed: the check's scores are shifted by {SHIFT:g} (softmax "
                     "ignores a shift); subtract each row's max before exp"),
                    (lambda s: s.exp(), "divide by the sum of each row: the weights sum to 1")])


@exercise(5, expand_kv_heads)
def _(model) -> Case:
    trace, c = trace_of(model), model.config
    k = trace["layers.0.attn.rope_k"].transpose(1, 2)  # [B, KV, S, hd]
    want = trace["layers.0.attn.k_expanded"]
    return Case(caller(k, c.n_heads // c.n_kv_heads), want,
                f"layers.0.attn.k_expanded {shape(want)}", tensor_compare(1e-6), [
                    (lambda k, n: k.repeat(1, n, 1, 1),
                     "the heads are tiled (0, 1, 2, 0, 1, 2...): each KV head serves n_rep "
                     "CONSECUTIVE query heads, repeat_interleave(n_rep, dim=1)"),
                    (lambda k, n: k.repeat_interleave(n, dim=2),
                     "repeat along the heads axis (dim 1), not the positions")])


@exercise(5, weighted_sum)
def _(model) -> Case:
    trace = trace_of(model)
    _, _, v = _layer0(trace)
    w, want = trace["layers.0.attn.weights"], trace["layers.0.attn.weighted_sum"]
    return Case(caller(w, v), want, f"layers.0.attn.weighted_sum {shape(want)}",
                tensor_compare(1e-5), [
                    (lambda w, v: w.transpose(-2, -1) @ v,
                     "transposed weights: row i holds query i's weights over the keys: "
                     "weights @ v"),
                    (lambda w, v: (w * w.shape[-1]) @ v,
                     "the weights already sum to 1: no further scale")])


def two_layers(model) -> list[int]:
    """The first and the last layer (Gemma 3's tiny checkpoints: a sliding and a full one)."""
    return sorted({0, model.config.n_layers - 1})


@exercise(6, attention_from_weights)
def _(model) -> Case:
    trace, c = trace_of(model), model.config
    layers = two_layers(model)
    inputs = [(trace[f"layers.{i}.attn_norm"], model.weights.layers[i], c, i) for i in layers]
    want = [trace[f"layers.{i}.attn.out"] for i in layers]

    def call(fn):
        return [run(fn, *args) for args in inputs]

    def variant(**wrong):
        return lambda x, w, c, i: attention_variant(x, w, c, i, **wrong)
    labels = tuple(f"layers.{i}.attn.out" for i in layers)
    return Case(call, want, f"attn.out of layers {' and '.join(map(str, layers))}",
                tuple_compare(labels, 1e-4), [
                    (variant(tiled=True), "each KV head serves n_rep CONSECUTIVE query heads: "
                                          "repeat_interleave(H // KV, dim=1), not repeat"),
                    (variant(scaled=False), "the scores' 1/sqrt(head_dim) is missing"),
                    (variant(masked=False), "the causal mask is missing: a query must not see "
                                            "the keys after it"),
                    (variant(adjacent=True), "RoPE pairs d with d + head_dim/2 here (rotate-"
                                             "half), not adjacent dimensions (2i, 2i+1)"),
                    (variant(roped=False), "RoPE is missing: rotate q and k (not v) before the "
                                           "scores")])
