"""Chapter 16: a sliding window's mask; the gated delta rule's step (Qwen3-Next)."""

import dataclasses
import math

import torch

from llmtrace.attention import repeat_kv
from llmtrace.config import Config
from llmtrace.model import Model, weights_from_state_dict
from llmtrace.trace import Trace
from llmtrace.weights.names import expected_shapes

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


def delta_rule_step(S, q, k, v, g, beta):
    """One token through a Gated DeltaNet layer's state (Qwen3-Next), every value head at
    once. S [B, H, dk, dv] the state before; q, k [B, H, dk] (q already scaled by
    1/sqrt(dk)); v [B, H, dv]; g, beta [B, H]. The state first fades by exp(g), then takes
    beta times the error between v and what it recalls for k (S^T k), written along k; the
    output reads the new state with q. Returns (S after, the output [B, H, dv])."""
    S = g.exp()[..., None, None] * S  # fade
    error = v - torch.einsum("bhkv,bhk->bhv", S, k)  # v minus what S recalls for k
    S = S + beta[..., None, None] * k[..., :, None] * error[..., None, :]  # + beta k error^T
    return S, torch.einsum("bhkv,bhk->bhv", S, q)  # read with q: S^T q


def tiny_qwen3_next(seed: int = 0) -> Model:
    """A Qwen3-Next of 4 layers (3 Gated DeltaNet, 1 full) with seeded random weights, made by
    the library from a Config: what `delta_rule_step` is checked on when the running model has
    no DeltaNet layer."""
    c = Config("tiny-qwen3-next", vocab_size=64, hidden_size=32, n_layers=4, n_heads=2,
               n_kv_heads=1, ffn_size=48, max_positions=64, head_dim=16, family="qwen3_next",
               qk_norm=True, norm_offset=True, attn_output_gate=True,
               partial_rotary_factor=0.25, linear_attn=(1, 2, 8, 12, 4),
               layer_types=("linear", "linear", "linear", "full"))
    g = torch.Generator().manual_seed(seed)
    sd = {n: torch.randn(s, generator=g) * 0.3 for n, s in expected_shapes(c).items()}
    return Model(c, weights_from_state_dict(c, sd, "random"))


@exercise(16, delta_rule_step)
def _(model) -> Case:
    """The running model's first DeltaNet layer (a tiny Qwen3-Next's when it has none), a
    decode step after the prompt: the state its prefill recorded (`attn.state`), the step's q,
    k, v, g and beta records, and what the step recorded after: its state and its output."""
    if not model.config.linear_attn:
        model = tiny_qwen3_next()
    c = model.config
    d, layer = c.deltanet_dims, c.layer_types.index("linear")
    ids = torch.randint(0, c.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    name = f"layers.{layer}.attn"
    keep = [f"{name}.{r}" for r in ("state", "q", "k", "v", "g", "beta", "core")]
    cache, prefill, step = model.new_cache(7), Trace(names=keep), Trace(names=keep)
    model.forward(ids, prefill, cache)
    model.forward(ids[:, -1:], step, cache, start=6)
    r = d.n_v_heads // d.n_k_heads  # value heads per key head

    def heads(t):  # [B, 1, Hk, dk] -> [B, Hv, dk]: each key head serves r value heads
        return repeat_kv(t.transpose(1, 2), r)[:, :, 0]

    S = prefill[f"{name}.state"]  # [B, Hv, dk, dv]
    q = heads(step[f"{name}.q"]) / math.sqrt(d.k_head_dim)
    k, v = heads(step[f"{name}.k"]), step[f"{name}.v"][:, 0]
    g, beta = step[f"{name}.g"][:, 0], step[f"{name}.beta"][:, 0]  # [B, Hv]
    want = (step[f"{name}.state"], step[f"{name}.core"][:, 0])

    def no_fade(S, q, k, v, g, beta):
        return delta_rule_step(S, q, k, v, torch.zeros_like(g), beta)

    def read_first(S, q, k, v, g, beta):  # the output read from the faded state, unwritten
        return delta_rule_step(S, q, k, v, g, beta)[0], torch.einsum(
            "bhkv,bhk->bhv", g.exp()[..., None, None] * S, q)

    def plain_write(S, q, k, v, g, beta):  # linear attention's S + k v^T: no error term
        S = g.exp()[..., None, None] * S + beta[..., None, None] * k[..., :, None] \
            * v[..., None, :]
        return S, torch.einsum("bhkv,bhk->bhv", S, q)

    def no_beta(S, q, k, v, g, beta):
        return delta_rule_step(S, q, k, v, g, torch.ones_like(beta))

    return Case(caller(S, q, k, v, g, beta), want,
                f"state {shape(want[0])}, output {shape(want[1])}",
                tuple_compare(("state after", "output"), 1e-5), [
                    (no_fade, "the state fades first: multiply S by exp(g) before reading it"),
                    (read_first, "the output reads the state after this token's write"),
                    (plain_write, "the delta rule writes the error v - S^T k (after the "
                                  "fade), not v itself"),
                    (no_beta, "the write is scaled by beta, how much the token takes")])
