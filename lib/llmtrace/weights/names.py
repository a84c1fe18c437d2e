"""The one table of the weights' names, beside the loaders that read them: each weight's Hugging
Face name and GGUF name, and the shape a config implies for it. Loaders, converters, shapes and
costs all read it.
"""

from __future__ import annotations

from ..config import Config
from ..errors import LlmTraceError
from ..mechanisms.gemma4 import config_layer_shapes
from ..mechanisms.moe import DEEPSEEK, HF_EXPERT_NAMES


# The one table of the weights' names. A layer's tensors: `LayerWeights` field -> (its Hugging Face
# name after "model.layers.N.", its GGUF name after "blk.N."); then the tensors outside the layers:
# `Weights` field -> (HF name, GGUF name). Loaders, converters, shapes and costs all read it.
LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", "attn_norm.weight"),
    "q_proj": ("self_attn.q_proj.weight", "attn_q.weight"),
    "k_proj": ("self_attn.k_proj.weight", "attn_k.weight"),
    "v_proj": ("self_attn.v_proj.weight", "attn_v.weight"),
    "o_proj": ("self_attn.o_proj.weight", "attn_output.weight"),
    "mlp_norm": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "gate": ("mlp.gate_proj.weight", "ffn_gate.weight"),
    "up": ("mlp.up_proj.weight", "ffn_up.weight"),
    "down": ("mlp.down_proj.weight", "ffn_down.weight"),
    # a family's extras, only in configs whose switch is on (`tensor_shapes`)
    "q_bias": ("self_attn.q_proj.bias", "attn_q.bias"),  # qkv_bias (Qwen2)
    "k_bias": ("self_attn.k_proj.bias", "attn_k.bias"),
    "v_bias": ("self_attn.v_proj.bias", "attn_v.bias"),
    "q_norm": ("self_attn.q_norm.weight", "attn_q_norm.weight"),  # qk_norm (Qwen3)
    "k_norm": ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    # Gemma 3's norms after each sublayer (`sandwich_norm`)
    "post_attn_norm": ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
    # gpt-oss: each head's sink logit (`attn_sinks`), the output projection's bias (`o_bias`)
    "sinks": ("self_attn.sinks", "attn_sinks.weight"),
    "o_bias": ("self_attn.o_proj.bias", "attn_output.bias"),
    # Gemma 4's per-layer inputs (`ple_size`) and layer scalar (llama.cpp's gemma3n names)
    "ple_gate": ("per_layer_input_gate.weight", "inp_gate.weight"),
    "ple_proj": ("per_layer_projection.weight", "proj.weight"),
    "ple_norm": ("post_per_layer_input_norm.weight", "post_norm.weight"),
    "layer_scalar": ("layer_scalar", "layer_output_scale.weight"),
}
# Multi-head latent attention (kv_lora_rank set): `mla.MlaWeights`' fields, held in
# LayerWeights.mla, in place of q_proj, k_proj, v_proj and o_proj
MLA_TENSORS = {
    "mla.q_proj": ("self_attn.q_proj.weight", "attn_q.weight"),  # without q_lora_rank
    "mla.q_a": ("self_attn.q_a_proj.weight", "attn_q_a.weight"),
    "mla.q_a_norm": ("self_attn.q_a_layernorm.weight", "attn_q_a_norm.weight"),
    "mla.q_b": ("self_attn.q_b_proj.weight", "attn_q_b.weight"),
    "mla.kv_a": ("self_attn.kv_a_proj_with_mqa.weight", "attn_kv_a_mqa.weight"),
    "mla.kv_a_norm": ("self_attn.kv_a_layernorm.weight", "attn_kv_a_norm.weight"),
    "mla.kv_b": ("self_attn.kv_b_proj.weight", "attn_kv_b.weight"),
    "mla.o_proj": ("self_attn.o_proj.weight", "attn_output.weight"),
}
# With a norm after each sublayer, HF's "post_attention_layernorm" is that norm after attention,
# and the norm before the MLP has a name of its own
SANDWICH_HF_NAMES = {"mlp_norm": "pre_feedforward_layernorm.weight"}
# Llama 4 calls its MLP the feed-forward block (its experts: `fused_expert_shapes`)
FAMILY_HF_NAMES = {"llama4_text": {f: f"feed_forward.{f}_proj.weight" for f in ("gate", "up",
                                                                             "down")}}
# A Gated DeltaNet layer (`layer_types` "linear", Qwen3-Next) has no self_attn tensors: its own,
# after "model.layers.N.linear_attn.", are read by `deltanet.hf_deltanet_weights`
ATTN_FIELDS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_bias", "k_bias", "v_bias", "q_norm",
               "k_norm")
LINEAR_PREFIX = "linear_attn."
# A mixture of experts' layer holds `LayerWeights.moe` (moe.MoeWeights) in place of gate, up and
# down: its tensors' shapes are named "moe.<MoeWeights field>", its HF names `moe_hf_names`
DENSE_MLP = ("gate", "up", "down")
# gpt-oss's experts (mlp_act "gpt_oss") have biases, router included, and are stored fused as
# HF's GptOssExperts holds them: gate and up interleaved on the last axis, each matrix x @ W
FUSED_EXPERTS = "gpt_oss"
STACKED = ("moe.gate", "moe.up", "moe.down")  # [E, ...]: one tensor per expert on disk
MODEL_TENSORS = {
    "embed": ("model.embed_tokens.weight", "token_embd.weight"),
    "final_norm": ("model.norm.weight", "output_norm.weight"),
    "lm_head": ("lm_head.weight", "output.weight"),
    # Gemma 4's per-layer inputs: a second table, and a projection of the embedded stream
    "ple_table": ("model.embed_tokens_per_layer.weight", "per_layer_token_embd.weight"),
    "ple_model_proj": ("model.per_layer_model_projection.weight", "per_layer_model_proj.weight"),
    "ple_model_norm": ("model.per_layer_projection_norm.weight", "per_layer_proj_norm.weight"),
}


def hf_name(field: str, layer: int | None = None, c: Config | None = None) -> str:
    """A weight's Hugging Face name: hf_name("q_proj", 3) is
    model.layers.3.self_attn.q_proj.weight. Give the config for a name that depends on it."""
    if layer is None:
        return MODEL_TENSORS[field][0]
    name = {**LAYER_TENSORS, **MLA_TENSORS}[field][0]
    if c is not None and c.sandwich_norm:
        name = SANDWICH_HF_NAMES.get(field, name)
    if c is not None:
        name = FAMILY_HF_NAMES.get(c.family, {}).get(field, name)
    return f"model.layers.{layer}.{name}"


def moe_hf_names(c: Config, layer: int) -> dict[str, str | list[str]]:
    """A MoE layer's Hugging Face names, as `save_pretrained` writes them (moe.hf_moe_weights
    reads the same): "moe.router" -> its name; "moe.gate", "moe.up", "moe.down" -> one name
    per expert (Mixtral: block_sparse_moe.experts.{e}.w1; Qwen3-MoE: mlp.experts.{e}.gate_proj)."""
    # DeepSeek: Qwen3-MoE's names, and its shared experts and router bias
    family = "qwen3_moe" if c.family in DEEPSEEK else c.family
    if family not in HF_EXPERT_NAMES:
        raise LlmTraceError(f"config {c.name!r}: family {c.family!r} has no mixture-of-experts "
                            f"weight names: n_experts is computed for "
                            f"{', '.join([*HF_EXPERT_NAMES, *DEEPSEEK])}")
    block, *kinds = HF_EXPERT_NAMES[family]
    p = f"model.layers.{layer}.{block}"
    names: dict = {"moe.router": f"{p}.gate.weight"}
    for field, kind in zip(DENSE_MLP, kinds):
        names[f"moe.{field}"] = [f"{p}.experts.{e}.{kind}.weight" for e in range(c.n_experts)]
    if c.shared_ffn_size:  # Qwen3-Next: one shared expert and its gate
        names.update({f"moe.shared.{f}": f"{p}.shared_expert.{f}_proj.weight" for f in DENSE_MLP})
        names["moe.shared_gate"] = f"{p}.shared_expert_gate.weight"
    if c.moe_router == "sigmoid_group":  # DeepSeek-V3's bias, for choosing only
        names["moe.score_bias"] = f"{p}.gate.e_score_correction_bias"
    if c.n_shared_experts:  # one dense MLP as wide as all the shared experts
        names.update({f"moe.shared.{f}": f"{p}.shared_experts.{f}_proj.weight"
                      for f in DENSE_MLP})
    return names


def fused_experts(c: Config) -> bool:
    """Does the checkpoint hold each MoE layer's experts fused, in one tensor per kind?"""
    return c.mlp_act == FUSED_EXPERTS or c.family == "llama4_text"


def fused_expert_shapes(c: Config, layer: int) -> dict[str, tuple[int, ...]]:
    """gpt-oss's or Llama 4's MoE layer as `save_pretrained` writes it (moe.hf_moe_weights
    reads it): each HF name and its shape on disk."""
    E, D, Fm = c.n_experts, c.hidden_size, c.moe_ffn_size
    if c.family == "llama4_text":  # gate | up side by side, no biases, one shared expert
        p, Fs = f"model.layers.{layer}.feed_forward", c.n_shared_experts * Fm
        shared = {f"{p}.shared_expert.{kind}_proj.weight": shape for kind, shape in
                  (("gate", (Fs, D)), ("up", (Fs, D)), ("down", (D, Fs)))} if Fs else {}
        return {f"{p}.router.weight": (E, D), f"{p}.experts.gate_up_proj": (E, D, 2 * Fm),
                f"{p}.experts.down_proj": (E, Fm, D), **shared}
    p = f"model.layers.{layer}.mlp"
    return {f"{p}.router.weight": (E, D), f"{p}.router.bias": (E,),
            f"{p}.experts.gate_up_proj": (E, D, 2 * Fm),  # g0 u0 g1 u1 ... on the last axis
            f"{p}.experts.gate_up_proj_bias": (E, 2 * Fm),
            f"{p}.experts.down_proj": (E, Fm, D), f"{p}.experts.down_proj_bias": (E, D)}


def layers_holding(c: Config, field: str) -> int:
    """How many copies of a field the model holds: 1 outside the layers; the dense MLP's in
    its dense layers only, a MoE field's in its MoE layers."""
    if field in MODEL_TENSORS:
        return 1
    moe = sum(c.is_moe(i) for i in range(c.n_layers))
    if field.startswith("moe."):
        return moe
    linear = sum(c.is_linear(i) for i in range(c.n_layers))  # Qwen3-Next's DeltaNet layers
    if field.startswith(LINEAR_PREFIX):
        return linear
    if field in ATTN_FIELDS:
        return c.n_layers - linear
    return c.n_layers - moe if field in DENSE_MLP else c.n_layers


def tensor_shapes(c: Config, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """The shape the config implies for each field of `Weights` and `LayerWeights` this config
    has, in model order: a tied LM head has no tensor of its own, a family's extras appear only
    when its switch is on. Layers alike but in Gemma 4 (`varied_layers`): those of `layer`."""
    D, hd, V, F = c.hidden_size, c.head_dim, c.vocab_size, c.ffn_size
    kv, own_k, own_v = c.kv_size, True, True
    if c.varied_layers:  # Gemma 4: this layer's head width, KV heads, MLP; shared: no K, V
        s = config_layer_shapes(c)[layer]
        hd, F, kv = s.head_dim, s.ffn_size, s.n_kv_heads * s.head_dim
        own_k = s.kv_source == layer
        own_v = own_k and not s.k_eq_v
    shapes = {"embed": (V, D), "attn_norm": (D,)} if c.pre_norm else {"embed": (V, D)}
    if c.linear_attn:  # Qwen3-Next: the DeltaNet layers' tensors
        shapes.update(linear_shapes(c))
    if c.ple_size:
        shapes.update(ple_table=(c.ple_vocab, c.n_layers * c.ple_size),
                      ple_model_proj=(c.n_layers * c.ple_size, D),
                      ple_model_norm=(c.ple_size,))
    q_rows = 2 * c.n_heads * hd if c.attn_output_gate else c.n_heads * hd  # + a gate per head
    if c.kv_lora_rank:
        shapes.update(mla_shapes(c))
    else:
        shapes["q_proj"] = (q_rows, D)
        if own_k:
            shapes["k_proj"] = (kv, D)
        if own_v:
            shapes["v_proj"] = (kv, D)
    if c.qkv_bias:
        shapes.update(q_bias=(c.n_heads * hd,), k_bias=(c.kv_size,), v_bias=(c.kv_size,))
    if c.qk_proj_norm:  # OLMo 2: one weight over the whole projection
        shapes.update(q_norm=(c.n_heads * hd,), k_norm=(c.kv_size,))
    if c.qk_norm:  # one weight per head dimension, shared by every head
        shapes.update(q_norm=(hd,), **({"k_norm": (hd,)} if own_k else {}))
    if not c.kv_lora_rank:
        shapes["o_proj"] = (D, c.n_heads * hd)
    if c.o_bias:  # gpt-oss
        shapes["o_bias"] = (D,)
    if c.attn_sinks:  # one logit per query head
        shapes["sinks"] = (c.n_heads,)
    if c.sandwich_norm:  # Gemma: a norm after attention
        shapes["post_attn_norm"] = (D,)
    if c.pre_norm:
        shapes["mlp_norm"] = (D,)
    if layers_holding(c, "gate"):  # some layer is dense
        shapes.update({"gate": (F, D), "up": (F, D), "down": (D, F)})
    if c.n_experts:  # stacked: expert e's matrix at [e]
        E, Fm = c.n_experts, c.moe_ffn_size
        shapes.update({"moe.router": (E, D), "moe.gate": (E, Fm, D), "moe.up": (E, Fm, D),
                       "moe.down": (E, D, Fm)})
        if c.mlp_act == FUSED_EXPERTS:  # gpt-oss: a bias on the router and on each matrix
            shapes.update({"moe.router_bias": (E,), "moe.gate_bias": (E, Fm),
                           "moe.up_bias": (E, Fm), "moe.down_bias": (E, D)})
        if c.shared_ffn_size:  # Qwen3-Next: a shared expert, gated per position
            Fs = c.shared_ffn_size
            shapes.update({"moe.shared.gate": (Fs, D), "moe.shared.up": (Fs, D),
                           "moe.shared.down": (D, Fs), "moe.shared_gate": (1, D)})
        if c.moe_router == "sigmoid_group":  # DeepSeek-V3: a bias for choosing only
            shapes["moe.score_bias"] = (E,)
        if c.n_shared_experts:  # DeepSeek: the shared experts, one dense MLP
            Fs = c.n_shared_experts * Fm
            shapes.update({"moe.shared.gate": (Fs, D), "moe.shared.up": (Fs, D),
                           "moe.shared.down": (D, Fs)})
    if c.sandwich_norm:  # and after the MLP
        shapes["post_mlp_norm"] = (D,)
    if c.ple_size:  # Gemma 4: each layer gates its per-layer input in
        shapes.update(ple_gate=(c.ple_size, D), ple_proj=(D, c.ple_size),
                      ple_norm=(D,))
    if c.layer_scalar:
        shapes["layer_scalar"] = (1,)
    shapes["final_norm"] = (D,)
    if not c.tied_lm_head:
        shapes["lm_head"] = (V, D)
    return shapes


def linear_shapes(c: Config) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors (`deltanet.DeltaNetWeights`) by their HF names."""
    d, D = c.deltanet_dims, c.hidden_size
    fused = {"in_proj_qkvz.weight": (2 * d.key_dim + 2 * d.value_dim, D),
             "in_proj_ba.weight": (2 * d.n_v_heads, D)}  # Qwen3-Next, grouped per key head
    apart = {"in_proj_qkv.weight": (d.conv_dim, D), "in_proj_z.weight": (d.value_dim, D),
             "in_proj_b.weight": (d.n_v_heads, D), "in_proj_a.weight": (d.n_v_heads, D)}
    projections = {"qwen3_5_text": apart}.get(c.family, fused)  # Qwen3.5 stores them apart
    return {f"{LINEAR_PREFIX}{name}": shape for name, shape in {
        "A_log": (d.n_v_heads,), "dt_bias": (d.n_v_heads,),
        "conv1d.weight": (d.conv_dim, 1, d.conv_kernel), **projections,
        "norm.weight": (d.v_head_dim,), "out_proj.weight": (D, d.value_dim)}.items()}


def layer_fields(c: Config, layer: int, shapes: dict) -> list[str]:
    """The fields of `shapes` (`tensor_shapes`) that this layer has: a DeltaNet layer has its
    linear_attn tensors in place of attention's, a full layer the reverse."""
    linear, moe = c.is_linear(layer), c.is_moe(layer)
    own = [f for f in shapes if f.startswith(LINEAR_PREFIX)] if linear else []
    return [f for f in {**LAYER_TENSORS, **MLA_TENSORS} if f in shapes
            and not (moe and f in DENSE_MLP) and not (linear and f in ATTN_FIELDS)] + own


def mla_shapes(c: Config) -> dict[str, tuple[int, ...]]:
    """Latent attention's weights (`mla.MlaWeights`): R kv_lora_rank, Rq q_lora_rank, each
    head's query and key [dn | dr] (dr is head_dim), its value dv."""
    D, H, R, Rq = c.hidden_size, c.n_heads, c.kv_lora_rank, c.q_lora_rank
    dq, dn, dv = c.qk_nope_head_dim + c.head_dim, c.qk_nope_head_dim, c.v_head_dim
    q = ({"mla.q_a": (Rq, D), "mla.q_a_norm": (Rq,), "mla.q_b": (H * dq, Rq)} if Rq
         else {"mla.q_proj": (H * dq, D)})
    return {**q, "mla.kv_a": (R + c.head_dim, D), "mla.kv_a_norm": (R,),
            "mla.kv_b": (H * (dn + dv), R), "mla.o_proj": (D, H * dv)}


def expected_shapes(c: Config) -> dict[str, tuple[int, ...]]:
    """Every weight's Hugging Face name and the shape the config implies."""
    shapes = tensor_shapes(c)
    out = {hf_name(f): shapes[f] for f in MODEL_TENSORS if f in shapes}
    for i in range(c.n_layers):
        shapes = tensor_shapes(c, i) if c.varied_layers else shapes
        moe = c.is_moe(i)
        out.update({(f"model.layers.{i}.{f}" if f.startswith(LINEAR_PREFIX)
                     else hf_name(f, i, c)): shapes[f] for f in layer_fields(c, i, shapes)})
        if moe and fused_experts(c):  # gpt-oss, Llama 4: every expert in one tensor
            out.update(fused_expert_shapes(c, i))
        elif moe:  # each expert's matrix under its own name
            for field, names in moe_hf_names(c, i).items():
                for name in [names] if isinstance(names, str) else names:
                    out[name] = shapes[field][1:] if field in STACKED else shapes[field]
    return out
