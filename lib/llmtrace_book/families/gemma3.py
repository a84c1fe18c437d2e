"""Gemma 3, text only: norms after each sublayer too, weights stored around 0, GeGLU, a scaled
embedding, sliding layers with a RoPE base of their own, scores scaled by query_pre_attn_scalar."""

import math

from ..errors import LlmTraceError
from . import Family
from ._read import HFKeys, rope_theta_of
from ..attention import Attention
from ..mechanisms import part
from ..mechanisms.attention_steps import HeadNormed, OwnBase, Scaled
from ..mechanisms.gemma import OffsetNorm, SandwichBlock, scaled_embed
from ..model import Model
from ..embed import embed
from ._parts import mlp_of, norm_of, positions_of, window

WITH_VISION = ("model_type 'gemma3' (Gemma 3 with its vision tower) is not implemented: use a "
               "text-only Gemma 3 (gemma3_text, e.g. gemma-3-270m or gemma-3-1b)")

HF_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}
# what Gemma3ForCausalLM always computes; the other Gemma switches vary by model
GEMMA3_FIXED = dict(norm_offset=True, sandwich_norm=True, mlp_act="gelu_tanh", embed_scale=True)


def gemma3_switches(k: HFKeys) -> dict:
    """Gemma 3's switches from its config.json, read as transformers' Gemma3TextConfig reads them:
    the kind of each layer (`layer_types`, or in older files every `sliding_window_pattern`-th
    layer full), and a RoPE base per kind (`rope_parameters` keyed by layer kind in
    transformers 5.x; `rope_theta` and `rope_local_base_freq` in older files)."""
    c, where = k.c, k.where
    if c.get("use_bidirectional_attention"):
        raise LlmTraceError(f"{where}: use_bidirectional_attention=true (tokens see later ones) "
                            f"is not implemented: llmtrace computes causal decoders")
    act = c.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise LlmTraceError(f"{where}: hidden_activation {act!r} is not "
                            f"implemented: Gemma 3's MLP is GeGLU with gelu_pytorch_tanh")
    n, kinds = k.get("num_hidden_layers", int), c.get("layer_types")
    if kinds is None:
        period = k.get("sliding_window_pattern", int, 6, least=1)
        kinds = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                 for i in range(n)]
    if not isinstance(kinds, list) or any(k not in HF_LAYER_KINDS for k in kinds):
        raise LlmTraceError(f"{where}: layer_types must list 'full_attention' or "
                            f"'sliding_attention' per layer, got {kinds!r:.80}")
    rope = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
    if "rope_theta" in rope or "rope_type" in rope:
        raise LlmTraceError(f"{where}: Gemma 3's rope_parameters are keyed by layer kind "
                            f"(full_attention, sliding_attention), got {rope!r:.60}")
    full, local = rope.get("full_attention"), rope.get("sliding_attention")
    for kind, params in (("full_attention", full), ("sliding_attention", local)):
        if isinstance(params, dict) and params.get("rope_type", "default") != "default":
            raise LlmTraceError(f"{where}: rope_parameters of {kind} have rope_type "
                                f"{params['rope_type']!r}, not implemented for Gemma 3: "
                                f"only plain RoPE (as gemma-3-270m and gemma-3-1b use)")
    if c.get("rope_scaling"):  # older files: it scales the full-attention layers' RoPE
        raise LlmTraceError(f"{where}: rope_scaling {c['rope_scaling']!r:.60} is not "
                            f"implemented for Gemma 3: only plain RoPE")
    theta = rope_theta_of(k, {"rope_parameters.full_attention.rope_theta": (full, "rope_theta"),
                              "rope_theta": (c, "rope_theta")})
    local_theta = rope_theta_of(
        k, {"rope_parameters.sliding_attention.rope_theta": (local, "rope_theta"),
            "rope_local_base_freq": (c, "rope_local_base_freq")}, "rope_local_base_freq")
    scalar = k.default("query_pre_attn_scalar", float)
    if not (math.isfinite(scalar) and scalar > 0):
        raise LlmTraceError(f"{where}: query_pre_attn_scalar={scalar!r} must be a positive "
                            f"number (scores are divided by its square root; Gemma 3's is "
                            f"its head_dim, 256)")
    window = k.default("sliding_window", int, least=1)
    return dict(sliding_window=0 if window is None else window,
                attn_scale=float(scalar) ** -0.5,
                layer_types=tuple(HF_LAYER_KINDS[k] for k in kinds),
                rope_theta=theta, rope_local_theta=local_theta)


def gemma3_to_hf(c, hf: dict) -> dict:
    """A Llama config.json made into Gemma3TextConfig's."""
    for key in ("hidden_act", "mlp_bias", "rope_theta"):
        hf.pop(key)
    kinds = {v: k for k, v in HF_LAYER_KINDS.items()}
    return {**hf, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": round(c.attn_scale ** -2) if c.attn_scale else c.head_dim,
            "layer_types": [kinds[t] for t in c.layer_types or ("full",) * c.n_layers],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": c.rope_local_theta or c.rope_theta}},
            "sliding_window": c.sliding_window or None,
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "use_bidirectional_attention": False}

FAMILY = Family("gemma3_text", "Gemma 3", "Gemma3ForCausalLM", "Gemma3TextConfig",
                {"rms_norm_eps": 1e-6, "tie_word_embeddings": True, "head_dim": 256,
                 "rope_theta": 1_000_000.0, "num_key_value_heads": 4,
                 "max_position_embeddings": 131072, "bos_token_id": 2, "eos_token_id": 1,
                 "pad_token_id": 0, "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256,
                 "sliding_window": 4096},
                switches={"qk_norm": True, **GEMMA3_FIXED},
                varies=("sliding_window", "attn_scale", "layer_types", "rope_local_theta"),
                read=gemma3_switches, write=gemma3_to_hf, biased=("attention_bias",),
                not_null=("num_key_value_heads", "head_dim"))


class Gemma3(Model, family="gemma3_text"):
    """Llama with Gemma's norms (1 + weight, and after each sublayer too), GeGLU, a scaled
    embedding, scores scaled by query_pre_attn_scalar, QK-norm, and sliding layers that turn
    at a RoPE base of their own."""

    def __init__(self, config, *args, **kwargs):
        self.norm = norm_of(config)
        super().__init__(config, *args, **kwargs)

    def block(self, i):
        c = self.config
        if not c.sandwich_norm:
            return super().block(i)
        return SandwichBlock(self.attention(i), self.mlp(i), c, self.norm, c.pre_norm)

    def attention(self, i):
        c = self.config
        own_base = c.layer_types and c.rope_local_theta and c.rope_local_theta != c.rope_theta
        return part(c.qk_norm and c.norm_offset and OffsetNorm, c.qk_norm and HeadNormed,
                    own_base and OwnBase, c.attn_scale and Scaled, window(c, i),
                    Attention)(c, i)

    def mlp(self, i):
        return mlp_of(self.config, i)

    def positions(self, start, T):
        return positions_of(self, start, T)

    def embed(self, ids, trace):
        table = self.weights.embed
        return scaled_embed(ids, table, trace) if self.config.embed_scale else embed(
            ids, table, trace)
