"""Qwen3-MoE: Qwen3's attention (QK-norm) and a mixture of experts: a softmax over the router's
logits, the top k of E experts, their weights renormalized only if `norm_topk_prob`; layers in
`mlp_only_layers`, or off the `decoder_sparse_step` beat, keep a dense MLP."""

from ..errors import LlmTraceError
from . import Family
from ._read import HFKeys, plain_rope
from .qwen2 import DEFAULTS as QWEN2
from ._parts import mlp_of
from .qwen3 import Qwen3

# Qwen3MoeConfig's defaults (transformers 5.24, models/qwen3_moe/configuration_qwen3_moe.py);
# it has no head_dim key: the attention takes hidden_size // num_attention_heads unless given
DEFAULTS = {**QWEN2, "num_key_value_heads": 4, "rms_norm_eps": 1e-6, "head_dim": None,
            "use_sliding_window": False, "sliding_window": 4096, "num_experts": 128,
            "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
            "decoder_sparse_step": 1, "mlp_only_layers": None}


def experts_of(k: HFKeys) -> int:
    """E, from `num_experts` (the hub's config.json) or `num_local_experts` (what 5.24's
    save_pretrained writes: HF maps one to the other); both given, they must agree."""
    given = {key: k.get(key, int, least=0) for key in ("num_experts", "num_local_experts")
             if key in k.c}
    if len(set(given.values())) > 1:
        raise LlmTraceError(f"{k.where}: num_experts={given['num_experts']} and "
                            f"num_local_experts={given['num_local_experts']} disagree: keep one")
    return next(iter(given.values())) if given else k.default("num_experts", int)


def mlp_types_of(k: HFKeys, E: int) -> tuple:
    """Each layer's MLP, as Qwen3MoeDecoderLayer decides: MoE when the layer is not in
    mlp_only_layers and (layer + 1) is a multiple of decoder_sparse_step; () when all are."""
    n = k.get("num_hidden_layers", int)
    step = k.default("decoder_sparse_step", int, least=1)
    only = k.c.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in only):
        raise LlmTraceError(f"{k.where}: mlp_only_layers must list layer indices 0 .. {n - 1}, "
                            f"got {k.c['mlp_only_layers']!r:.60}")
    kinds = tuple("moe" if i not in only and (i + 1) % step == 0 else "dense" for i in range(n))
    return () if E and "dense" not in kinds else kinds if E else ()


def read(k: HFKeys) -> dict:
    E = experts_of(k)
    windowed = k.default("use_sliding_window", bool)
    window = k.default("sliding_window", int, least=1) if windowed else None
    moe = dict(n_experts=E, n_experts_active=k.default("num_experts_per_tok", int, least=1),
               moe_ffn_size=k.default("moe_intermediate_size", int, least=1),
               moe_renormalize=k.default("norm_topk_prob", bool)) if E else {}
    return dict(**plain_rope(k), **moe, mlp_types=mlp_types_of(k, E),
                sliding_window=window or 0)  # HF: a window on every layer, or none


def write(c, hf: dict) -> dict:
    step, only = 1, []
    if c.mlp_types:  # the dense layers as mlp_only_layers, which says any pattern
        only = [i for i, t in enumerate(c.mlp_types) if t == "dense"]
    return {**hf, "num_experts": c.n_experts, "num_experts_per_tok": c.n_experts_active or 1,
            "moe_intermediate_size": c.moe_ffn_size or 1, "norm_topk_prob": c.moe_renormalize,
            "decoder_sparse_step": step, "mlp_only_layers": only,
            "use_sliding_window": bool(c.sliding_window),
            "sliding_window": c.sliding_window or None}


FAMILY = Family("qwen3_moe", "Qwen3-MoE", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", DEFAULTS,
                switches={"qk_norm": True, "moe_router": "softmax_topk"},
                varies=("sliding_window", "n_experts", "n_experts_active", "moe_ffn_size",
                        "moe_renormalize", "mlp_types"),
                read=read, write=write, biased=("attention_bias",),
                keys={"n_experts": "num_experts", "n_experts_active": "num_experts_per_tok",
                      "moe_ffn_size": "moe_intermediate_size",
                      "moe_renormalize": "norm_topk_prob", "mlp_types": "mlp_only_layers"})


class Qwen3Moe(Qwen3, family="qwen3_moe"):
    """Qwen3 with a mixture of experts in the MLP of each layer the config says."""

    def mlp(self, i):
        return mlp_of(self.config, i)
