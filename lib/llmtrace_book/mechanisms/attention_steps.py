"""One step of Llama's attention (`attention.Attention`) changed, the way several families change
it. Each class subclasses `Attention` and overrides the one step it changes, calling the rest
as Llama computes them; a family's attention is Llama's with some of them mixed in
(`families.part`): Qwen3's is `HeadNormed` on Llama's, gpt-oss's `Biased`, `OutBiased` and
`Sinks`, and a `Windowed` one on its sliding layers; Llama 4's `Interleaved`, `L2Normed` and
`Chunked` on its RoPE layers, `Unturned` and `Tempered` on the others.
"""

import torch
import torch.nn.functional as F

from ..attention import Attention, Positions
from ..norm import rms_norm
from ..trace import NO_TRACE
from .gemma4 import unit_rms_norm


class Biased(Attention):
    """Qwen2, gpt-oss: a bias vector added to Q, K and V, each a record of its own."""

    def tensors(self):
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {**super().tensors(), "q_bias": ("self_attn.q_proj.bias", (q,)),
                "k_bias": ("self_attn.k_proj.bias", (kv,)),
                "v_bias": ("self_attn.v_proj.bias", (kv,))}

    def qkv(self, x, w, trace, name):
        q, k, v = super().qkv(x, w, trace, name)  # [B, T, H*hd], [B, T, KV*hd] x 2
        q = trace.record(f"{name}.q_bias", "q_proj + b_q", q + w.q_bias)  # [B, T, H*hd]
        k = trace.record(f"{name}.k_bias", "k_proj + b_k", k + w.k_bias)  # [B, T, KV*hd]
        v = trace.record(f"{name}.v_bias", "v_proj + b_v", v + w.v_bias)  # [B, T, KV*hd]
        return q, k, v


class ProjNormed(Attention):
    """OLMo 2: q and k to RMS 1 over all heads at once (a weight [H*hd], [KV*hd]), before the
    heads are split."""
    norm = staticmethod(rms_norm)  # OLMo rounds after the weight: `gemma.rounded_last_rms_norm`

    def __init__(self, config, layer: int = 0):
        super().__init__(config, layer)
        self.eps = config.norm_eps

    def tensors(self):
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {**super().tensors(), "q_norm": ("self_attn.q_norm.weight", (q,)),
                "k_norm": ("self_attn.k_norm.weight", (kv,))}

    def qkv(self, x, w, trace, name):
        q, k, v = super().qkv(x, w, trace, name)  # [B, T, H*hd], [B, T, KV*hd] x 2
        q = self.norm(q, w.q_norm, self.eps, trace, f"{name}.q_norm")  # [B, T, H*hd]
        k = self.norm(k, w.k_norm, self.eps, trace, f"{name}.k_norm")  # [B, T, KV*hd]
        return q, k, v


class HeadNormed(Attention):
    """Qwen3, Gemma 3: each head of q and k to RMS 1, times a weight [hd], before RoPE."""
    norm = staticmethod(rms_norm)  # `gemma.OffsetNorm` makes it Gemma's (1 + weight)

    def __init__(self, config, layer: int = 0):
        super().__init__(config, layer)
        self.eps = config.norm_eps

    def tensors(self):
        hd = self.head_dim
        return {**super().tensors(), "q_norm": ("self_attn.q_norm.weight", (hd,)),
                "k_norm": ("self_attn.k_norm.weight", (hd,))}

    def heads(self, q, k, v, w, trace, name):
        q, k, v = super().heads(q, k, v, w, trace, name)  # [B, T, H | KV, hd]
        q = self.norm(q, w.q_norm, self.eps, trace, f"{name}.q_norm")  # [B, T, H, hd]
        k = self.norm(k, w.k_norm, self.eps, trace, f"{name}.k_norm")  # [B, T, KV, hd]
        return q, k, v


class Scaled(Attention):
    """Gemma: the scores times `attn_scale` (query_pre_attn_scalar^-0.5), not 1/sqrt(hd)."""

    def __init__(self, config, layer: int = 0):
        super().__init__(config, layer)
        self.scale = config.attn_scale

    def scores(self, q, k, trace, name):
        (T, d), S = q.shape[-2:], k.shape[-2]
        scores = q @ k.transpose(-2, -1) * self.scale  # [B, H, T, S]
        lead = q.shape[:-2].numel()
        return trace.record(f"{name}.scores", f"q @ k^T * {self.scale:.6g}", scores,
                            lead * T * S * d)


def window_mask(T: int, S: int, start: int, window: int, device=None) -> torch.Tensor:
    """[T, S] additive mask of a sliding window (Mistral): -inf where key j lies `window` or
    more positions behind query p = start + i, 0 elsewhere. Added to the causal mask, a query
    sees keys p - window < j <= p: itself and the window - 1 before it, as HF's
    `sliding_window_overlay` (kv_idx > q_idx - sliding_window). Positions are absolute, so
    the same rule holds for a decode step reading a cache longer than the window."""
    p = torch.arange(start, start + T, device=device)[:, None]  # [T, 1]
    j = torch.arange(S, device=device)[None, :]  # [1, S]
    return torch.zeros(T, S, device=device).masked_fill(j <= p - window, float("-inf"))


class Windowed(Attention):
    """Mistral (every layer), Gemma 3, OLMo 3, gpt-oss (their sliding layers): a query sees
    only its last `sliding_window` keys."""

    def __init__(self, config, layer: int = 0):
        super().__init__(config, layer)
        self.window = config.sliding_window

    def cache_values(self, context: int, capped: bool = True) -> int:
        """capped: only the last `sliding_window` positions, what an inference cache keeps."""
        return super().cache_values(min(context, self.window) if capped else context, capped)

    def masked(self, scores, pos: Positions, trace, name):
        what = f"0 where key <= query position, -inf after ({pos.start} cached)"
        mask = trace.record(f"{name}.causal_mask", what, pos.mask)  # [T, S]
        key = ("window", self.window)  # one mask per width, shared by the pass's layers
        if key not in pos.more:
            T, S = pos.mask.shape
            pos.more[key] = window_mask(T, S, pos.start, self.window,
                                        pos.mask.device).to(pos.mask.dtype)
        mask = trace.record(f"{name}.window_mask",
                            "causal_mask + -inf where key <= query - window",
                            mask + pos.more[key])  # [T, S]
        return trace.record(f"{name}.masked_scores", "scores + window_mask",
                            scores + mask,  # [B, H, T, S]
                            recompute=(torch.add, f"{name}.scores", f"{name}.window_mask"))


def sink_softmax(scores, sinks, trace=NO_TRACE, name="attn"):
    """scores [B, H, T, S] (masked), sinks [H] -> weights [B, H, T, S] whose rows
    sum below 1: each head's sink logit joins every query row as one more column,
    the softmax runs over S + 1 columns, and the sink's column is dropped, so the
    attention it drew goes nowhere. As HF's gpt-oss `eager_attention_forward`: the
    mask is added before the sink joins (the sink is never masked); HF subtracts
    each row's max first, which softmax does itself."""
    B, H, T, S = scores.shape
    sink = sinks.to(scores.dtype).reshape(1, H, 1, 1).expand(B, H, T, 1)  # [B,H,T,1]
    what = "masked_scores beside each head's sink logit (column S)"
    both = trace.record(f"{name}.scores_with_sink", what,
                        torch.cat([scores, sink], dim=-1))  # [B, H, T, S+1]
    both = trace.record(f"{name}.weights_with_sink", "softmax over keys and the sink",
                        F.softmax(both, dim=-1))  # [B, H, T, S+1]
    return trace.record(f"{name}.weights", "sink column dropped (rows sum below 1)",
                        both[..., :S])  # [B, H, T, S]


class Sinks(Attention):
    """gpt-oss: a learned logit per head (`w.sinks` [H]), one more key in every row."""

    def tensors(self):
        return {**super().tensors(), "sinks": ("self_attn.sinks", (self.n_heads,))}

    def softmax(self, scores, w, trace, name):
        return sink_softmax(scores, w.sinks, trace, name)  # [B, H, T, S]


class OutBiased(Attention):
    """gpt-oss: a bias on the output projection (`w.o_bias` [D])."""

    def tensors(self):
        return {**super().tensors(), "o_bias": ("self_attn.o_proj.bias", (self.hidden,))}

    def out_proj(self, merged, w):
        return F.linear(merged, w.o_proj, w.o_bias)  # [B, T, D]


class Unturned(Attention):
    """SmolLM3's NoPE layers: no RoPE, q and k as projected; the same records, said so."""

    def rotate(self, q, k, pos: Positions, trace, name):
        q = trace.record(f"{name}.rope_q", "no RoPE on this layer: q unturned",
                         q)  # [B, T, H, hd]
        k = trace.record(f"{name}.rope_k", "no RoPE on this layer: k unturned",
                         k)  # [B, T, KV, hd]
        return q, k


class OwnBase(Attention):
    """Gemma 3, OLMo 3: sliding and full layers turn at RoPE bases of their own; each says
    its base, and a sliding layer turns by its kind's tables (`pos.more["local"]`)."""

    def __init__(self, config, layer: int = 0):
        super().__init__(config, layer)
        self.local = config.layer_types[layer] == "sliding"
        theta = config.rope_local_theta if self.local else config.rope_theta
        self.freq += f" (base {theta:g})"

    def rotate(self, q, k, pos: Positions, trace, name):
        return super().rotate(q, k, pos.more["local"] if self.local else pos, trace, name)


def rope_adjacent(x, cos, sin, trace=NO_TRACE, name: str = "rope", freq: str = "freq"):
    """x [B, T, n, hd] with each adjacent pair (x[2i], x[2i+1]) turned by its angle, as a
    complex number: x[2i] cos - x[2i+1] sin, x[2i+1] cos + x[2i] sin. cos, sin [T, hd] as
    `rope.rope_cos_sin` makes them: their first half holds pair i's angle."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]  # [T, 1, hd/2]: every head alike
    even, odd = x[..., 0::2], x[..., 1::2]  # [B, T, n, hd/2] each
    out = torch.stack([even * c - odd * s, odd * c + even * s], dim=-1)  # [B, T, n, hd/2, 2]
    return trace.record(name, f"rotate adjacent pairs (2i, 2i+1) by position * {freq}",
                        out.flatten(-2))  # [B, T, n, hd]


class Interleaved(Attention):
    """Llama 4: RoPE turns adjacent pairs (2i, 2i+1) of each head, the layout its weights keep
    (HF's `apply_rotary_emb` multiplies them as complex numbers), pair i at the angle of
    Llama's pair (i, i + hd/2)."""

    def rotate(self, q, k, pos: Positions, trace, name):
        q = rope_adjacent(q, pos.cos, pos.sin, trace, f"{name}.rope_q",
                          self.freq)  # [B, T, H, hd]
        k = rope_adjacent(k, pos.cos, pos.sin, trace, f"{name}.rope_k",
                          self.freq)  # [B, T, KV, hd]
        return q, k


class L2Normed(Attention):
    """Llama 4's RoPE layers: each head of q and k, once turned, to RMS 1 with no weight (HF's
    `Llama4TextL2Norm`, at rms_norm_eps)."""

    def __init__(self, config, layer: int = 0):
        super().__init__(config, layer)
        self.eps = config.norm_eps

    def rotate(self, q, k, pos: Positions, trace, name):
        q, k = super().rotate(q, k, pos, trace, name)  # [B, T, H | KV, hd]
        q = unit_rms_norm(q, self.eps, trace, f"{name}.q_l2_norm")  # [B, T, H, hd]
        k = unit_rms_norm(k, self.eps, trace, f"{name}.k_l2_norm")  # [B, T, KV, hd]
        return q, k


class Tempered(Attention):
    """Llama 4's NoPE layers: the query at position p times 1 + scale * log1p(floor((p + 1) /
    floor_scale)), 1 for the first floor_scale - 1 positions, growing slowly after, so that
    far queries attend more sharply (HF's attn_temperature_tuning)."""

    def __init__(self, config, layer: int = 0):
        super().__init__(config, layer)
        self.floor, self.scale = config.attn_temperature

    def rotate(self, q, k, pos: Positions, trace, name):
        q, k = super().rotate(q, k, pos, trace, name)  # [B, T, H | KV, hd]
        p = torch.arange(pos.start, pos.start + q.shape[1], device=pos.mask.device)  # [T]
        t = torch.log1p(torch.floor((p.float() + 1.0) / self.floor)) * self.scale + 1.0
        what = f"1 + {self.scale:g} * log1p(floor((position + 1) / {self.floor})), per position"
        t = trace.record(f"{name}.temperature", what, t[:, None, None])  # [T, 1, 1]
        q = trace.record(f"{name}.q_tempered", "q * temperature",
                         (q * t).to(q.dtype))  # [B, T, H, hd]: fp32 tables, q's dtype
        return q, k


def chunk_mask(T: int, S: int, start: int, chunk: int, device=None) -> torch.Tensor:
    """[T, S] additive mask of chunked attention (Llama 4): -inf where key j lies in another
    block of `chunk` positions than query p = start + i (j // chunk != p // chunk), 0
    elsewhere. Added to the causal mask, a query sees the keys from its chunk's start up to
    itself, as HF's `chunked_overlay`. Positions are absolute: a decode step's query too."""
    p = torch.arange(start, start + T, device=device)[:, None]  # [T, 1]
    j = torch.arange(S, device=device)[None, :]  # [1, S]
    return torch.zeros(T, S, device=device).masked_fill(j // chunk != p // chunk, float("-inf"))


class Chunked(Attention):
    """Llama 4's RoPE layers: a query sees only the keys of its own chunk of `attention_chunk`
    positions (0 .. C-1, C .. 2C-1, ...), itself and those before it there."""

    def __init__(self, config, layer: int = 0):
        super().__init__(config, layer)
        self.chunk = config.attention_chunk

    def cache_values(self, context: int, capped: bool = True) -> int:
        """capped: a chunk's C positions at most, what an inference cache keeps."""
        return super().cache_values(min(context, self.chunk) if capped else context, capped)

    def masked(self, scores, pos: Positions, trace, name):
        what = f"0 where key <= query position, -inf after ({pos.start} cached)"
        mask = trace.record(f"{name}.causal_mask", what, pos.mask)  # [T, S]
        key = ("chunk", self.chunk)  # one mask per width, shared by the pass's layers
        if key not in pos.more:
            T, S = pos.mask.shape
            pos.more[key] = chunk_mask(T, S, pos.start, self.chunk,
                                       pos.mask.device).to(pos.mask.dtype)
        mask = trace.record(f"{name}.chunk_mask",
                            f"causal_mask + -inf where key // {self.chunk} != query // "
                            f"{self.chunk}", mask + pos.more[key])  # [T, S]
        return trace.record(f"{name}.masked_scores", "scores + chunk_mask",
                            scores + mask,  # [B, H, T, S]
                            recompute=(torch.add, f"{name}.scores", f"{name}.chunk_mask"))
