"""Gemma 4, text only (Gemma4ForCausalLM): Gemma 3's block with norms that multiply by their
weight, V normalized, scores not scaled, wider heads and partial RoPE on the full layers, the
last layers reading earlier layers' K and V, per-layer inputs, a scalar per layer and soft-capped
logits. What each computes: gemma4.py. Its MoE variant (enable_moe_block) is refused by that
key (families.refuse_unsupported), its towers by theirs (gemma4.refuse_unsupported)."""

import torch

from ..attention import Positions
from ..check import check_ids
from ..embed import embed
from ..errors import LlmTraceError
from ..mechanisms import part
from ..mechanisms.attention_steps import Scaled
from ..mechanisms.gemma import GeGLU, SandwichBlock, scaled_embed
from ..mechanisms.gemma4 import (Gemma4Attention, Gemma4Block, PleWeights, config_layer_shapes,
                                 per_layer_inputs, proportional_cos_sin, softcap)
from ..mlp import MLP
from ..model import Model
from ..rope import rope_cos_sin
from ..trace import NO_TRACE
from ._parts import norm_of, window
from ..mechanisms.gemma4 import layer_kinds, refuse_unsupported, rope_settings
from . import Family
from ._read import HFKeys
from .gemma3 import HF_LAYER_KINDS

WITH_TOWERS = ("model_type 'gemma4' (Gemma 4 with its towers: vision_config, audio_config) "
               "is not implemented: use its text_config alone (gemma4_text), with the weights "
               "under model.language_model.")
# what Gemma4ForCausalLM always computes; the other switches vary by model
GEMMA4_FIXED = dict(qk_norm=True, norm_offset=False, sandwich_norm=True, mlp_act="gelu_tanh",
                    embed_scale=True, attn_scale=1.0, v_norm=True, layer_scalar=True)
# HF's default rope_parameters (Gemma4TextConfig.__post_init__)
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}


def full_layer_shape(k: HFKeys, kinds: list[str]) -> tuple[int, int]:
    """(global_head_dim, global_kv_heads) of the full layers: from `per_layer_config` (as
    save_pretrained writes it: a full layer's values that differ from the global ones, {} when
    none does), else `global_head_dim`, `num_global_key_value_heads`."""
    c, where = k.c, k.where
    k_eq_v = k.default("attention_k_eq_v", bool)
    per = c.get("per_layer_config")
    if per is None:
        kv = k.get("num_global_key_value_heads", int, None, least=1) if k_eq_v else None
        return k.get("global_head_dim", int, 512, least=2), kv or 0
    full = [i for i, t in enumerate(layer_kinds(kinds)) if t == "full"]
    # keyed by layer: 2, "2" or, as HF's to_dict writes them, "02"; a layer left out keeps the
    # global head_dim and num_key_value_heads (HF drops an override equal to them)
    if not isinstance(per, dict) or not all(str(i).isdigit() and int(i) in full
                                            and isinstance(v, dict) for i, v in per.items()):
        raise LlmTraceError(f"{where}: per_layer_config must map full layers "
                            f"({', '.join(map(str, full))}) to their shape, got {per!r:.60}")
    per = {int(i): v for i, v in per.items()}
    k.keys.update(global_head_dim="per_layer_config.head_dim",  # what errors name
                  global_kv_heads="per_layer_config.num_key_value_heads")
    head_dim = k.default("head_dim", int, least=2)
    shapes = {(per.get(i, {}).get("head_dim", head_dim),
               per.get(i, {}).get("num_key_value_heads", 0)) for i in full}
    if len(shapes) > 1 or set().union(*map(set, per.values())) - {"head_dim",
                                                                  "num_key_value_heads"}:
        raise LlmTraceError(f"{where}: per_layer_config gives the full layers different "
                            f"shapes, which is not implemented: {per!r:.80}")
    return next(iter(shapes))


def gemma4_switches(k: HFKeys) -> dict:
    """Gemma 4's fields from its config.json, read as transformers' Gemma4TextConfig."""
    c, where = k.c, k.where
    act = c.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise LlmTraceError(f"{where}: hidden_activation {act!r} is not implemented: "
                            f"Gemma 4's MLP is GeGLU with gelu_pytorch_tanh")
    n = k.get("num_hidden_layers", int)
    kinds = c.get("layer_types")
    if kinds is None:  # HF's default: every 6th layer full, and the last
        kinds = ["full_attention" if (i + 1) % 6 == 0 or i == n - 1 else "sliding_attention"
                 for i in range(n)]
    if not isinstance(kinds, list) or any(t not in HF_LAYER_KINDS for t in kinds):
        raise LlmTraceError(f"{where}: layer_types must list 'full_attention' or "
                            f"'sliding_attention' per layer, got {kinds!r:.80}")
    if kinds and kinds[-1] != "full_attention":
        raise LlmTraceError(f"{where}: layer_types ends with {kinds[-1]!r}; HF's "
                            f"Gemma4TextConfig makes the last layer full: write it so")
    rope = c.get("rope_parameters")
    rope = DEFAULT_ROPE if rope is None else rope
    if not isinstance(rope, dict) or any(f"{t}_attention" not in rope
                                         for t in set(layer_kinds(kinds))):
        raise LlmTraceError(f"{where}: Gemma 4's rope_parameters are keyed by layer kind "
                            f"(full_attention, sliding_attention), got {rope!r:.60}")
    rotary = rope_settings({"layer_types": kinds, "rope_parameters": rope})
    full_dim, full_kv = full_layer_shape(k, kinds)
    window = k.default("sliding_window", int, least=1)
    ple = k.default("hidden_size_per_layer_input", int)
    shared = k.default("num_kv_shared_layers", int)
    cap = k.get("final_logit_softcapping", float, None)
    if cap is not None and not cap > 0:
        raise LlmTraceError(f"{where}: final_logit_softcapping={cap!r} must be positive, or "
                            f"null for none")
    theta, fraction = rotary.get("full", (1e6, 1.0))
    local = rotary.get("sliding", (theta, 1.0))[0]
    return dict(sliding_window=window, layer_types=tuple(HF_LAYER_KINDS[t] for t in kinds),
                rope_theta=theta, rope_local_theta=local, rope_partial=fraction,
                global_head_dim=full_dim, global_kv_heads=full_kv,
                k_eq_v=k.default("attention_k_eq_v", bool), kv_shared_layers=shared,
                double_wide_mlp=k.default("use_double_wide_mlp", bool), ple_size=ple,
                ple_vocab=k.default("vocab_size_per_layer_input", int) if ple else 0,
                final_softcap=float(cap or 0.0))


def gemma4_to_hf(c, hf: dict) -> dict:
    """A Llama config.json made into Gemma4TextConfig's."""
    for key in ("hidden_act", "mlp_bias", "rope_theta"):
        hf.pop(key)
    kinds = {v: k for k, v in HF_LAYER_KINDS.items()}
    layers = c.layer_types or ("full",) * c.n_layers
    full = {"rope_type": "proportional", "rope_theta": c.rope_theta,
            "partial_rotary_factor": c.rope_partial}
    # the full layers' shape as save_pretrained writes it: HF reads its KV heads there with or
    # without attention_k_eq_v (num_global_key_value_heads only with it)
    shape = {"head_dim": c.global_head_dim or c.head_dim,
             **({"num_key_value_heads": c.global_kv_heads} if c.global_kv_heads else {})}
    return {**hf, "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
            "hidden_activation": "gelu_pytorch_tanh",
            "layer_types": [kinds[t] for t in layers],
            "rope_parameters": {
                "full_attention": full,
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": c.rope_local_theta or c.rope_theta}},
            "sliding_window": c.sliding_window or 512,
            "per_layer_config": {str(i): shape for i, t in enumerate(layers) if t == "full"},
            "attention_k_eq_v": c.k_eq_v, "num_kv_shared_layers": c.kv_shared_layers,
            "use_double_wide_mlp": c.double_wide_mlp,
            "hidden_size_per_layer_input": c.ple_size,
            "vocab_size_per_layer_input": c.ple_vocab or c.vocab_size,
            "final_logit_softcapping": c.final_softcap or None,
            "enable_moe_block": False, "use_bidirectional_attention": None}


FAMILY = Family("gemma4_text", "Gemma 4", "Gemma4ForCausalLM", "Gemma4TextConfig",
                {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "head_dim": 256,
                 "num_key_value_heads": 4, "max_position_embeddings": 131072,
                 "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "sliding_window": 512,
                 "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144,
                 "attention_k_eq_v": False, "num_kv_shared_layers": 0,
                 "use_double_wide_mlp": False},
                switches=GEMMA4_FIXED,
                varies=("sliding_window", "layer_types", "rope_local_theta", "rope_partial",
                        "global_head_dim", "global_kv_heads", "k_eq_v", "kv_shared_layers",
                        "double_wide_mlp", "ple_size", "ple_vocab", "final_softcap"),
                read=gemma4_switches, write=gemma4_to_hf, refuse=refuse_unsupported,
                biased=("attention_bias",), not_null=("num_key_value_heads", "head_dim"),
                keys={"global_kv_heads": "num_global_key_value_heads",
                      "k_eq_v": "attention_k_eq_v", "kv_shared_layers": "num_kv_shared_layers",
                      "double_wide_mlp": "use_double_wide_mlp",
                      "ple_size": "hidden_size_per_layer_input",
                      "ple_vocab": "vocab_size_per_layer_input",
                      "final_softcap": "final_logit_softcapping",
                      "rope_theta": "rope_parameters.full_attention.rope_theta",
                      "rope_partial": "rope_parameters.full_attention.partial_rotary_factor",
                      "rope_local_theta": "rope_parameters.sliding_attention.rope_theta"})


class Gemma4(Model, family="gemma4_text"):
    """Gemma 3's block (norms after each sublayer, GeGLU, a scaled embedding) with layers of two
    shapes, the last layers reading earlier layers' K and V (`mechanisms.gemma4`), per-layer
    inputs, a scalar per layer, and soft-capped logits."""

    def __init__(self, config, *args, **kwargs):
        self.norm = norm_of(config)
        super().__init__(config, *args, **kwargs)

    def block(self, i):
        c = self.config
        inner = SandwichBlock(self.attention(i), self.mlp(i), c, self.norm)
        return Gemma4Block(inner, i, c.ple_size, c.layer_scalar)

    def attention(self, i):
        c = self.config
        return part(c.attn_scale and Scaled, window(c, i), Gemma4Attention)(c, i)

    def mlp(self, i):
        """GeGLU (its mlp_act), as wide as its layer (twice on shared layers, with
        use_double_wide_mlp)."""
        c = self.config
        mlp = GeGLU if c.mlp_act == "gelu_tanh" else MLP
        return mlp(c.hidden_size, config_layer_shapes(c)[i].ffn_size)

    def positions(self, start, T):
        """Full layers turn part of each wider head (`proportional_cos_sin`); sliding layers
        their own heads at their own base (`pos.more["local"]`)."""
        c = self.config
        if start + T > c.max_positions:
            return Positions.of(start, T, c)  # its error
        p = torch.arange(start, start + T, device=self.device)  # [T]
        cos, sin = proportional_cos_sin(p, c.global_head_dim or c.head_dim, c.rope_theta,
                                        c.rope_partial)  # [T, hd_full] each
        pos = Positions.of(start, T, c, self.device, lambda *_: (cos, sin))
        local = pos
        if c.rope_local_theta:
            local = Positions(start, *rope_cos_sin(p, c.head_dim, c.rope_local_theta),
                              pos.mask, pos.more)
        pos.more["local"] = local
        return pos

    def tensors(self):
        """Llama's tables, and the per-layer inputs' table, projection and norm."""
        c = self.config
        D, P, LP = c.hidden_size, c.ple_size, c.n_layers * c.ple_size
        ple = {"ple_table": ("model.embed_tokens_per_layer.weight", (c.ple_vocab, LP)),
               "ple_model_proj": ("model.per_layer_model_projection.weight", (LP, D)),
               "ple_model_norm": ("model.per_layer_projection_norm.weight", (P,))}
        return {**super().tensors(), **(ple if P else {})}

    def embed(self, ids, trace=NO_TRACE):
        table = self.weights.embed
        return scaled_embed(ids, table, trace) if self.config.embed_scale else embed(
            ids, table, trace)

    def forward(self, ids, trace=NO_TRACE, cache=None, start=0, grad=False):
        """Llama's pass, with each layer's small input computed after the embedding."""
        with torch.inference_mode(not grad):
            c, w = self.config, self.weights
            ids = check_ids(ids, c.vocab_size, batch=True).to(self.device)  # [B, T]
            pos = self.positions(start, ids.shape[1]).to(self.dtype)
            x = self.embed(ids, trace)  # [B, T, D]
            if c.ple_size:  # a small input for each layer, from the ids and x
                pos.more["ple"] = per_layer_inputs(
                    ids, x, PleWeights(w.ple_table, w.ple_model_proj, w.ple_model_norm),
                    c.n_layers, c.norm_eps, trace)  # [B, T, L, P]
            for i, (block, lw) in enumerate(zip(self.blocks, w.layers)):
                x = block(x, lw, pos, None if cache is None else cache[i], trace,
                          f"layers.{i}")  # [B, T, D]
            return self.head(x, trace)  # [B, T, V]

    def head(self, x, trace=NO_TRACE):
        logits = super().head(x, trace)  # [..., V]
        cap = self.config.final_softcap
        return softcap(logits, cap, trace) if cap else logits  # [..., V]

