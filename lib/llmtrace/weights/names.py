"""The one table of the weights' names, beside the loaders that read them: each weight's Hugging
Face name and GGUF name, and the shape a config implies for it. Loaders, converters, shapes and
costs all read it.
"""

from __future__ import annotations

from ..config import Config
from ..errors import LlmTraceError


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
# A mixture of experts' layer holds `LayerWeights.moe` (moe.MoeWeights) in place of gate, up and
# down: its tensors' shapes are named "moe.<MoeWeights field>", its HF names `moe_hf_names`
DENSE_MLP = ("gate", "up", "down")
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
    return f"model.layers.{layer}.{name}"


def moe_hf_names(c: Config, layer: int) -> dict[str, str | list[str]]:
    """A MoE layer's Hugging Face names, as `save_pretrained` writes them (moe.hf_moe_weights
    reads the same): "moe.router" -> its name; "moe.gate", "moe.up", "moe.down" -> one name
    per expert (Mixtral: block_sparse_moe.experts.{e}.w1; Qwen3-MoE: mlp.experts.{e}.gate_proj)."""
    from ..moe import DEEPSEEK, HF_EXPERT_NAMES

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
    if c.moe_router == "sigmoid_group":  # DeepSeek-V3's bias, for choosing only
        names["moe.score_bias"] = f"{p}.gate.e_score_correction_bias"
    if c.n_shared_experts:  # one dense MLP as wide as all the shared experts
        names.update({f"moe.shared.{f}": f"{p}.shared_experts.{f}_proj.weight"
                      for f in DENSE_MLP})
    return names


def layers_holding(c: Config, field: str) -> int:
    """How many copies of a field the model holds: 1 outside the layers; the dense MLP's in
    its dense layers only, a MoE field's in its MoE layers."""
    if field in MODEL_TENSORS:
        return 1
    moe = sum(c.is_moe(i) for i in range(c.n_layers))
    if field.startswith("moe."):
        return moe
    return c.n_layers - moe if field in DENSE_MLP else c.n_layers


def tensor_shapes(c: Config, layer: int = 0) -> dict[str, tuple[int, ...]]:
    """The shape the config implies for each field of `Weights` and `LayerWeights` this config
    has, in model order: a tied LM head has no tensor of its own, a family's extras appear only
    when its switch is on. Layers alike but in Gemma 4 (`varied_layers`): those of `layer`."""
    D, hd, V, F = c.hidden_size, c.head_dim, c.vocab_size, c.ffn_size
    kv, own_k, own_v = c.kv_size, True, True
    if c.varied_layers:  # Gemma 4: this layer's head width, KV heads, MLP; shared: no K, V
        from ..gemma4 import config_layer_shapes

        s = config_layer_shapes(c)[layer]
        hd, F, kv = s.head_dim, s.ffn_size, s.n_kv_heads * s.head_dim
        own_k = s.kv_source == layer
        own_v = own_k and not s.k_eq_v
    shapes = {"embed": (V, D), "attn_norm": (D,)} if c.pre_norm else {"embed": (V, D)}
    if c.ple_size:
        shapes.update(ple_table=(c.ple_vocab, c.n_layers * c.ple_size),
                      ple_model_proj=(c.n_layers * c.ple_size, D),
                      ple_model_norm=(c.ple_size,))
    if c.kv_lora_rank:
        shapes.update(mla_shapes(c))
    else:
        shapes["q_proj"] = (c.n_heads * hd, D)
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
        out.update({hf_name(f, i, c): shapes[f] for f in {**LAYER_TENSORS, **MLA_TENSORS}
                    if f in shapes and not (moe and f in DENSE_MLP)})
        if moe:  # each expert's matrix under its own name
            for field, names in moe_hf_names(c, i).items():
                for name in [names] if isinstance(names, str) else names:
                    out[name] = shapes[field][1:] if field in STACKED else shapes[field]
    return out
