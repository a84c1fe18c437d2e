"""Multi-head latent attention (MLA, DeepSeek-V2 and V3): K and V come out of one small
latent vector per position, and the cache holds that latent instead of K and V.

Each position writes two things:
- a latent of `kv_lora_rank` numbers (`kv_a_proj_with_mqa`, then an RMSNorm), from which
  `kv_b_proj` rebuilds every head's key part without position (k_nope) and its value;
- one rotated key part of `qk_rope_head_dim` numbers, shared by every head: RoPE turns
  it, so it cannot pass through the latent (a rotation by position does not commute
  with kv_b_proj).

A query head is [q_nope | q_rope]; its score against a key is q_nope . k_nope +
q_rope . k_rope, the dot product of the two concatenations. Queries may go through a
latent of their own (`q_lora_rank`: q_a_proj, an RMSNorm, q_b_proj; DeepSeek-V3) or a
single matrix (`q_proj`; V2-Lite).

The cache (`LatentCache`) keeps the latent and the rotated key part: (kv_lora_rank +
qk_rope_head_dim) numbers per position and layer, where grouped-query attention keeps
2 x n_kv_heads x head_dim. Each step reads every cached latent back and rebuilds K and V
from it (the plain form: the arithmetic grows, the cache does not).

Shapes: B batch, T positions of this pass, S positions the cache holds after this step's
write (S = T at prefill), D hidden, H heads, R kv_lora_rank, Rq q_lora_rank,
dn qk_nope_head_dim, dr qk_rope_head_dim, dv v_head_dim.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import Positions
from ..errors import LlmTraceError
from ..norm import rms_norm
from ..rope import apply_rope
from ..trace import NO_TRACE
from .attention_steps import Scaled

# HF builds q_a_layernorm and kv_a_layernorm with this eps, whatever rms_norm_eps says
LATENT_EPS = 1e-6


@dataclass(frozen=True)
class MlaDims:
    """The sizes of one MLA layer, named as HF's DeepseekV3Config names them."""
    n_heads: int  # H
    kv_lora_rank: int  # R: the latent each position caches
    qk_nope_head_dim: int  # dn: the part of each head's query and key without RoPE
    qk_rope_head_dim: int  # dr: the part RoPE turns (one key part for all heads)
    v_head_dim: int  # dv
    q_lora_rank: int | None = None  # Rq: the queries' latent; None: a q_proj (V2-Lite)
    rope_interleave: bool = True  # RoPE turns adjacent pairs (2i, 2i+1): DeepSeek's
    rope_scaling: tuple = ()  # sorted (key, value) pairs; YaRN's mscale_all_dim: scores

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):
            pairs = tuple(sorted(self.rope_scaling.items()))
            object.__setattr__(self, "rope_scaling", pairs)
        for key in ("n_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                    "v_head_dim"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LlmTraceError(f"MLA {key} must be a positive whole number, got "
                                    f"{value!r}: write it in the config")
        if self.qk_rope_head_dim % 2:
            raise LlmTraceError(f"MLA qk_rope_head_dim must be even (RoPE turns "
                                f"pairs), got {self.qk_rope_head_dim}")
        q = self.q_lora_rank
        if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
            raise LlmTraceError(f"MLA q_lora_rank must be a positive whole number or "
                                f"null (one q_proj), got {q!r}")

    @property
    def qk_head_dim(self) -> int:
        """dn + dr: the width each query and key head scores over."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return mla_softmax_scale(self.qk_head_dim, self.rope_scaling)


def mla_softmax_scale(qk_head_dim: int, scaling: tuple = ()) -> float:
    """The factor of the scores: 1/sqrt(dn + dr), times mscale^2 when the RoPE scaling
    names `mscale_all_dim` (DeepSeek's YaRN), mscale = 0.1 * mscale_all_dim * ln(factor)
    + 1, as HF's `yarn_apply_mscale`: the scores grow with the stretch of the context.
    YaRN's own attention factor (on cos and sin, `rope_cos_sin`) is 1 when mscale equals
    mscale_all_dim, as in DeepSeek-V3's config."""
    scale = qk_head_dim ** -0.5
    s = dict(scaling)
    m_all = s.get("mscale_all_dim")
    if s.get("rope_type", "default") != "default" and m_all:
        factor = s["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * m_all * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


@dataclass
class MlaWeights:
    """One layer's MLA weights, in F.linear's (out, in) orientation, named as HF's."""
    kv_a: torch.Tensor  # [R + dr, D]       kv_a_proj_with_mqa
    kv_a_norm: torch.Tensor  # [R]          kv_a_layernorm
    kv_b: torch.Tensor  # [H*(dn + dv), R]  kv_b_proj: head h's rows are [k_nope | v]
    o_proj: torch.Tensor  # [D, H*dv]
    q_proj: torch.Tensor | None = None  # [H*(dn + dr), D]   without q_lora_rank
    q_a: torch.Tensor | None = None  # [Rq, D]               q_a_proj
    q_a_norm: torch.Tensor | None = None  # [Rq]             q_a_layernorm
    q_b: torch.Tensor | None = None  # [H*(dn + dr), Rq]     q_b_proj


class LatentCache:
    """One MLA layer's cache: per position the normed latent [R] and the rotated key
    part [dr], [B, max_len, R] and [B, max_len, dr]. `update` works as KVCache's: the
    caller says where this step's positions go, and gets back every position so far."""

    def __init__(self, max_len: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 batch: int = 1, device="cpu", dtype=torch.float32):
        self.latent = torch.zeros(batch, max_len, kv_lora_rank, device=device,
                                  dtype=dtype)  # [B, max_len, R]
        self.k_rope = torch.zeros(batch, max_len, qk_rope_head_dim, device=device,
                                  dtype=dtype)  # [B, max_len, dr]

    def update(self, input_pos: int, latent: torch.Tensor,
               k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write latent [B, T, R] and k_rope [B, T, dr] at input_pos..input_pos+T-1;
        read back 0..input_pos+T-1."""
        end = input_pos + latent.shape[1]
        if end > self.latent.shape[1]:
            raise LlmTraceError(f"the latent cache holds {self.latent.shape[1]} "
                                f"positions, this step needs {end}: make it with "
                                f"max_len {end} or larger")
        self.latent[:, input_pos:end] = latent
        self.k_rope[:, input_pos:end] = k_rope
        return self.latent[:, :end], self.k_rope[:, :end]  # [B, S, R], [B, S, dr]

    def nbytes(self) -> int:
        """Memory this layer's cache holds at full length (on meta, what it would)."""
        return sum(t.numel() * t.element_size() for t in (self.latent, self.k_rope))


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., dr] -> [..., dr]: dimensions (0, 2, 4, ...) then (1, 3, 5, ...). DeepSeek's
    RoPE turns adjacent pairs (2i, 2i+1); once split so, each pair is (i, i + dr/2), the
    layout `apply_rope` turns (HF's `apply_rotary_pos_emb_interleave` does the same)."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


def mla_queries(x, w: MlaWeights, d: MlaDims, trace=NO_TRACE, name="attn"):
    """x [B, T, D] -> q [B, T, H, dn + dr], through the queries' latent if any."""
    B, T, D = x.shape
    H, dq = d.n_heads, d.qk_head_dim
    if d.q_lora_rank is None:  # V2-Lite: one matrix
        q = trace.record(f"{name}.q_proj", "x @ W_q^T", F.linear(x, w.q_proj),
                         B * T * D * H * dq)  # [B, T, H*(dn+dr)]
    else:  # V3: down to Rq numbers, normed, up to every head
        Rq = d.q_lora_rank
        q_a = trace.record(f"{name}.q_a", "x @ W_q_a^T", F.linear(x, w.q_a),
                           B * T * D * Rq)  # [B, T, Rq]
        q_a = rms_norm(q_a, w.q_a_norm, LATENT_EPS, trace,
                       f"{name}.q_a_norm")  # [B, T, Rq]
        q = trace.record(f"{name}.q_proj", "q_a_norm @ W_q_b^T", F.linear(q_a, w.q_b),
                         B * T * Rq * H * dq)  # [B, T, H*(dn+dr)]
    what = f"split into {H} heads of {d.qk_nope_head_dim} + {d.qk_rope_head_dim}"
    return trace.record(f"{name}.q", what, q.view(B, T, H, dq))  # [B, T, H, dn+dr]


def mla_rope(x, pos: Positions, d: MlaDims):
    """x [B, T, n, dr] -> [B, T, n, dr]: RoPE on a rope part, its adjacent pairs
    de-interleaved first if the weights are DeepSeek's (`rope_interleave`)."""
    x = deinterleave(x) if d.rope_interleave else x  # [B, T, n, dr]
    return apply_rope(x, pos.cos, pos.sin)  # [B, T, n, dr]


def rope_words(d: MlaDims) -> str:
    first = "adjacent pairs de-interleaved, then " if d.rope_interleave else ""
    return f"{first}rotate pairs (d, d+dr/2) by position * freq"


def mla_latent(x, w: MlaWeights, d: MlaDims, pos: Positions, trace=NO_TRACE,
               name="attn"):
    """x [B, T, D] -> what each position caches: the normed latent [B, T, R] and the
    rotated key part [B, T, dr], one for every head."""
    B, T, D = x.shape
    R, dr = d.kv_lora_rank, d.qk_rope_head_dim
    kv_a = trace.record(f"{name}.kv_a", "x @ W_kv_a^T: [latent | k_rope]",
                        F.linear(x, w.kv_a), B * T * D * (R + dr))  # [B, T, R+dr]
    latent = trace.record(f"{name}.latent", f"kv_a[..., :{R}]",
                          kv_a[..., :R])  # [B, T, R]
    latent = rms_norm(latent, w.kv_a_norm, LATENT_EPS, trace,
                      f"{name}.latent_norm")  # [B, T, R]
    k_rope = mla_rope(kv_a[..., None, R:], pos, d)[:, :, 0]  # [B, T, dr]
    k_rope = trace.record(f"{name}.rope_k", f"kv_a[..., {R}:], turned as rope_q: one "
                          f"key part for every head", k_rope)  # [B, T, dr]
    return latent, k_rope


def read_latent_cache(latent, k_rope, start: int, cache=None, trace=NO_TRACE,
                      name="attn"):
    """Write this pass's latent and k_rope into the cache, read back every position so
    far: [B, S, R] and [B, S, dr]."""
    T = latent.shape[1]
    if cache is not None:
        latent, k_rope = cache.update(start, latent, k_rope)  # [B, S, R], [B, S, dr]
        where = f"write {start}:{start + T}, read 0:{start + T}"
    elif start == 0:
        where = f"no cache: this pass's {T} positions"
    else:
        R, dr = latent.shape[-1], k_rope.shape[-1]
        raise LlmTraceError(f"a pass starting at position {start} reads the earlier "
                            f"ones from a latent cache: pass one, "
                            f"LatentCache(max_len, {R}, {dr})")
    latent = trace.record(f"{name}.kv_cache.latent", f"latent cache: {where}",
                          latent)  # [B, S, R]
    k_rope = trace.record(f"{name}.kv_cache.k_rope", f"rotated-key cache: {where}",
                          k_rope)  # [B, S, dr]
    return latent, k_rope


def mla_keys_values(latent, k_rope, w: MlaWeights, d: MlaDims, trace=NO_TRACE,
                    name="attn"):
    """Every cached position's latent [B, S, R], up to each head's key [B, S, H, dn+dr]
    (beside the shared k_rope [B, S, dr]) and value [B, S, H, dv]."""
    B, S, R = latent.shape
    H, dn, dr, dv = d.n_heads, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
    kv = trace.record(f"{name}.kv_up", "kv_cache.latent @ W_kv_b^T (every cached "
                      "position)", F.linear(latent, w.kv_b),
                      B * S * R * H * (dn + dv))  # [B, S, H*(dn+dv)]
    kv = kv.view(B, S, H, dn + dv)  # [B, S, H, dn+dv]
    shared = k_rope[:, :, None].expand(B, S, H, dr)  # [B, S, H, dr]
    k = trace.record(f"{name}.k", f"[k_nope | k_rope]: kv_up's first {dn} of each "
                     f"head beside the shared k_rope",
                     torch.cat([kv[..., :dn], shared], dim=-1))  # [B, S, H, dn+dr]
    v = trace.record(f"{name}.v", f"kv_up's last {dv} of each head",
                     kv[..., dn:])  # [B, S, H, dv]
    return k, v


class LatentAttention(Scaled):
    """One layer's multi-head latent attention, a part as `attention.Attention` is: the same
    scores, mask, softmax and output steps; what it projects, turns and caches is its own.
    Its state is a `LatentCache`; its weights `w.mla` (`MlaWeights`)."""

    def __init__(self, config, layer: int = 0):
        self.dims = MlaDims(config.n_heads, config.kv_lora_rank, config.qk_nope_head_dim,
                            config.head_dim, config.v_head_dim, config.q_lora_rank or None,
                            config.rope_interleave, config.rope_scaling)
        self.scale, self.hidden = self.dims.softmax_scale, config.hidden_size

    def tensors(self):
        """Its weights, `w.mla`'s fields: R kv_lora_rank, Rq q_lora_rank, each head's query
        and key [dn | dr], its value dv."""
        d, D, H = self.dims, self.hidden, self.dims.n_heads
        R, Rq, dn, dr, dv = (d.kv_lora_rank, d.q_lora_rank, d.qk_nope_head_dim,
                             d.qk_rope_head_dim, d.v_head_dim)
        q = ({"mla.q_a": ("self_attn.q_a_proj.weight", (Rq, D)),
              "mla.q_a_norm": ("self_attn.q_a_layernorm.weight", (Rq,)),
              "mla.q_b": ("self_attn.q_b_proj.weight", (H * (dn + dr), Rq))} if Rq
             else {"mla.q_proj": ("self_attn.q_proj.weight", (H * (dn + dr), D))})
        return {**q, "mla.kv_a": ("self_attn.kv_a_proj_with_mqa.weight", (R + dr, D)),
                "mla.kv_a_norm": ("self_attn.kv_a_layernorm.weight", (R,)),
                "mla.kv_b": ("self_attn.kv_b_proj.weight", (H * (dn + dv), R)),
                "mla.o_proj": ("self_attn.o_proj.weight", (D, H * dv))}

    def load(self, get, prefix):
        return {"mla": MlaWeights(**{f.removeprefix("mla."): get(f"{prefix}.{name}")
                                     for f, (name, _) in self.tensors().items()})}

    def save(self, w, prefix):
        return {f"{prefix}.{name}": getattr(w.mla, f.removeprefix("mla."))
                for f, (name, _) in self.tensors().items()}

    def new_state(self, max_len: int, batch: int = 1, device="cpu",
                  dtype=torch.float32) -> LatentCache:
        d = self.dims
        return LatentCache(max_len, d.kv_lora_rank, d.qk_rope_head_dim, batch, device, dtype)

    def cache_values(self, context: int, capped: bool = True) -> int:
        return context * (self.dims.kv_lora_rank + self.dims.qk_rope_head_dim)

    def __call__(self, x, w, pos: Positions, cache: LatentCache | None = None,
                 trace=NO_TRACE, name="attn"):
        """x [B, T, D] -> [B, T, D]. pos: this pass's positions, its cos and sin of width
        dr; cache: this layer's `LatentCache`, or None to attend over this pass only."""
        d, w = self.dims, w.mla
        dn = d.qk_nope_head_dim
        q = mla_queries(x, w, d, trace, name)  # [B, T, H, dn+dr]
        q_rope = trace.record(f"{name}.rope_q", rope_words(d),
                              mla_rope(q[..., dn:], pos, d))  # [B, T, H, dr]
        latent, k_rope = mla_latent(x, w, d, pos, trace, name)  # [B, T, R], [B, T, dr]
        latent, k_rope = read_latent_cache(latent, k_rope, pos.start, cache, trace,
                                           name)  # [B, S, R], [B, S, dr]
        k, v = mla_keys_values(latent, k_rope, w, d, trace, name)  # [B, S, H, dn+dr | dv]
        q = torch.cat([q[..., :dn], q_rope], dim=-1).transpose(1, 2)  # [B, H, T, dn+dr]
        out = self.mix(q, k.transpose(1, 2), v.transpose(1, 2), w, pos, trace,
                       name)  # [B, H, T, dv]
        return self.output(out, w, trace, name)  # [B, T, D]


def mla_params(w: MlaWeights) -> int:
    """The parameters of one MLA layer (shapes only: works on meta)."""
    return sum(t.numel() for t in w.__dict__.values() if t is not None)


def gqa_cache_bytes_per_token(n_layers: int, n_kv_heads: int, head_dim: int,
                              dtype_bytes: int = 2) -> int:
    """K and V of every KV head, in every layer: 2 x KV x hd x L x bytes."""
    return 2 * n_kv_heads * head_dim * n_layers * dtype_bytes


def mla_cache_bytes_per_token(n_layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                              dtype_bytes: int = 2) -> int:
    """The latent and the rotated key part, in every layer: (R + dr) x L x bytes."""
    return (kv_lora_rank + qk_rope_head_dim) * n_layers * dtype_bytes


def cache_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    """What one more position adds to the cache of a whole model. config: llmtrace's
    names (n_layers, n_kv_heads, head_dim); MLA if it gives a kv_lora_rank (and a
    qk_rope_head_dim)."""
    if getattr(config, "kv_lora_rank", None):
        return mla_cache_bytes_per_token(config.n_layers, config.kv_lora_rank,
                                         config.qk_rope_head_dim, dtype_bytes)
    return gqa_cache_bytes_per_token(config.n_layers, config.n_kv_heads,
                                     config.head_dim, dtype_bytes)
