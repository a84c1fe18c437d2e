"""Self-attention with grouped-query attention (GQA), written out op by op.

Shape comments give symbols: B batch, T positions, D hidden, H query heads, KV key/value heads,
hd head_dim; S is the number of positions the cache holds after this step's write (S = T at
prefill). A trace of any model gives their numbers.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .errors import LlmTraceError
from .norm import rms_norm
from .rope import apply_rope, rope_cos_sin
from .trace import NO_TRACE


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, KV, S, head_dim] -> [B, KV*n_rep, S, head_dim]: KV head g serves query heads
    g*n_rep .. g*n_rep + n_rep-1 (with 32 query heads over 4 KV heads, head 0 serves 0-7)."""
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


def window_mask(T: int, S: int, start: int, window: int, device=None) -> torch.Tensor:
    """[T, S] additive mask of a sliding window (Mistral): -inf where key j lies `window` or
    more positions behind query p = start + i, 0 elsewhere. Added to the causal mask, a query
    sees keys p - window < j <= p: itself and the window - 1 before it, as HF's
    `sliding_window_overlay` (kv_idx > q_idx - sliding_window). Positions are absolute, so
    the same rule holds for a decode step reading a cache longer than the window."""
    p = torch.arange(start, start + T, device=device)[:, None]  # [T, 1]
    j = torch.arange(S, device=device)[None, :]  # [1, S]
    return torch.zeros(T, S, device=device).masked_fill(j <= p - window, float("-inf"))


@dataclass
class Positions:
    """What every layer of one pass shares: where its T tokens sit, and what follows."""
    start: int  # the position of the pass's first token (the cache holds 0..start-1)
    cos: torch.Tensor  # [T, head_dim]: RoPE tables
    sin: torch.Tensor  # [T, head_dim]
    mask: torch.Tensor  # [T, start + T]: `causal_mask`
    window: torch.Tensor | None = None  # [T, start + T]: `window_mask`, if the config slides
    base: float = 0.0  # the RoPE base, said in the trace when layers differ in it (Gemma 3)
    local: "Positions | None" = None  # Gemma 3's sliding layers: their window and RoPE base
    rope: bool = True  # False on a layer without RoPE (SmolLM3's NoPE layers): q, k as projected
    rotary_dim: int | None = None  # RoPE on the first rotary_dim of each head (Qwen3-Next)
    # what the layers of one pass hand each other (Gemma 4: "ple", the per-layer inputs, and
    # layer -> the K, V it read, for the layers that share them); one dict for every kind
    shared: dict = field(default_factory=dict)

    @classmethod
    def of(cls, start: int, T: int, config, device=None) -> "Positions":
        if start + T > config.max_positions:
            raise LlmTraceError(f"{start + T} positions exceed {config.name}'s context "
                                f"of {config.max_positions}: shorten the prompt or "
                                f"generate fewer tokens")
        positions = torch.arange(start, start + T, device=device)  # [T]
        turned = config.rotary_dim  # Qwen3-Next: RoPE on part of each head; None: all
        if config.global_head_dim or config.rope_partial != 1.0:  # Gemma 4's full layers
            from .gemma4 import proportional_cos_sin

            cos, sin = proportional_cos_sin(positions, config.global_head_dim or
                                            config.head_dim, config.rope_theta,
                                            config.rope_partial)  # [T, hd_full] each
        else:
            cos, sin = rope_cos_sin(positions, turned or config.head_dim, config.rope_theta,
                                    config.rope_scaling)  # [T, hd] each ([T, turned])
        S, W = start + T, config.sliding_window
        causal = causal_mask(T, S, start, device)
        window = window_mask(T, S, start, W, device) if W else None
        if not config.layer_types or "linear" in config.layer_types:  # attention layers alike
            return cls(start, cos, sin, causal, window, rotary_dim=turned)  # (Qwen3-Next: full)
        # Gemma 3, OLMo 3: full layers see every earlier key; sliding layers the window
        local = config.rope_local_theta or config.rope_theta
        local_cos, local_sin = cos, sin  # gpt-oss: both kinds turn by the same (YaRN) RoPE
        if config.rope_local_theta:  # a base of their own, unscaled (Gemma 3)
            local_cos, local_sin = rope_cos_sin(positions, config.head_dim, local)
        base = config.rope_theta if local != config.rope_theta else 0.0  # said if they differ
        shared = {}
        return cls(start, cos, sin, causal, None, base,  # (Qwen3-Next with no linear layer)
                   cls(start, local_cos, local_sin, causal, window, base and local,
                       shared=shared), shared=shared, rotary_dim=turned)


def attend(q, k, v, mask=None, trace=NO_TRACE, name="attn", start=0,
           window=None, scale=0.0, sinks=None):
    """Scaled dot-product attention, step by step. q [..., T, d], k and v [..., S, d],
    mask [T, S]. Each query row scores every key, the mask removes the future, softmax
    turns scores into weights that sum to 1, and the output is the weighted sum of the
    values. window [T, S]: a sliding window's mask, added to the causal one.
    scale: the scores' factor, if not 1/sqrt(d) (Gemma).
    sinks [H]: a learned logit per head, one more key in every row (gpt-oss)."""
    T, S, d = q.shape[-2], k.shape[-2], q.shape[-1]
    lead = math.prod(q.shape[:-2])  # batch x heads
    scores = q @ k.transpose(-2, -1)  # [B, H, T, S]
    if scale:  # Gemma: query_pre_attn_scalar^-0.5
        scores, what = scores * scale, f"q @ k^T * {scale:.6g}"
    else:
        scores, what = scores / math.sqrt(d), f"q @ k^T / sqrt({d})"
    scores = trace.record(f"{name}.scores", what, scores, lead * T * S * d)
    if mask is not None:
        what = f"0 where key <= query position, -inf after ({start} cached)"
        mask = trace.record(f"{name}.causal_mask", what, mask)  # [T, S]
        kind = "causal_mask"
        if window is not None:  # and the keys a window or more behind the query
            kind = "window_mask"
            what = "causal_mask + -inf where key <= query - window"
            mask = trace.record(f"{name}.window_mask", what,
                                mask + window)  # [T, S]
        scores = trace.record(f"{name}.masked_scores", f"scores + {kind}",
                              scores + mask,  # [B, H, T, S]
                              recompute=(torch.add, f"{name}.scores", f"{name}.{kind}"))
    if sinks is not None:  # gpt-oss: the sink column takes its share, then goes
        weights = sink_softmax(scores, sinks, trace, name)  # [B, H, T, S]
    else:
        weights = trace.record(f"{name}.weights", "softmax over keys (rows sum to 1)",
                               F.softmax(scores, dim=-1))  # [B, H, T, S]
    return trace.record(f"{name}.weighted_sum", "weights @ v",
                        weights @ v, lead * T * S * v.shape[-1])  # [B, H, T, dv]


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


def attention(x, w, config, pos: Positions, cache=None, trace=NO_TRACE, name="attn",
              output_gate=False):
    """x [B, T, D] -> [B, T, D]. pos: this pass's positions (`Positions`); cache: this
    layer's `KVCache`, or None to attend over this pass's own positions only.
    output_gate: W_q gives each head its query and a gate (Qwen3-Next)."""
    B, T, D = x.shape
    H, KV, hd = config.n_heads, config.n_kv_heads, config.head_dim

    # Projections: Q for every query head, K and V for the (fewer) KV heads.
    if output_gate:  # Qwen3-Next: each head's 2*hd rows of W_q: its query, its gate
        qg = trace.record(f"{name}.q_proj", "x @ W_q^T: per head, query then gate",
                          F.linear(x, w.q_proj), B * T * D * 2 * H * hd)  # [B,T,2H*hd]
        qg = qg.view(B, T, H, 2 * hd)  # [B, T, H, 2*hd]
        gate = trace.record(f"{name}.gate", "second half of each head's q_proj",
                            qg[..., hd:])  # [B, T, H, hd]
        q = qg[..., :hd].reshape(B, T, H * hd)  # [B, T, H*hd]
    else:
        q = trace.record(f"{name}.q_proj", "x @ W_q^T", F.linear(x, w.q_proj),
                         B * T * D * H * hd)  # [B, T, H*hd]
    k = trace.record(f"{name}.k_proj", "x @ W_k^T", F.linear(x, w.k_proj),
                     B * T * D * KV * hd)  # [B, T, KV*hd]
    v = trace.record(f"{name}.v_proj", "x @ W_v^T", F.linear(x, w.v_proj),
                     B * T * D * KV * hd)  # [B, T, KV*hd]
    if config.qk_proj_norm:  # OLMo 2: q and k to RMS 1 over all heads at once
        q = rms_norm(q, w.q_norm, config.norm_eps, trace,
                     f"{name}.q_norm")  # [B, T, H*hd]
        k = rms_norm(k, w.k_norm, config.norm_eps, trace,
                     f"{name}.k_norm")  # [B, T, KV*hd]
    if config.qkv_bias:  # Qwen2: each projection's bias, a record of its own
        q = trace.record(f"{name}.q_bias", "q_proj + b_q",
                         q + w.q_bias)  # [B, T, H*hd]
        k = trace.record(f"{name}.k_bias", "k_proj + b_k",
                         k + w.k_bias)  # [B, T, KV*hd]
        v = trace.record(f"{name}.v_bias", "v_proj + b_v",
                         v + w.v_bias)  # [B, T, KV*hd]
    q = trace.record(f"{name}.q", f"split into {H} heads",
                     q.view(B, T, H, hd))  # [B, T, H, hd]
    k = trace.record(f"{name}.k", f"split into {KV} heads",
                     k.view(B, T, KV, hd))  # [B, T, KV, hd]
    v = trace.record(f"{name}.v", f"split into {KV} heads",
                     v.view(B, T, KV, hd))  # [B, T, KV, hd]

    if config.qk_norm:  # Qwen3: each head of q, k to RMS 1, times a weight [hd]
        q = rms_norm(q, w.q_norm, config.norm_eps, trace,
                     f"{name}.q_norm", config.norm_offset)  # [B, T, H, hd]
        k = rms_norm(k, w.k_norm, config.norm_eps, trace,
                     f"{name}.k_norm", config.norm_offset)  # [B, T, KV, hd]

    # Position enters here, and only into Q and K: V carries content.
    freq = f"{config.rope_type}-scaled freq" if config.rope_scaling else "freq"
    if pos.base:  # Gemma 3: local and global layers turn at different bases
        freq += f" (base {pos.base:g})"
    if pos.rope:
        q = apply_rope(q, pos.cos, pos.sin, trace,
                       f"{name}.rope_q", freq, pos.rotary_dim)  # [B, T, H, hd]
        k = apply_rope(k, pos.cos, pos.sin, trace,
                       f"{name}.rope_k", freq, pos.rotary_dim)  # [B, T, KV, hd]
    else:  # SmolLM3's NoPE layers: the same records, q and k unturned
        q = trace.record(f"{name}.rope_q", "no RoPE on this layer: q unturned",
                         q)  # [B, T, H, hd]
        k = trace.record(f"{name}.rope_k", "no RoPE on this layer: k unturned",
                         k)  # [B, T, KV, hd]

    # Write this step's K and V into the cache, read back every position so far.
    start = pos.start
    if cache is not None:
        k_all, v_all = cache.update(start, k, v)  # [B, S, KV, hd]
        where = f"write {start}:{start + T}, read 0:{start + T}"
    elif start == 0:  # no cache: this pass computed every position itself
        k_all, v_all, where = k, v, f"no cache: this pass's {T} positions"
    else:
        raise LlmTraceError(f"a pass starting at position {start} reads the earlier "
                            f"ones from a KV cache: pass one, model.new_cache(...)")
    # what this pass reads flows on (a patch here changes the read, not the cache)
    k_all = trace.record(f"{name}.kv_cache.k", f"K cache: {where}", k_all)
    v_all = trace.record(f"{name}.kv_cache.v", f"V cache: {where}", v_all)

    # Heads first, then GQA: repeat each KV head for the query heads that share it.
    q = q.transpose(1, 2)  # [B, H, T, hd]

    def expand(kv):  # [B, S, KV, hd] -> [B, H, S, hd]; rerun when its record is read
        return repeat_kv(kv.transpose(1, 2), config.n_rep)

    k_exp = trace.record(f"{name}.k_expanded", f"GQA: {KV} -> {H} heads", expand(k_all),
                         recompute=(expand, f"{name}.kv_cache.k"))  # [B, H, S, hd]
    v_exp = trace.record(f"{name}.v_expanded", f"GQA: {KV} -> {H} heads", expand(v_all),
                         recompute=(expand, f"{name}.kv_cache.v"))  # [B, H, S, hd]

    out = attend(q, k_exp, v_exp, pos.mask, trace, name, start, pos.window,
                 config.attn_scale, w.sinks)  # [B, H, T, hd]

    heads = f"{name}.weighted_sum"  # what the merge reads
    if output_gate:  # Qwen3-Next: each head's output times the sigmoid of its gate
        out = trace.record(f"{name}.output_gate", "weighted_sum * sigmoid(gate)",
                           out * torch.sigmoid(gate).transpose(1, 2))  # [B, H, T, hd]
        heads = f"{name}.output_gate"

    def merge(o):  # [B, H, T, hd] -> [B, T, H*hd]
        return o.transpose(1, 2).reshape(B, T, H * hd)

    out = trace.record(f"{name}.merged", "heads back side by side", merge(out),
                       recompute=(merge, heads))  # [B, T, H*hd]
    out = F.linear(out, w.o_proj, w.o_bias)  # [B, T, D]
    return trace.record(f"{name}.out", "merged @ W_o^T", out, B * T * H * hd * D)
