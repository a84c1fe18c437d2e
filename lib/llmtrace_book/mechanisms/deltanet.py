"""Gated DeltaNet (Qwen3-Next's linear attention): a fixed-size state per head in place of a KV
cache.

Attention keeps K and V of every earlier position and reads them all at every step. A DeltaNet
layer keeps one matrix per value head, the state S [dk, dv], and each token writes itself into
it: S first fades by the gate exp(g) (0 < exp(g) < 1), then the delta rule corrects what S gets
wrong about the token's value. S^T k is what the state recalls for key k; the token writes
beta * (v - S^T k) along k, so a key seen again recalls its new value (beta = 1 overwrites it).
The output reads the state with the query: o = S^T q. The state's bytes do not grow with the
tokens: `state_bytes`, beside the KV cache's `kv_cache.bytes_per_token`.

Before the rule, q, k and v pass a short causal convolution over the last few positions (its
own small state: the last K-1 inputs), then SiLU; q and k are scaled to length 1. After it, an
RMSNorm per head, gated by a fourth projection z (SiLU), and the output projection.

Two forms compute the same rule. `recurrent_delta_rule` takes one token at a time, as a decode
step does. `chunked_delta_rule` takes the tokens in chunks: inside a chunk the corrections
depend on each other through a triangular system that one solve settles, so a prefill runs a
few matrix products per chunk instead of one small step per token (HF's torch fallback and
the FLA kernels do the same). tests/test_deltanet.py checks that the two agree.

Shapes: B batch, T positions, D hidden, Hk key heads, Hv value heads (each key head serves
Hv / Hk value heads, as a KV head serves query heads in GQA), dk, dv their head sizes,
C = 2 Hk dk + Hv dv the convolved channels (q, k, v side by side), K the conv's kernel.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import Attention, repeat_kv
from ..config_checks import DeltaNetDims  # noqa: F401  (its sizes, which a config checks)
from ..errors import LlmTraceError
from ..norm import rms_norm
from ..parts import Part
from ..rope import apply_rope
from ..trace import NO_TRACE

MODES = ("chunked", "recurrent")


@dataclass
class DeltaNetWeights:
    """One layer's weights, in F.linear's (out, in) orientation. The fused projections'
    rows are flat: every head of q, then of k, v, z (and b, then a), as Qwen3.5 stores
    them; `hf_deltanet_weights` regroups Qwen3-Next's, grouped per key head."""
    qkvz: torch.Tensor  # [2 Hk dk + 2 Hv dv, D]
    ba: torch.Tensor  # [2 Hv, D]
    conv: torch.Tensor  # [C, K]: one kernel per channel (depthwise)
    A_log: torch.Tensor  # [Hv]: log of each head's decay rate
    dt_bias: torch.Tensor  # [Hv]
    norm: torch.Tensor  # [dv]: the gated RMSNorm's gain (plain, not 1 + weight)
    out_proj: torch.Tensor  # [D, Hv dv]


class DeltaNetState:
    """One layer's memory across steps: the conv's last K-1 inputs and the recurrent
    state. Both keep their shape whatever the tokens seen (compare `KVCache`)."""

    def __init__(self, dims: DeltaNetDims, batch: int = 1, device="cpu",
                 dtype=torch.float32):
        d = dims.check()
        self.conv = torch.zeros(batch, d.conv_dim, d.conv_kernel - 1, device=device,
                                dtype=dtype)  # [B, C, K-1]
        self.recurrent = torch.zeros(batch, d.n_v_heads, d.k_head_dim, d.v_head_dim,
                                     device=device, dtype=dtype)  # [B, Hv, dk, dv]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.conv, self.recurrent))


def state_bytes(dims: DeltaNetDims, batch: int = 1,
                bytes_per_value: int = 4) -> int:
    """Bytes one DeltaNet layer's state holds, at any context length: the conv's K-1
    inputs of C channels and Hv matrices dk x dv. (HF's cache keeps K conv inputs, one
    more than the convolution reads.)"""
    conv = dims.conv_dim * (dims.conv_kernel - 1)
    recurrent = dims.n_v_heads * dims.k_head_dim * dims.v_head_dim
    return batch * (conv + recurrent) * bytes_per_value


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / |x| over the last dim, eps inside the root (as HF's `l2norm` and FLA's)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor,
                past: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each channel's own kernel over its last K inputs, then SiLU: x [B, T, C], weight
    [C, K], past [B, C, K-1] (the inputs before x; None: zeros, a prompt's start).
    Returns (out [B, T, C], the last K-1 inputs [B, C, K-1]: the next step's past)."""
    B, T, C = x.shape
    K = weight.shape[1]
    if past is None:
        past = x.new_zeros(B, C, K - 1)
    seen = torch.cat([past, x.transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
    out = F.conv1d(seen, weight[:, None, :], groups=C)  # [B, C, T]
    return F.silu(out).transpose(1, 2), seen[..., T:]


def delta_rule_step(S, q, k, v, g, beta):
    """One token through the gated delta rule, per head. S [B, H, dk, dv]; q, k
    [B, H, dk]; v [B, H, dv]; g, beta [B, H]. Returns (S after the token, its output
    [B, H, dv])."""
    S = g.exp()[..., None, None] * S  # fade: every entry times exp(g) < 1
    recalled = torch.einsum("bhkv,bhk->bhv", S, k)  # S^T k: what S holds for key k
    delta = beta[..., None] * (v - recalled)  # [B, H, dv]: the correction
    S = S + k[..., :, None] * delta[..., None, :]  # write it along k: S + k delta^T
    return S, torch.einsum("bhkv,bhk->bhv", S, q)  # read: S^T q


def recurrent_delta_rule(q, k, v, g, beta, S):
    """q, k [B, H, T, dk]; v [B, H, T, dv]; g, beta [B, H, T]; S [B, H, dk, dv] the
    state before. Token by token. Returns (out [B, H, T, dv], S after the last one)."""
    outs = []
    for t in range(q.shape[2]):
        S, o = delta_rule_step(S, q[:, :, t], k[:, :, t], v[:, :, t],
                               g[:, :, t], beta[:, :, t])
        outs.append(o)  # [B, H, dv]
    return torch.stack(outs, dim=2), S


def chunked_delta_rule(q, k, v, g, beta, S, chunk: int = 64):
    """The same rule, `chunk` tokens at a time (the last chunk may be shorter).
    Inside a chunk, with G_i the summed g from its start through token i and
    D_ij = exp(G_i - G_j) for j <= i (0 above), the corrections u_i (the recurrent
    form's delta) satisfy
        u_i + beta_i sum_{j<i} D_ij (k_i . k_j) u_j = beta_i (v_i - exp(G_i) S^T k_i):
    one triangular solve. Then o_i = exp(G_i) S^T q_i + sum_{j<=i} D_ij (q_i . k_j) u_j
    and S' = exp(G_last) S + sum_j exp(G_last - G_j) k_j u_j^T. Returns (out, S) as
    the recurrent form."""
    outs = []
    for s in range(0, q.shape[2], chunk):
        part = slice(s, s + chunk)
        qc, kc, vc = q[:, :, part], k[:, :, part], v[:, :, part]  # [B, H, c, d]
        G = g[:, :, part].cumsum(-1)  # [B, H, c]: log of the fade since the start
        bc = beta[:, :, part, None]  # [B, H, c, 1]
        c = G.shape[-1]
        later = torch.ones(c, c, dtype=torch.bool,
                           device=q.device).triu(1)  # [c, c]: j > i
        D = (G[..., :, None] - G[..., None, :]).masked_fill(later, -math.inf).exp()
        A = (bc * (kc @ kc.transpose(-1, -2)) * D).tril(-1)  # [B, H, c, c]
        rhs = bc * (vc - (G.exp()[..., None] * kc) @ S)  # [B, H, c, dv]
        eye = torch.eye(c, dtype=q.dtype, device=q.device)
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False,
                                          unitriangular=True)  # [B, H, c, dv]
        o = ((G.exp()[..., None] * qc) @ S
             + ((qc @ kc.transpose(-1, -2)) * D) @ u)  # [B, H, c, dv]
        outs.append(o)
        to_end = (G[..., -1:] - G).exp()[..., None]  # [B, H, c, 1]: fade to the end
        S = (G[..., -1].exp()[..., None, None] * S
             + (to_end * kc).transpose(-1, -2) @ u)  # [B, H, dk, dv]
    return torch.cat(outs, dim=2), S


def rule_macs(B, H, T, dk, dv, mode, chunk=64) -> int:
    """Multiply-adds of the rule's products. Recurrent: S^T k, k delta^T and S^T q,
    dk dv each per token and head. Chunked, per chunk of c tokens: k k^T and q k^T
    (c^2 dk each), the solve (c(c-1)/2 dv), (D q k^T) u (c^2 dv), and k S, q S,
    k^T u (c dk dv each)."""
    if mode == "recurrent":
        return B * H * T * 3 * dk * dv
    sizes = [min(chunk, T - s) for s in range(0, T, chunk)]
    per_head = sum(2 * c * c * dk + c * (c - 1) // 2 * dv + c * c * dv
                   + 3 * c * dk * dv for c in sizes)
    return B * H * per_head


def gated_deltanet(x, w: DeltaNetWeights, dims: DeltaNetDims,
                   state: DeltaNetState | None = None, trace=NO_TRACE,
                   name: str = "attn", mode: str | None = None,
                   chunk: int = 64) -> torch.Tensor:
    """x [B, T, D] -> [B, T, D]. state: this layer's `DeltaNetState`, read and
    updated in place (None: a pass from the prompt's start that keeps nothing).
    mode: "chunked" or "recurrent"; None: recurrent for one token (a decode step),
    chunked for more."""
    d = dims.check()
    B, T, D = x.shape
    Hk, Hv, dk, dv = d.n_k_heads, d.n_v_heads, d.k_head_dim, d.v_head_dim
    mode = mode or ("recurrent" if T == 1 else "chunked")
    if mode not in MODES:
        raise LlmTraceError(f"mode must be one of {', '.join(MODES)}, "
                            f"got {mode!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise LlmTraceError(f"chunk (tokens per chunk) must be a whole number of 1 "
                            f"or more, got {chunk!r}")

    rows = 2 * d.key_dim + 2 * d.value_dim
    qkvz = trace.record(f"{name}.qkvz", "x @ W_qkvz^T", F.linear(x, w.qkvz),
                        B * T * D * rows)  # [B, T, 2 Hk dk + 2 Hv dv]
    ba = trace.record(f"{name}.ba", "x @ W_ba^T", F.linear(x, w.ba),
                      B * T * D * 2 * Hv)  # [B, T, 2 Hv]
    qkv, z = qkvz.split([d.conv_dim, d.value_dim], dim=-1)  # [B, T, C], [B, T, Hv*dv]
    b, a = ba.split([Hv, Hv], dim=-1)  # [B, T, Hv] each

    # The short convolution: each channel of q, k, v mixes its last K positions.
    mixed, past = causal_conv(qkv, w.conv, None if state is None else state.conv)
    K = d.conv_kernel
    mixed = trace.record(f"{name}.conv", f"causal conv over the last {K} positions, "
                         "per channel, then SiLU", mixed, B * T * d.conv_dim * K)
    past = trace.record(f"{name}.conv_state", f"the last {K - 1} conv inputs",
                        past)  # [B, C, K-1]
    q, k, v = mixed.split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
    q = trace.record(f"{name}.q", f"split into {Hk} heads, L2-normalized",
                     l2_norm(q.reshape(B, T, Hk, dk)))  # [B, T, Hk, dk]
    k = trace.record(f"{name}.k", f"split into {Hk} heads, L2-normalized",
                     l2_norm(k.reshape(B, T, Hk, dk)))  # [B, T, Hk, dk]
    v = trace.record(f"{name}.v", f"split into {Hv} heads",
                     v.reshape(B, T, Hv, dv))  # [B, T, Hv, dv]
    z = trace.record(f"{name}.z", f"split into {Hv} heads",
                     z.reshape(B, T, Hv, dv))  # [B, T, Hv, dv]

    # Per token and value head: how much the state keeps (exp g), how much it takes.
    g = -w.A_log.exp() * F.softplus(a + w.dt_bias)  # [B, T, Hv], g < 0
    g = trace.record(f"{name}.g", "-exp(A_log) * softplus(a + dt_bias): "
                     "log of the fade", g)
    beta = trace.record(f"{name}.beta", "sigmoid(b): how much each token writes",
                        torch.sigmoid(b))  # [B, T, Hv]

    # Heads first; each key head serves Hv / Hk value heads, as in GQA.
    qh = repeat_kv(q.transpose(1, 2), Hv // Hk) / math.sqrt(dk)  # [B, Hv, T, dk]
    kh = repeat_kv(k.transpose(1, 2), Hv // Hk)  # [B, Hv, T, dk]
    S = state.recurrent if state is not None else x.new_zeros(B, Hv, dk, dv)
    rule = recurrent_delta_rule if mode == "recurrent" else chunked_delta_rule
    args = (chunk,) if mode == "chunked" else ()
    # the rule in fp32 whatever the weights' dtype, as HF's reference does (its triangular
    # solve has no bf16 kernel); the state stays fp32, the output takes the stream's dtype
    core, S = rule(*(t.float() for t in (qh, kh, v.transpose(1, 2), g.transpose(1, 2),
                                         beta.transpose(1, 2), S)), *args)
    core = core.to(x.dtype)  # [B, Hv, T, dv]; S [B, Hv, dk, dv]
    how = "token by token" if mode == "recurrent" else f"in chunks of {chunk}"
    core = trace.record(f"{name}.core", f"gated delta rule {how}: write, then read "
                        "S^T q", core.transpose(1, 2),
                        rule_macs(B, Hv, T, dk, dv, mode, chunk))  # [B, T, Hv, dv]
    S = trace.record(f"{name}.state", "S after the pass: a dk x dv matrix per "
                     "value head", S)  # [B, Hv, dk, dv], whatever T
    if state is not None:  # what the next step reads (a patch here changes it)
        state.conv, state.recurrent = past, S

    normed = rms_norm(core, w.norm, d.norm_eps, trace,
                      f"{name}.core_norm")  # [B, T, Hv, dv]
    gated = trace.record(f"{name}.gated_norm", "core_norm * silu(z)",  # the gate in fp32, as HF
                         (normed * F.silu(z.float())).to(z.dtype))  # [B, T, Hv, dv]
    out = F.linear(gated.reshape(B, T, d.value_dim), w.out_proj)  # [B, T, D]
    return trace.record(f"{name}.out", "gated_norm @ W_out^T", out,
                        B * T * d.value_dim * D)


def grouped_to_flat(w: torch.Tensor, n_groups: int, sizes: list[int]) -> torch.Tensor:
    """Rows grouped per key head ([group 0: part 0, part 1, ...], [group 1: ...]) ->
    flat (part 0 of every group, then part 1, ...). Qwen3-Next's in_proj_qkvz holds,
    per key head, its q (dk rows), k (dk), then v and z of the Hv/Hk value heads it
    serves (Hv/Hk * dv each); in_proj_ba, per key head, b then a of those heads."""
    per = w.reshape(n_groups, sum(sizes), -1)  # [groups, rows per group, D]
    parts = per.split(sizes, dim=1)  # each [groups, size, D]
    return torch.cat([p.reshape(-1, w.shape[-1]) for p in parts])  # [rows, D]


def flat_to_grouped(w: torch.Tensor, n_groups: int, sizes: list[int]) -> torch.Tensor:
    """The inverse of `grouped_to_flat`: part 0 of every group, then part 1, ... ->
    each group's parts side by side, as Qwen3-Next stores them."""
    parts = w.split([n_groups * s for s in sizes])  # each [groups * size, D]
    per = [p.reshape(n_groups, -1, w.shape[-1]) for p in parts]  # each [groups, size, D]
    return torch.cat(per, dim=1).reshape(-1, w.shape[-1])  # [rows, D]


def hf_deltanet_state_dict(w: DeltaNetWeights, prefix: str, dims: DeltaNetDims,
                           model_type: str = "qwen3_next") -> dict[str, torch.Tensor]:
    """One layer's tensors under the names `hf_deltanet_weights` reads, as HF stores them."""
    p, d = f"{prefix}.linear_attn", dims.check()
    r = d.n_v_heads // d.n_k_heads
    if model_type == "qwen3_next":
        sizes = [d.k_head_dim, d.k_head_dim, r * d.v_head_dim, r * d.v_head_dim]
        proj = {"in_proj_qkvz": flat_to_grouped(w.qkvz, d.n_k_heads, sizes),
                "in_proj_ba": flat_to_grouped(w.ba, d.n_k_heads, [r, r])}
    elif model_type == "qwen3_5_text":
        qkv, z = w.qkvz.split([d.conv_dim, d.value_dim])
        b, a = w.ba.split([d.n_v_heads, d.n_v_heads])
        proj = {"in_proj_qkv": qkv, "in_proj_z": z, "in_proj_b": b, "in_proj_a": a}
    else:
        raise LlmTraceError(f"no Gated DeltaNet weight names for model_type "
                            f"{model_type!r}: known are qwen3_next, qwen3_5_text")
    return {**{f"{p}.{n}.weight": t for n, t in proj.items()},
            f"{p}.conv1d.weight": w.conv[:, None],  # [C, K] -> [C, 1, K]
            f"{p}.A_log": w.A_log, f"{p}.dt_bias": w.dt_bias,
            f"{p}.norm.weight": w.norm, f"{p}.out_proj.weight": w.out_proj}


def hf_deltanet_weights(get, prefix: str, dims: DeltaNetDims,
                        model_type: str = "qwen3_next") -> DeltaNetWeights:
    """One layer's DeltaNetWeights from the names `save_pretrained` writes:
    get(name) -> tensor, prefix "model.layers.0". Qwen3-Next fuses q, k, v, z and b, a,
    grouped per key head; Qwen3.5 (`qwen3_5_text`) stores them apart, flat."""
    p, d = f"{prefix}.linear_attn", dims.check()
    r = d.n_v_heads // d.n_k_heads  # value heads per key head
    if model_type == "qwen3_next":
        qkvz = grouped_to_flat(get(f"{p}.in_proj_qkvz.weight"), d.n_k_heads,
                               [d.k_head_dim, d.k_head_dim, r * d.v_head_dim,
                                r * d.v_head_dim])
        ba = grouped_to_flat(get(f"{p}.in_proj_ba.weight"), d.n_k_heads, [r, r])
    elif model_type == "qwen3_5_text":
        qkvz = torch.cat([get(f"{p}.in_proj_qkv.weight"),
                          get(f"{p}.in_proj_z.weight")])
        ba = torch.cat([get(f"{p}.in_proj_b.weight"), get(f"{p}.in_proj_a.weight")])
    else:
        raise LlmTraceError(f"no Gated DeltaNet weight names for model_type "
                            f"{model_type!r}: known are qwen3_next, qwen3_5_text")
    return DeltaNetWeights(qkvz=qkvz, ba=ba,
                           conv=get(f"{p}.conv1d.weight")[:, 0],  # [C, 1, K] -> [C, K]
                           A_log=get(f"{p}.A_log"), dt_bias=get(f"{p}.dt_bias"),
                           norm=get(f"{p}.norm.weight"),
                           out_proj=get(f"{p}.out_proj.weight"))


class GatedDeltaNet(Part):
    """A Gated DeltaNet layer as a part, in attention's place (Qwen3-Next's "linear" layers):
    its state a `DeltaNetState`, the same size at any length; its weights `w.linear`, stored
    as `layout` stores them (`hf_deltanet_weights`)."""
    layout = "qwen3_next"  # q, k, v, z and b, a fused, grouped per key head

    def __init__(self, config, layer: int = 0):
        self.dims, self.hidden = config.deltanet_dims, config.hidden_size

    def tensors(self):
        """Its weights by their names on disk (the parameter table's rows)."""
        d, D = self.dims, self.hidden
        fused = {"in_proj_qkvz.weight": (2 * d.key_dim + 2 * d.value_dim, D),
                 "in_proj_ba.weight": (2 * d.n_v_heads, D)}
        apart = {"in_proj_qkv.weight": (d.conv_dim, D), "in_proj_z.weight": (d.value_dim, D),
                 "in_proj_b.weight": (d.n_v_heads, D), "in_proj_a.weight": (d.n_v_heads, D)}
        return {f"linear_attn.{name}": (f"linear_attn.{name}", shape) for name, shape in {
            "A_log": (d.n_v_heads,), "dt_bias": (d.n_v_heads,),
            "conv1d.weight": (d.conv_dim, 1, d.conv_kernel),
            **(fused if self.layout == "qwen3_next" else apart),
            "norm.weight": (d.v_head_dim,), "out_proj.weight": (D, d.value_dim)}.items()}

    def load(self, get, prefix):
        return {"linear": hf_deltanet_weights(get, prefix, self.dims, self.layout)}

    def save(self, w, prefix):
        return hf_deltanet_state_dict(w.linear, prefix, self.dims, self.layout)

    def new_state(self, max_len: int, batch: int = 1, device="cpu",
                  dtype=torch.float32) -> DeltaNetState:
        return DeltaNetState(self.dims, batch, device, dtype)

    def cache_values(self, context: int, capped: bool = True) -> int:
        """Its state, the same at any context."""
        return state_bytes(self.dims, bytes_per_value=1)

    def __call__(self, x, w, pos, cache=None, trace=NO_TRACE, name="attn"):
        return gated_deltanet(x, w.linear, self.dims, cache, trace, name)  # [B, T, D]


def partial_rope(x, cos, sin, rotary_dim: int, trace=NO_TRACE, name: str = "rope",
                 freq: str = "freq"):
    """RoPE on the first rotary_dim of each head (cos, sin [T, rotary_dim]), the rest of
    x [B, T, heads, hd] as it came."""
    turned = apply_rope(x[..., :rotary_dim], cos, sin)  # [B, T, heads, rotary_dim]
    out = torch.cat([turned, x[..., rotary_dim:]], dim=-1)  # [B, T, heads, hd]
    what = (f"rotate pairs (d, d+{rotary_dim // 2}) of the first {rotary_dim} dims by "
            f"position * {freq}, the other {x.shape[-1] - rotary_dim} unturned")
    return trace.record(name, what, out)


class GatedAttention(Attention):
    """Qwen3-Next's full-attention layers: W_q gives each head its query and a gate; each
    head's output times sigmoid(gate); RoPE on the first `rotary_dim` of each head."""

    def __init__(self, config, layer: int = 0):
        super().__init__(config, layer)
        self.rotary_dim = config.rotary_dim  # None: the whole head turns

    def tensors(self):
        """Llama's, W_q twice as tall: each head's query, then its gate."""
        H, hd, D = self.n_heads, self.head_dim, self.hidden
        return {**super().tensors(), "q_proj": ("self_attn.q_proj.weight", (2 * H * hd, D))}

    def __call__(self, x, w, pos, cache=None, trace=NO_TRACE, name="attn"):
        q, gate, k, v = self.gated_qkv(x, w, trace, name)  # [B, T, H*hd], [B, T, H, hd]
        q, k, v = self.heads(q, k, v, w, trace, name)  # [B, T, H | KV, hd]
        q, k = self.rotate(q, k, pos, trace, name)  # [B, T, H | KV, hd]
        k, v = self.read_cache(k, v, pos.start, cache, trace, name)  # [B, S, KV, hd]
        out = self.attend(q, k, v, w, pos, trace, name)  # [B, H, T, hd]
        out = trace.record(f"{name}.output_gate", "weighted_sum * sigmoid(gate)",
                           out * torch.sigmoid(gate).transpose(1, 2))  # [B, H, T, hd]
        return self.output(out, w, trace, name)  # [B, T, D]

    def gated_qkv(self, x, w, trace, name):
        B, T, D = x.shape
        H, KV, hd = self.n_heads, self.n_kv_heads, self.head_dim
        qg = trace.record(f"{name}.q_proj", "x @ W_q^T: per head, query then gate",
                          F.linear(x, w.q_proj), B * T * D * 2 * H * hd)  # [B, T, 2H*hd]
        qg = qg.view(B, T, H, 2 * hd)  # [B, T, H, 2*hd]
        gate = trace.record(f"{name}.gate", "second half of each head's q_proj",
                            qg[..., hd:])  # [B, T, H, hd]
        q = qg[..., :hd].reshape(B, T, H * hd)  # [B, T, H*hd]
        k = trace.record(f"{name}.k_proj", "x @ W_k^T", F.linear(x, w.k_proj),
                         B * T * D * KV * hd)  # [B, T, KV*hd]
        v = trace.record(f"{name}.v_proj", "x @ W_v^T", F.linear(x, w.v_proj),
                         B * T * D * KV * hd)  # [B, T, KV*hd]
        return q, gate, k, v

    def rotate(self, q, k, pos, trace, name):
        if self.rotary_dim is None:
            return super().rotate(q, k, pos, trace, name)
        q = partial_rope(q, pos.cos, pos.sin, self.rotary_dim, trace, f"{name}.rope_q",
                         self.freq)  # [B, T, H, hd]
        k = partial_rope(k, pos.cos, pos.sin, self.rotary_dim, trace, f"{name}.rope_k",
                         self.freq)  # [B, T, KV, hd]
        return q, k

    def output(self, out, w, trace, name):
        B, H, T, hd = out.shape

        def merge(o):  # [B, H, T, hd] -> [B, T, H*hd]
            return o.transpose(1, 2).reshape(B, T, H * hd)

        out = trace.record(f"{name}.merged", "heads back side by side", merge(out),
                           recompute=(merge, f"{name}.output_gate"))  # [B, T, H*hd]
        D = w.o_proj.shape[0]
        return trace.record(f"{name}.out", "merged @ W_o^T", F.linear(out, w.o_proj),
                            B * T * H * hd * D)  # [B, T, D]
