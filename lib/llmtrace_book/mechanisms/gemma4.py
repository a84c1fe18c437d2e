"""Gemma 4 (text): what its layers compute beyond Gemma 3's, as HF transformers 5.24 writes it
(`models/gemma4/modeling_gemma4.py`).

- Two kinds of layer with different heads: sliding layers use `head_dim`, full layers a wider
  `global_head_dim` (512 by its class's default), and, with `attention_k_eq_v`, their own
  number of KV heads and no V projection: V is K's projection, normalized on its own.
- Full layers turn only part of each head (`proportional_frequencies`): a fraction of the
  pairs keeps RoPE's frequencies counted over the whole head, the rest do not turn.
- Every K and V is normalized (k_norm as Gemma 3, and a `v_norm` with no weight); q, k scores
  are not scaled (scale 1): the norms set their size.
- Norms multiply by their weight, not by (1 + weight) as Gemma 3's.
- KV shared across layers: the last `num_kv_shared_layers` layers compute only a query, and
  read the K, V of the last earlier layer of their own kind (`kv_sources`). They hold no cache
  of their own; with `use_double_wide_mlp` their MLP is twice as wide.
- Per-layer inputs (PLE): a second embedding table gives each token a small vector for every
  layer, mixed with a projection of the embedded stream (`per_layer_inputs`); each layer gates
  it with its stream and adds it back (`per_layer_residual`).
- Each layer's output is multiplied by a stored scalar (`layer_scaled`), and the final logits
  are soft-capped (`softcap`).
- The MoE variant (`enable_moe_block`), experts beside the dense MLP, is refused by its key.

Shapes: B batch, T positions, D hidden, H query heads, KV key/value heads, hd a layer's head
dim, L layers, P `hidden_size_per_layer_input`, S positions read from the cache.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..attention import Attention
from ..block import Block
from ..errors import LlmTraceError
from ..norm import rms_norm
from ..rope import apply_rope
from ..trace import NO_TRACE

# HF config keys of parts computed nowhere here, and what each would add. The multimodal
# checkpoints (model_type "gemma4") hold the text model under `model.language_model.`, the towers
# under `model.vision_tower.`, `model.audio_tower.`, `model.embed_vision.`, `model.embed_audio.`.
REFUSED = {
    "vision_config": "the vision tower (images to soft tokens)",
    "audio_config": "the audio tower (sound to soft tokens)",
}
# use_bidirectional_attention: "vision" lets image tokens see each other, and leaves text causal
# (a text prompt computes as without it); "all" makes every token see later ones: refused.


def refuse_unsupported(c: dict, where: str) -> None:
    """One line naming the first key of an HF Gemma 4 config (the text config, or the whole
    `gemma4` config with its towers) whose part is not computed here."""
    for key, what in REFUSED.items():
        if c.get(key):
            raise LlmTraceError(f"{where}: {key} ({what}) is not implemented for Gemma 4, "
                                f"only its text model: use the text_config alone, with the "
                                f"weights under model.language_model.")
    if c.get("use_bidirectional_attention") == "all":
        raise LlmTraceError(f"{where}: use_bidirectional_attention='all' (every token sees "
                            f"the later ones too) is not implemented for Gemma 4: only "
                            f"causal attention is (None, or 'vision' for a text prompt)")


# --- which layer computes which K, V ------------------------------------------------------------
def layer_kinds(layer_types) -> list[str]:
    """"sliding" or "full" per layer, from HF's "sliding_attention", "full_attention"."""
    kinds = [t.removesuffix("_attention") for t in layer_types]
    wrong = sorted(set(kinds) - {"sliding", "full"})
    if wrong:
        raise LlmTraceError(f"layer_types must list 'sliding_attention' or 'full_attention' "
                            f"for each layer, got {wrong[0]!r}")
    return kinds


def kv_sources(layer_types, n_shared: int) -> tuple[int, ...]:
    """Layer i -> the layer whose K and V it attends over: itself, except the last n_shared
    layers, which read the last earlier layer of their own kind (as HF's `kv_sharing_modes`:
    those source layers "store", the shared ones "reuse"). layer_types: "sliding" or "full"
    per layer (HF's "sliding_attention", "full_attention" are read too)."""
    kinds = layer_kinds(layer_types)
    if not 0 <= n_shared < len(kinds):
        raise LlmTraceError(f"num_kv_shared_layers={n_shared} must be at least 0 and below "
                            f"the {len(kinds)} layers: some layer must compute K and V")
    first = len(kinds) - n_shared  # the first layer that computes no K, V
    sources = list(range(first))
    for kind in kinds[first:]:
        own = [j for j in range(first) if kinds[j] == kind]
        if not own:
            raise LlmTraceError(f"a shared {kind} layer has no earlier {kind} layer to read "
                                f"K, V from: lower num_kv_shared_layers={n_shared}")
        sources.append(own[-1])
    return tuple(sources)


@dataclass(frozen=True)
class LayerShape:
    """What one Gemma 4 layer's attention and MLP are, from the config."""
    kind: str  # "sliding" or "full"
    head_dim: int
    n_kv_heads: int
    kv_source: int  # the layer whose K, V it reads (itself unless shared)
    k_eq_v: bool  # V is K's projection (no v_proj): full layers with attention_k_eq_v
    ffn_size: int  # twice intermediate_size on shared layers with use_double_wide_mlp
    v_norm: bool = True  # V normalized with no weight (False: a control, as Gemma 3)


def layer_shapes(c: dict) -> list[LayerShape]:
    """Each layer's shape from an HF Gemma4TextConfig's dict (config.json's keys): full
    layers take `global_head_dim` and `num_global_key_value_heads` (only if attention_k_eq_v),
    or, as save_pretrained writes them, `per_layer_config` {layer: {head_dim, ...}}."""
    n, kinds = c["num_hidden_layers"], layer_kinds(c["layer_types"])
    sources = kv_sources(kinds, c.get("num_kv_shared_layers", 0))
    k_eq_v = bool(c.get("attention_k_eq_v", False))
    full = {"head_dim": c.get("global_head_dim", 512)}
    if k_eq_v and c.get("num_global_key_value_heads") is not None:
        full["num_key_value_heads"] = c["num_global_key_value_heads"]
    per_layer = c.get("per_layer_config")  # {}: no layer differs from the global values
    per_layer = None if per_layer is None else {int(i): v for i, v in per_layer.items()}
    shapes = []
    for i in range(n):
        over = full if per_layer is None and kinds[i] == "full" else (per_layer or {}).get(i, {})
        wide = c.get("use_double_wide_mlp", False) and sources[i] != i
        shapes.append(LayerShape(
            kinds[i], over.get("head_dim", c["head_dim"]),
            over.get("num_key_value_heads", c["num_key_value_heads"]), sources[i],
            k_eq_v and kinds[i] == "full", c["intermediate_size"] * (2 if wide else 1)))
    return shapes


def config_layer_shapes(c) -> list[LayerShape]:
    """Each layer's shape from a `Config` (the library's fields, read by families/gemma4.py
    from the keys `layer_shapes` reads)."""
    kinds = c.layer_types or ("full",) * c.n_layers
    sources = kv_sources(kinds, c.kv_shared_layers)
    shapes = []
    for i, kind in enumerate(kinds):
        full = kind == "full"
        wide = c.double_wide_mlp and sources[i] != i
        shapes.append(LayerShape(
            kind, (c.global_head_dim or c.head_dim) if full else c.head_dim,
            (c.global_kv_heads or c.n_kv_heads) if full else c.n_kv_heads, sources[i],
            c.k_eq_v and full, c.ffn_size * (2 if wide else 1), c.v_norm))
    return shapes


def cache_shape(c, layer: int) -> tuple[int, int] | None:
    """(KV heads, head_dim) of the cache layer `layer` of a Gemma 4 `Config` keeps, or None
    for a layer that reads another's K, V and keeps none: a count of cache bytes per layer
    of any config reads it when `c.varied_layers`."""
    s = config_layer_shapes(c)[layer]
    return None if s.kv_source != layer else (s.n_kv_heads, s.head_dim)


def layer_kv_values(c, layer: int, context: int) -> int:
    """The numbers layer `layer` of a Gemma 4 `Config` must cache after `context` positions:
    none for a layer that reads another's K, V; else K and V of its own heads, over the last
    sliding_window positions on a sliding layer (what an inference cache keeps)."""
    shape = cache_shape(c, layer)
    if shape is None:
        return 0
    if c.is_sliding(layer):
        context = min(context, c.sliding_window)
    kv, hd = shape
    return context * 2 * kv * hd


def kv_bytes_per_token(shapes: list[LayerShape], dtype_bytes: int = 2) -> int:
    """Bytes one position adds to the cache: K and V of each layer that computes its own
    (a shared layer adds nothing; with k_eq_v, K and V still differ after their norms, so
    both are kept, as HF's cache keeps them)."""
    return sum(2 * s.n_kv_heads * s.head_dim * dtype_bytes
               for i, s in enumerate(shapes) if s.kv_source == i)


# --- RoPE on part of each head ----------------------------------------------------------------
ROPE_TYPES = {"sliding": ("default",), "full": ("default", "proportional")}


def rope_settings(c: dict) -> dict[str, tuple[float, float]]:
    """{kind: (theta, fraction)} from an HF Gemma 4 config's `rope_parameters` (one dict per
    layer kind): the RoPE base, and the part of each head's pairs that turns (1 on the
    sliding layers, `partial_rotary_factor` on the full ones). What else a dict may say
    (a `factor` other than 1, another rope_type) is refused by its key."""
    out = {}
    for kind in dict.fromkeys(layer_kinds(c["layer_types"])):
        r = dict(c["rope_parameters"][f"{kind}_attention"])
        where = f"rope_parameters.{kind}_attention"
        if r.get("rope_type", "default") not in ROPE_TYPES[kind]:
            raise LlmTraceError(f"{where}.rope_type={r['rope_type']!r} is not implemented: "
                                f"known are {', '.join(ROPE_TYPES[kind])}")
        partial = r.get("rope_type") == "proportional"  # HF's default type ignores the key
        known = {"rope_type", "rope_theta", *(("partial_rotary_factor",) if partial else ()),
                 *(("factor",) if r.get("factor", 1.0) == 1.0 else ())}
        extra = sorted(set(r) - known)
        if extra:
            raise LlmTraceError(f"{where}.{extra[0]}={r[extra[0]]!r} is not implemented "
                                f"for Gemma 4's RoPE here: remove it")
        out[kind] = (float(r["rope_theta"]), float(r.get("partial_rotary_factor", 1.0)))
    return out


def proportional_frequencies(head_dim: int, theta: float, fraction: float,
                             device=None) -> torch.Tensor:
    """[head_dim/2]: the first int(fraction * head_dim/2) pairs turn at theta^(-2i/head_dim),
    counted over the whole head (not over the turned part); the other pairs get frequency 0:
    cos 1, sin 0, left as they are. Pairs stay (d, d + head_dim/2), so the turned dimensions
    are the first few of each half. As HF's `_compute_proportional_rope_parameters`."""
    turned = int(fraction * head_dim // 2)
    pairs = torch.arange(0, 2 * turned, 2, dtype=torch.int64, device=device)  # [turned]
    freqs = 1.0 / theta ** (pairs.float() / head_dim)  # [turned]
    still = torch.zeros(head_dim // 2 - turned, device=device)  # [hd/2 - turned]
    return torch.cat([freqs, still])  # [hd/2]


def proportional_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                         fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] of the full layers, for `apply_rope` as it is."""
    freqs = proportional_frequencies(head_dim, theta, fraction, positions.device)
    angles = positions.float()[:, None] * freqs[None, :]  # [T, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, hd]
    return angles.cos(), angles.sin()  # [T, hd] each


# --- attention -------------------------------------------------------------------------------
def unit_rms_norm(x, eps: float, trace=NO_TRACE, name: str = "norm") -> torch.Tensor:
    """RMSNorm with no weight (Gemma 4's v_norm): each vector to RMS 1, nothing learned; in
    fp32, then rounded to x's dtype, as HF."""
    dtype = x.dtype
    x = x.float()
    mean_sq = trace.record(f"{name}.mean_sq", "mean(x^2) over the last dim",
                           x.pow(2).mean(-1, keepdim=True))  # [..., 1]
    return trace.record(name, f"x / sqrt(mean_sq + {eps:g}), no weight",
                        (x * torch.rsqrt(mean_sq + eps)).to(dtype))  # [..., hd]


def own_kv(x, w, s: LayerShape, eps: float, pos, trace=NO_TRACE, name: str = "attn"):
    """K and V [B, T, KV, hd] of a layer that computes its own: projected (V from K's own
    projection with k_eq_v), k normalized with its weight and turned, v normalized with none."""
    B, T, D = x.shape
    KV, hd = s.n_kv_heads, s.head_dim
    k = trace.record(f"{name}.k_proj", "x @ W_k^T", F.linear(x, w.k_proj),
                     B * T * D * KV * hd)  # [B, T, KV*hd]
    if s.k_eq_v:  # full layers: one projection serves both
        v = trace.record(f"{name}.v_proj", "k_proj (attention_k_eq_v: no W_v)",
                         k)  # [B, T, KV*hd]
    else:
        v = trace.record(f"{name}.v_proj", "x @ W_v^T", F.linear(x, w.v_proj),
                         B * T * D * KV * hd)  # [B, T, KV*hd]
    k = trace.record(f"{name}.k", f"split into {KV} heads",
                     k.view(B, T, KV, hd))  # [B, T, KV, hd]
    v = trace.record(f"{name}.v", f"split into {KV} heads",
                     v.view(B, T, KV, hd))  # [B, T, KV, hd]
    k = rms_norm(k, w.k_norm, eps, trace, f"{name}.k_norm")  # [B, T, KV, hd]
    if s.v_norm:
        v = unit_rms_norm(v, eps, trace, f"{name}.v_norm")  # [B, T, KV, hd]
    k = apply_rope(k, pos.cos, pos.sin, trace, f"{name}.rope_k",
                   f"freq ({s.kind})")  # [B, T, KV, hd]
    return k, v


class Gemma4Attention(Attention):
    """One Gemma 4 layer's attention, a part as `attention.Attention` is: its layer's own head
    width and KV heads (`LayerShape`), q normed per head, K and V of its own (`own_kv`) or, on a
    shared layer, those its source layer read in this pass (`pos.more["kv", source]`). The
    family mixes in the scores times `attn_scale` (`Scaled`, 1: the norms set their size) and a
    window on sliding layers (`Windowed`)."""

    def __init__(self, config, layer: int = 0):
        super().__init__(config, layer)
        self.layer, self.shape = layer, config_layer_shapes(config)[layer]
        self.head_dim, self.n_kv_heads = self.shape.head_dim, self.shape.n_kv_heads
        self.eps, self.freq = config.norm_eps, f"freq ({self.shape.kind})"

    def tensors(self):
        """Its layer's head width; K and V's weights only where it computes them (V's not
        with k_eq_v), as its norms' (V's has none)."""
        H, KV, hd, D, s = self.n_heads, self.n_kv_heads, self.head_dim, self.hidden, self.shape
        own = s.kv_source == self.layer
        out = {"q_proj": ("self_attn.q_proj.weight", (H * hd, D))}
        out.update({"k_proj": ("self_attn.k_proj.weight", (KV * hd, D))} if own else {})
        if own and not s.k_eq_v:
            out["v_proj"] = ("self_attn.v_proj.weight", (KV * hd, D))
        out["q_norm"] = ("self_attn.q_norm.weight", (hd,))
        out.update({"k_norm": ("self_attn.k_norm.weight", (hd,))} if own else {})
        return {**out, "o_proj": ("self_attn.o_proj.weight", (D, H * hd))}

    def new_state(self, max_len: int, batch: int = 1, device="cpu", dtype=torch.float32):
        """A layer that reads another's K, V keeps none."""
        if self.shape.kv_source != self.layer:
            return None
        return super().new_state(max_len, batch, device, dtype)

    def cache_values(self, context: int, capped: bool = True) -> int:
        if self.shape.kv_source != self.layer:
            return 0
        return super().cache_values(context, capped)

    def __call__(self, x, w, pos, cache=None, trace=NO_TRACE, name="attn"):
        """x [B, T, D] -> [B, T, D]; what it read of K and V is left in `pos.more` for the
        layers that share them."""
        B, T, D = x.shape
        H, hd, s = self.n_heads, self.head_dim, self.shape
        turn = pos.more["local"] if s.kind == "sliding" else pos  # its kind's RoPE tables
        q = trace.record(f"{name}.q_proj", "x @ W_q^T", F.linear(x, w.q_proj),
                         B * T * D * H * hd)  # [B, T, H*hd]
        q = trace.record(f"{name}.q", f"split into {H} heads",
                         q.view(B, T, H, hd))  # [B, T, H, hd]
        q = rms_norm(q, w.q_norm, self.eps, trace, f"{name}.q_norm")  # [B, T, H, hd]
        q = apply_rope(q, turn.cos, turn.sin, trace, f"{name}.rope_q",
                       self.freq)  # [B, T, H, hd]
        if s.kv_source != self.layer:  # K, V as the source layer read them
            k, v = pos.more["kv", s.kv_source]  # [B, S, KV, hd]
            where = f"shared: layers.{s.kv_source}'s, read 0:{pos.start + T}"
            k = trace.record(f"{name}.kv_cache.k", f"K cache: {where}", k)
            v = trace.record(f"{name}.kv_cache.v", f"V cache: {where}", v)
        else:
            k, v = own_kv(x, w, s, self.eps, turn, trace, name)  # [B, T, KV, hd]
            k, v = self.read_cache(k, v, pos.start, cache, trace, name)  # [B, S, KV, hd]
        pos.more["kv", self.layer] = k, v
        out = self.attend(q, k, v, w, pos, trace, name)  # [B, H, T, hd]
        return self.output(out, w, trace, name)  # [B, T, D]


class Gemma4Block(Block):
    """Gemma 4's layer ends with what it adds after the MLP: its own per-layer input
    (`ple_size`), gated in by the stream, then the whole times the layer's scalar. `block`,
    the layer before that (a `gemma.SandwichBlock`)."""

    def __init__(self, block: Block, layer: int, ple: int, scalar: bool):
        """ple: the per-layer input's width (0: none); scalar: the layer's scalar."""
        self.block, self.attn, self.mlp = block, block.attn, block.mlp
        self.layer, self.ple, self.scalar, self.eps = layer, ple, scalar, block.eps
        self.hidden = block.hidden

    def parts(self):
        return (self.block,)

    def tensors(self):
        """What it reads after the block's: the per-layer input's gate, projection and norm,
        and the layer's scalar."""
        D, P = self.hidden, self.ple
        ple = {"ple_gate": ("per_layer_input_gate.weight", (P, D)),
               "ple_proj": ("per_layer_projection.weight", (D, P)),
               "ple_norm": ("post_per_layer_input_norm.weight", (D,))} if P else {}
        return {**ple, **({"layer_scalar": ("layer_scalar", (1,))} if self.scalar else {})}

    def __call__(self, x, w, pos, cache=None, trace=NO_TRACE, name="layers.0"):
        x = self.block(x, w, pos, cache, trace, name)  # [B, T, D]
        if self.ple:
            ple = pos.more["ple"][:, :, self.layer]  # [B, T, P]
            x = per_layer_residual(x, ple, w, self.eps, trace, name)  # [B, T, D]
        if self.scalar:
            x = layer_scaled(x, w.layer_scalar, trace, name)  # [B, T, D]
        return x


# --- per-layer inputs (PLE) ------------------------------------------------------------------
@dataclass
class PleWeights:
    """The model-level weights of the per-layer inputs."""
    table: torch.Tensor  # [V_ple, L*P]   embed_tokens_per_layer
    proj: torch.Tensor  # [L*P, D]        per_layer_model_projection
    norm: torch.Tensor  # [P]             per_layer_projection_norm


def per_layer_inputs(ids, x, w: PleWeights, n_layers: int, eps: float,
                     trace=NO_TRACE) -> torch.Tensor:
    """ids [B, T], x [B, T, D] (the scaled embedding) -> [B, T, L, P]: for each layer, the
    token's own row of the second table (times sqrt(P)) and a projection of x (times
    1/sqrt(D), normalized per layer), averaged in the sense of (a + b) / sqrt(2)."""
    B, T, D = x.shape
    LP = w.table.shape[1]
    P = LP // n_layers
    s = torch.tensor(P**0.5, dtype=w.table.dtype).item()  # in the table's dtype, as HF
    rows = trace.record("ple.embed", f"row lookup in embed_tokens_per_layer * sqrt({P})",
                        F.embedding(ids, w.table) * s)  # [B, T, L*P]
    rows = rows.view(B, T, n_layers, P)  # [B, T, L, P]
    proj = trace.record("ple.proj", f"x @ W_ple^T / sqrt({D})",
                        F.linear(x, w.proj) * D**-0.5, B * T * D * LP)  # [B, T, L*P]
    proj = rms_norm(proj.view(B, T, n_layers, P), w.norm, eps, trace,
                    "ple.proj_norm")  # [B, T, L, P]
    return trace.record("ple", "(ple.proj_norm + ple.embed) / sqrt(2)",
                        (proj + rows) * 2**-0.5)  # [B, T, L, P]


def per_layer_residual(x, ple, w, eps: float, trace=NO_TRACE,
                       name: str = "layers.0") -> torch.Tensor:
    """x [B, T, D], ple [B, T, P] (this layer's slice) -> x + norm(W_proj (gelu(W_gate x)
    * ple)): the stream chooses, per position, how much of its per-layer input comes in.
    w: per_layer_input_gate [P, D], per_layer_projection [D, P], post_per_layer_input_norm."""
    B, T, D = x.shape
    P = ple.shape[-1]
    g = trace.record(f"{name}.ple_gate", "x @ W_ple_gate^T",
                     F.linear(x, w.ple_gate), B * T * D * P)  # [B, T, P]
    g = trace.record(f"{name}.ple_act", "gelu_tanh(ple_gate)",
                     F.gelu(g, approximate="tanh"))  # [B, T, P]
    g = trace.record(f"{name}.ple_gated", "ple_act * ple[layer]", g * ple)  # [B, T, P]
    h = trace.record(f"{name}.ple_proj", "ple_gated @ W_ple_proj^T",
                     F.linear(g, w.ple_proj), B * T * P * D)  # [B, T, D]
    h = rms_norm(h, w.ple_norm, eps, trace, f"{name}.ple_norm")  # [B, T, D]
    return trace.record(f"{name}.resid_ple", "x + ple_norm(ple_proj)", x + h)  # [B, T, D]


def layer_scaled(x, scalar, trace=NO_TRACE, name: str = "layers.0") -> torch.Tensor:
    """x [B, T, D] times the layer's stored scalar [1] (`layer_scalar` on disk)."""
    return trace.record(f"{name}.layer_scaled", "x * layer_scalar", x * scalar)


def softcap(logits, cap: float, trace=NO_TRACE, name: str = "lm_head.softcap") -> torch.Tensor:
    """cap * tanh(logits / cap): logits near 0 unchanged, large ones squashed below cap
    (Gemma 4's final_logit_softcapping)."""
    return trace.record(name, f"{cap:g} * tanh(logits / {cap:g})",
                        cap * torch.tanh(logits / cap))  # [B, T, V]


def params_of_shapes(shapes: list[LayerShape], D: int, H: int) -> int:
    """Attention and MLP parameters of the layers (no norms), from shapes alone."""
    total = 0
    for i, s in enumerate(shapes):
        kv = 0 if s.kv_source != i else (1 if s.k_eq_v else 2) * s.n_kv_heads * s.head_dim
        total += D * (2 * H * s.head_dim + kv) + 3 * D * s.ffn_size
    return total


