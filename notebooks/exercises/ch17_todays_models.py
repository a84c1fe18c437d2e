"""Chapter 17: a sliding window's mask; a mixture of experts' router; the share of attention
a sink takes; the gated delta rule's step (Qwen3-Next)."""

import dataclasses
import math

import torch

from llmtrace_book.attention import repeat_kv
from llmtrace_book.config import Config
from llmtrace_book.attention import Attention
from llmtrace_book.mechanisms import part
from llmtrace_book.mechanisms.attention_steps import Sinks, Unturned, Windowed
from llmtrace_book.mechanisms.moe import MoE, MoeWeights
from llmtrace_book.model import Model, Weights, weights_from_state_dict
from llmtrace_book.trace import Trace
from llmtrace_book.weights.names import expected_shapes

from .registry import PROMPT, Case, caller, exercise
from .verdicts import shape, tensor_compare, tuple_compare

WINDOW = 3  # the window the mask is checked with: shorter than any prompt here


def with_parts(model: Model, config: Config, weights: Weights, step=None, layers=None,
               mlp=None) -> Model:
    """A model of the running model's family (its class: its norms, embedding, positions and
    parts) on `config` and `weights`, given what that family's HF class may not compute, as a
    family's module adds it: `step`, one step of `mechanisms.attention_steps` (a window,
    sinks, no RoPE), mixed into the attention of `layers` (None: every layer) by `part`, where
    the family's own attention lacks it; `mlp`, a part class (`MoE`) in place of every MLP."""
    family = type(model)

    class Given(family):
        def attention(self, i):
            attn = super().attention(i)
            if step is None or isinstance(attn, step) or not isinstance(attn, Attention) \
                    or layers is not None and i not in layers:
                return attn
            return part(step, type(attn))(self.config, i)

        def mlp(self, i):
            return super().mlp(i) if mlp is None else mlp(self.config, i)

    return Given(config, weights, model.tokenizer)


def sliding_window_mask(T: int, start: int, window: int) -> torch.Tensor:
    """A sliding-window layer's mask (Mistral, Gemma 3's local layers). T queries at positions
    start .. start+T-1, over the start+T keys the cache holds, window W -> [T, start+T] float:
    0 where query p may see key j, the causal rule and the window's, p - W < j <= p (itself
    and the W - 1 keys before it); float('-inf') elsewhere."""
    p = torch.arange(start, start + T)[:, None]  # [T, 1]: absolute positions
    j = torch.arange(start + T)[None, :]  # [1, S]
    blocked = (j > p) | (j <= p - window)  # the future, and keys W or more behind
    return torch.zeros(T, start + T).masked_fill(blocked, float("-inf"))  # [T, S]


@exercise(17, sliding_window_mask)
def _(model) -> Case:
    """The masks the running model's layer 0 records when its config is given a window: the
    prefill of the prompt, then one decode step reading the cache. A family whose attention
    has no window (Llama's) is given Mistral's step, `Windowed`."""
    c = model.config
    every = {"layer_types": ()} if c.layer_types else {}  # every layer slides
    first = dataclasses.replace(model.weights, layers=model.weights.layers[:1])  # layer 0 alone
    one = c.replace(sliding_window=WINDOW, n_layers=1, no_rope_layers=(), **every)
    windowed = with_parts(model, one, first, step=Windowed)
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


EXPERTS, CHOSEN = 4, 2  # the running model's MLP cut into 4 experts, 2 chosen per position


def choose_experts(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's router. The router's logits [B, T, E] (x @ W_router^T, one per expert) and k
    -> (ids [B, T, k] int64, weights [B, T, k]): a softmax over the E experts, the k largest
    probabilities (largest first) and their experts' ids, those k weights divided by their
    sum, so that they sum to 1."""
    probs = torch.softmax(logits, dim=-1)  # [B, T, E]
    weights, ids = torch.topk(probs, k, dim=-1)  # [B, T, k] each, largest first
    return ids, weights / weights.sum(dim=-1, keepdim=True)  # [B, T, k] each


def moe_of_layer_0(model) -> Model:
    """The running model's layer 0 with its MLP cut into EXPERTS experts (expert e: the e-th
    quarter of the gate and up rows, and of down's columns) and a router whose row e is the
    mean of expert e's gate rows: a mixture of experts built from the library's pieces
    (`mechanisms.moe.MoE` in the MLP's place), run as Mixtral runs it."""
    c, w = model.config, model.weights
    lw = w.layers[0]
    F = c.ffn_size // EXPERTS  # each expert's width; a remainder of rows is left out
    rows = lambda t: t[:EXPERTS * F].reshape(EXPERTS, F, -1)  # noqa: E731  [E, F, D]
    gate, up = rows(lw.gate), rows(lw.up)  # [E, F, D] each
    down = lw.down[:, :EXPERTS * F].reshape(-1, EXPERTS, F).transpose(0, 1)  # [E, D, F]
    moe = MoeWeights(router=gate.mean(dim=1), gate=gate, up=up, down=down)  # router [E, D]
    layer = lw.replace(gate=None, up=None, down=None, moe=moe)
    config = c.replace(n_layers=1, layer_types=c.layer_types[:1], n_experts=EXPERTS,
                       no_rope_layers=c.no_rope_layers[:1],
                       n_experts_active=CHOSEN, moe_ffn_size=F)
    return with_parts(model, config, Weights(w.embed, [layer], w.final_norm, w.lm_head),
                      mlp=MoE)


@exercise(17, choose_experts)
def _(model) -> Case:
    """The router's logits that layer 0 of the running model, made a mixture of experts
    (`moe_of_layer_0`), recorded for the prompt, and the experts and weights it chose."""
    names = [f"layers.0.mlp.{n}" for n in ("router", "experts_chosen", "expert_weights")]
    trace = Trace(names=names)
    moe_of_layer_0(model).forward(model.encode(PROMPT), trace)
    logits = trace[names[0]]  # [1, T, E]
    want = (trace[names[1]], trace[names[2]])  # [1, T, k] each

    def unnormalized(logits, k):
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
        return ids, weights

    def from_logits(logits, k):
        weights, ids = torch.topk(logits, k, dim=-1)
        return ids, weights

    def smallest(logits, k):
        ids, weights = choose_experts(-logits, k)
        return ids, torch.softmax(logits, -1).gather(-1, ids) / (
            torch.softmax(logits, -1).gather(-1, ids).sum(-1, keepdim=True))

    return Case(caller(logits, CHOSEN), want,
                f"{CHOSEN} of {EXPERTS} experts and weights {shape(want[0])}",
                tuple_compare(("ids", "weights"), 1e-5), [
                    (unnormalized, "renormalize: divide the k chosen probabilities by their "
                                   "sum, so that they sum to 1"),
                    (from_logits, "the weights are probabilities: a softmax over the E "
                                  "logits first"),
                    (smallest, "the k largest probabilities: torch.topk keeps the largest")])


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


@exercise(17, layers_without_rope)
def _(model) -> Case:
    """The running model's weights with NoPE layers where a seeded draw puts them: a quarter of
    the layers (one at least), not SmolLM3's every fourth, so that only reading `acts` finds
    them."""
    c = model.config
    g = torch.Generator().manual_seed(3)
    drawn = set(torch.randperm(c.n_layers, generator=g)[:max(1, c.n_layers // 4)].tolist())
    flags = tuple(int(i not in drawn) for i in range(c.n_layers))
    nope = with_parts(model, c.replace(no_rope_layers=flags), model.weights, step=Unturned,
                      layers=[i for i in range(c.n_layers) if not flags[i]])
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
                f"the {len(want)} NoPE layers of {c.n_layers}", compare, [
                    (lambda a, n: [i for i in range(n) if (i + 1) % 4 == 0],
                     "read the layers off acts: here the layers without RoPE are not every "
                     "fourth"),
                    (lambda a, n: [i for i in range(n) if i not in want],
                     "those are the layers RoPE turned: keep the ones it left alone"),
                    (lambda a, n: [i + 1 for i in want],
                     "layers count from 0, as their record names do")])


def rebuild_kv(latent: torch.Tensor, kv_b: torch.Tensor, n_heads: int,
               nope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Latent attention's keys and values from its cache (DeepSeek-V3). latent [B, S, R], the
    cached latents; kv_b [H * (dn + dv), R], kv_b_proj's weight, whose rows are head 0's
    dn key rows and dv value rows, then head 1's... -> (k_nope [B, S, H, dn], v [B, S, H, dv]):
    every head's key part without RoPE, and its value."""
    B, S, _ = latent.shape
    kv = (latent @ kv_b.T).view(B, S, n_heads, -1)  # [B, S, H, dn + dv]
    return kv[..., :nope_dim], kv[..., nope_dim:]


@exercise(17, rebuild_kv)
def _(model) -> Case:
    """The running model's layer-0 input (its normed stream for the prompt) through a latent
    attention layer of random weights of the running model's width, the library's own
    (`mechanisms.mla.LatentAttention`, of a one-layer DeepSeek-V3 config): the cached latents
    it records, its kv_b_proj weight, and the keys and values it rebuilt from them."""
    from llmtrace_book.attention import Positions
    from llmtrace_book.mechanisms.mla import LatentAttention, MlaWeights
    from llmtrace_book.parts import LayerWeights

    D = model.config.hidden_size
    H, R, dn, dr, dv = 4, 16, 8, 4, 6
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    w = MlaWeights(kv_a=rand(R + dr, D), kv_a_norm=torch.ones(R), kv_b=rand(H * (dn + dv), R),
                   o_proj=rand(D, H * dv), q_proj=rand(H * (dn + dr), D))
    _, trace = model.run(model.encode(PROMPT), names=["layers.0.attn_norm"])
    x = trace["layers.0.attn_norm"]  # [1, T, D]
    T = x.shape[1]
    c = Config("latent-attention", vocab_size=model.config.vocab_size, hidden_size=D,
               n_layers=1, n_heads=H, n_kv_heads=H, ffn_size=4 * D,
               max_positions=model.config.max_positions, rope_theta=model.config.rope_theta,
               head_dim=dr, family="deepseek_v3", kv_lora_rank=R, qk_nope_head_dim=dn,
               v_head_dim=dv, rope_interleave=True)  # no q_lora_rank: one q_proj
    pos = Positions.of(0, T, c, x.device)  # RoPE's tables dr wide
    records = Trace(names=["attn.kv_cache.latent", "attn.k", "attn.v"])
    LatentAttention(c)(x, LayerWeights(mla=w), pos, trace=records)
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


def sink_share(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """gpt-oss's attention sinks. Each head h has a learned logit sinks[h] that joins every row
    of its scores as one more column of the softmax; the sink's column is then dropped, so the
    real keys' weights sum below 1. scores [H, S]: the last query's scores over the S keys it
    sees (no key masked), sinks [H] -> [H] float: the share of each head's attention the sink
    takes, 1 minus what the real keys get."""
    both = torch.cat([scores, sinks[:, None]], dim=-1)  # [H, S + 1]: the sink as column S
    return torch.softmax(both, dim=-1)[:, -1]  # [H]


@exercise(17, sink_share)
def _(model) -> Case:
    """The last query's scores at layer 0 of the running model, run alone with every key in
    view, and what its weights leave out. A model without sinks (any but gpt-oss) is given a
    sink logit per head, spread from -2 to 2, so that the exercise runs on every family."""
    c = model.config
    lw = model.weights.layers[0]
    sinks = lw.sinks if lw.sinks is not None else torch.linspace(-2.0, 2.0, c.n_heads)
    one = c.replace(n_layers=1, attn_sinks=True, sliding_window=0,
                    layer_types=("full",) if c.layer_types else (),
                    mlp_types=c.mlp_types[:1],
                    no_rope_layers=c.no_rope_layers[:1])  # layer 0 alone, its window lifted
    layer = lw.replace(sinks=sinks.to(lw.q_proj.dtype))
    first = dataclasses.replace(model.weights, layers=[layer])
    names = ["layers.0.attn.scores", "layers.0.attn.weights"]
    trace = Trace(names=names)
    with_parts(model, one, first, step=Sinks).forward(model.encode(PROMPT), trace)
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


@exercise(17, delta_rule_step)
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


@exercise(17, kv_source_layers)
def _(model) -> Case:
    """Checked on the records of gemma-4-e2b's walk on the meta device (any running model):
    which layer's K each layer's kv_cache.k holds."""
    from llmtrace_book import Config
    from llmtrace_book.model import trace_shapes

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
