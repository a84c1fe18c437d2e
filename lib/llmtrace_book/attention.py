"""Self-attention with grouped-query attention (GQA), Llama's, written out op by op.

`Attention` is one layer's part: it reads its weights (`w.q_proj`, `w.k_proj`, `w.v_proj`,
`w.o_proj`, named in `tensors`), keeps K and V between steps in a `KVCache`, and records each op
under the layer's name. Its call runs five steps, each a method, so that a family that changes
one step (a bias on the projections, a norm on each head, a window on the mask) subclasses that
step alone.

Shape comments give symbols: B batch, T positions, D hidden, H query heads, KV key/value heads,
hd head_dim; S is the number of positions the cache holds after this step's write (S = T at
prefill). A trace of any model gives their numbers.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .errors import LlmTraceError
from .kv_cache import KVCache
from .parts import Part
from .rope import apply_rope, rope_cos_sin
from .trace import NO_TRACE


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, KV, S, head_dim] -> [B, KV*n_rep, S, head_dim]: KV head g serves query heads
    g*n_rep .. g*n_rep + n_rep-1 (with 32 query heads over 8 KV heads, head 0 serves 0-3)."""
    B, KV, S, hd = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None].expand(B, KV, n_rep, S, hd).reshape(B, KV * n_rep, S, hd)


def causal_mask(T: int, S: int, start: int, device=None) -> torch.Tensor:
    """[T, S] additive mask: 0 where query i (at position start+i) may see key j, -inf
    elsewhere. Once the cache holds `start` earlier positions, every query sees all of
    them: the mask is a block of zeros [T, start] beside the usual triangle. A single
    decode query sees everything."""
    blocked = torch.ones(T, S, dtype=torch.bool, device=device).triu(diagonal=start + 1)
    return torch.zeros(T, S, device=device).masked_fill(blocked, float("-inf"))


@dataclass
class Positions:
    """What every layer of one pass shares: where its T tokens sit, RoPE's tables for them,
    and the causal mask."""
    start: int  # the position of the pass's first token (the cache holds 0..start-1)
    cos: torch.Tensor  # [T, head_dim]: RoPE tables
    sin: torch.Tensor  # [T, head_dim]
    mask: torch.Tensor  # [T, start + T]: `causal_mask`
    # what other kinds of layer share in one pass (a window's mask, tables of another RoPE
    # base, the K and V one layer hands another), by name; a Llama has none
    more: dict = field(default_factory=dict)

    @classmethod
    def of(cls, start: int, T: int, config, device=None, rope=rope_cos_sin) -> "Positions":
        if start + T > config.max_positions:
            raise LlmTraceError(f"{start + T} positions exceed {config.name}'s context "
                                f"of {config.max_positions}: shorten the prompt or "
                                f"generate fewer tokens")
        positions = torch.arange(start, start + T, device=device)  # [T]
        cos, sin = rope(positions, config.head_dim, config.rope_theta,
                        config.rope_scaling)  # [T, hd] each: `rope.rope_cos_sin`
        return cls(start, cos, sin, causal_mask(T, start + T, start, device))

    def to(self, dtype: torch.dtype, _done: dict | None = None) -> "Positions":
        """The tables and masks in the weights' dtype: computed in fp32, then rounded, as HF
        does (a bf16 or fp16 model). In fp32, itself. What `more` holds is cast too (a kind's
        own tables may be these very ones, or share their `more`: each is cast once)."""
        if self.cos.dtype == dtype:
            return self
        done = {} if _done is None else _done
        if id(self) in done:
            return done[id(self)]
        out = done[id(self)] = Positions(self.start, self.cos.to(dtype), self.sin.to(dtype),
                                         self.mask.to(dtype))
        more = done.setdefault(id(self.more), {})
        out.more = more
        for k, v in self.more.items():
            if k not in more:
                more[k] = (v.to(dtype, done) if isinstance(v, Positions) else
                           v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                           else v)
        return out


class Attention(Part):
    """One layer's grouped-query attention: x [B, T, D] -> [B, T, D]. Each step takes what any
    version of it may read (the layer's index, its weights `w`), though Llama's need less."""

    def __init__(self, config, layer: int = 0):
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        self.head_dim, self.hidden = config.head_dim, config.hidden_size
        # Llama 3 stretches RoPE's frequencies for long contexts (`rope.llama3_scaled`)
        self.freq = f"{config.rope_type}-scaled freq" if config.rope_scaling else "freq"

    def tensors(self):
        """Its weights: field -> (Hugging Face name after "model.layers.N.", shape)."""
        H, KV, hd, D = self.n_heads, self.n_kv_heads, self.head_dim, self.hidden
        return {"q_proj": ("self_attn.q_proj.weight", (H * hd, D)),
                "k_proj": ("self_attn.k_proj.weight", (KV * hd, D)),
                "v_proj": ("self_attn.v_proj.weight", (KV * hd, D)),
                "o_proj": ("self_attn.o_proj.weight", (D, H * hd))}

    def new_state(self, max_len: int, batch: int = 1, device="cpu",
                  dtype=torch.float32) -> KVCache:
        """What the layer keeps between steps: K and V of every position so far."""
        return KVCache(max_len, self.n_kv_heads, self.head_dim, batch, device, dtype)

    def cache_values(self, context: int, capped: bool = True) -> int:
        """The numbers that state holds after `context` positions: K and V of each KV head.
        (capped: only the keys a query can still see, for a layer that sees fewer.)"""
        return context * 2 * self.n_kv_heads * self.head_dim

    def __call__(self, x, w, pos: Positions, cache=None, trace=NO_TRACE, name="attn"):
        """x [B, T, D] -> [B, T, D]. w: the layer's weights; pos: this pass's positions;
        cache: this layer's `KVCache`, or None to attend over this pass's positions only."""
        q, k, v = self.qkv(x, w, trace, name)  # [B, T, H*hd], [B, T, KV*hd] x 2
        q, k, v = self.heads(q, k, v, w, trace, name)  # [B, T, H | KV, hd]
        q, k = self.rotate(q, k, pos, trace, name)  # [B, T, H | KV, hd]
        k, v = self.read_cache(k, v, pos.start, cache, trace, name)  # [B, S, KV, hd]
        out = self.attend(q, k, v, w, pos, trace, name)  # [B, H, T, hd]
        return self.output(out, w, trace, name)  # [B, T, D]

    def qkv(self, x, w, trace, name):
        """Projections: Q for every query head, K and V for the (fewer) KV heads."""
        B, T, D = x.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = trace.record(f"{name}.q_proj", "x @ W_q^T", F.linear(x, w.q_proj),
                         B * T * D * H * hd)  # [B, T, H*hd]
        k = trace.record(f"{name}.k_proj", "x @ W_k^T", F.linear(x, w.k_proj),
                         B * T * D * KV * hd)  # [B, T, KV*hd]
        v = trace.record(f"{name}.v_proj", "x @ W_v^T", F.linear(x, w.v_proj),
                         B * T * D * KV * hd)  # [B, T, KV*hd]
        return q, k, v

    def heads(self, q, k, v, w, trace, name):
        """Each projection split into its heads of hd numbers."""
        B, T, _ = q.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        q = trace.record(f"{name}.q", f"split into {H} heads",
                         q.view(B, T, H, hd))  # [B, T, H, hd]
        k = trace.record(f"{name}.k", f"split into {KV} heads",
                         k.view(B, T, KV, hd))  # [B, T, KV, hd]
        v = trace.record(f"{name}.v", f"split into {KV} heads",
                         v.view(B, T, KV, hd))  # [B, T, KV, hd]
        return q, k, v

    def rotate(self, q, k, pos: Positions, trace, name):
        """Position enters here, and only into Q and K: V carries content."""
        q = apply_rope(q, pos.cos, pos.sin, trace,
                       f"{name}.rope_q", self.freq)  # [B, T, H, hd]
        k = apply_rope(k, pos.cos, pos.sin, trace,
                       f"{name}.rope_k", self.freq)  # [B, T, KV, hd]
        return q, k

    def read_cache(self, k, v, start: int, cache, trace, name):
        """Write this step's K and V into the cache, read back every position so far."""
        T = k.shape[1]
        if cache is not None:
            k, v = cache.update(start, k, v)  # [B, S, KV, hd] each
            where = f"write {start}:{start + T}, read 0:{start + T}"
        elif start == 0:  # no cache: this pass computed every position itself
            where = f"no cache: this pass's {T} positions"
        else:
            raise LlmTraceError(f"a pass starting at position {start} reads the earlier "
                                f"ones from a KV cache: pass one, model.new_cache(...)")
        # what this pass reads flows on (a patch here changes the read, not the cache)
        k = trace.record(f"{name}.kv_cache.k", f"K cache: {where}", k)
        v = trace.record(f"{name}.kv_cache.v", f"V cache: {where}", v)
        return k, v

    def attend(self, q, k, v, w, pos: Positions, trace, name):
        """Heads first, then GQA: each KV head repeated for the query heads that share it,
        then each query head's weighted sum of the values (`mix`)."""
        H, KV = q.shape[2], k.shape[2]
        q = q.transpose(1, 2)  # [B, H, T, hd]

        def expand(kv):  # [B, S, KV, hd] -> [B, H, S, hd]; rerun when its record is read
            return repeat_kv(kv.transpose(1, 2), H // KV)

        k = trace.record(f"{name}.k_expanded", f"GQA: {KV} -> {H} heads", expand(k),
                         recompute=(expand, f"{name}.kv_cache.k"))  # [B, H, S, hd]
        v = trace.record(f"{name}.v_expanded", f"GQA: {KV} -> {H} heads", expand(v),
                         recompute=(expand, f"{name}.kv_cache.v"))  # [B, H, S, hd]
        return self.mix(q, k, v, w, pos, trace, name)  # [B, H, T, hd]

    def mix(self, q, k, v, w, pos: Positions, trace, name):
        """Scaled dot-product attention, step by step. q [B, H, T, d], k and v [B, H, S, d]:
        each query row scores every key, the mask removes the future, softmax turns the
        scores into weights that sum to 1, and the output is the weighted sum of the values."""
        scores = self.scores(q, k, trace, name)  # [B, H, T, S]
        scores = self.masked(scores, pos, trace, name)  # [B, H, T, S]
        weights = self.softmax(scores, w, trace, name)  # [B, H, T, S]
        T, S = weights.shape[-2:]
        return trace.record(f"{name}.weighted_sum", "weights @ v", weights @ v,
                            math.prod(q.shape[:-2]) * T * S * v.shape[-1])  # [B, H, T, d]

    def scores(self, q, k, trace, name):
        (T, d), S = q.shape[-2:], k.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(d)  # [B, H, T, S]
        return trace.record(f"{name}.scores", f"q @ k^T / sqrt({d})", scores,
                            math.prod(q.shape[:-2]) * T * S * d)

    def masked(self, scores, pos: Positions, trace, name):
        what = f"0 where key <= query position, -inf after ({pos.start} cached)"
        mask = trace.record(f"{name}.causal_mask", what, pos.mask)  # [T, S]
        return trace.record(f"{name}.masked_scores", "scores + causal_mask",
                            scores + mask,  # [B, H, T, S]
                            recompute=(torch.add, f"{name}.scores", f"{name}.causal_mask"))

    def softmax(self, scores, w, trace, name):
        return trace.record(f"{name}.weights", "softmax over keys (rows sum to 1)",
                            F.softmax(scores, dim=-1))  # [B, H, T, S]

    def output(self, out, w, trace, name):
        """The heads back side by side, projected into the stream."""
        B, H, T, hd = out.shape

        def merge(o):  # [B, H, T, hd] -> [B, T, H*hd]
            return o.transpose(1, 2).reshape(B, T, H * hd)

        out = trace.record(f"{name}.merged", "heads back side by side", merge(out),
                           recompute=(merge, f"{name}.weighted_sum"))  # [B, T, H*hd]
        D = w.o_proj.shape[0]
        return trace.record(f"{name}.out", "merged @ W_o^T", self.out_proj(out, w),
                            B * T * H * hd * D)  # [B, T, D]

    def out_proj(self, merged, w):
        return F.linear(merged, w.o_proj)  # [B, T, D]
