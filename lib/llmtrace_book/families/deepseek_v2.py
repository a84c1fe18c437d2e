"""DeepSeek-V2 (as V2-Lite): V3's latent attention with one q_proj where V3 has a latent of
the queries (q_lora_rank null), RoPE always on adjacent pairs, and a softmax router over the
experts (top-k, never renormalized) beside the shared experts."""

from ..errors import LlmTraceError
from . import Family
from ._read import HFKeys, plain_rope
from .deepseek_v3 import (DEFAULTS as V3, KEYS, MLA_VARIES, MOE_VARIES, DeepseekV3,
                          mla_fields, mla_hf, moe_fields, refuse_settings)

# DeepseekV2Config's defaults (transformers 5.24) where they differ from V3's
DEFAULTS = {**V3, "num_key_value_heads": None, "max_position_embeddings": 2048,
            "bos_token_id": 1, "eos_token_id": 2, "first_k_dense_replace": 0,
            "n_routed_experts": 64, "num_experts_per_tok": None, "moe_intermediate_size": 1407,
            "n_shared_experts": 2, "routed_scaling_factor": 1.0, "norm_topk_prob": False}


def read(k: HFKeys) -> dict:
    refuse_settings(k.c, k.where, {"topk_method": (None, "greedy"),
                                   "scoring_func": (None, "softmax"), "moe_layer_freq": (1,)})
    if k.c.get("rope_interleave") is False:  # HF's V2 class turns adjacent pairs always
        raise LlmTraceError(f"{k.where}: rope_interleave=false is not what "
                            f"DeepseekV2ForCausalLM computes (it turns adjacent pairs): "
                            f"remove it, or use model_type deepseek_v3")
    if k.c.get("norm_topk_prob"):  # HF's V2 router never renormalizes
        raise LlmTraceError(f"{k.where}: norm_topk_prob=true is not what DeepseekV2ForCausalLM "
                            f"computes (its greedy router keeps the softmax's weights): "
                            f"remove it")
    return dict(**plain_rope(k), **mla_fields(k, True),
                **moe_fields(k, "softmax_topk", False))


def write(c, hf: dict) -> dict:
    hf = mla_hf(c, hf)
    for key in ("n_group", "topk_group"):  # the greedy router reads no groups
        hf.pop(key, None)
    return {**hf, "topk_method": "greedy"}


FAMILY = Family("deepseek_v2", "DeepSeek-V2", "DeepseekV2ForCausalLM", "DeepseekV2Config",
                DEFAULTS, switches={"rope_interleave": True, "moe_renormalize": False},
                varies=(*MLA_VARIES, *MOE_VARIES), read=read, write=write,
                biased=("attention_bias",), keys=KEYS)


class DeepseekV2(DeepseekV3, family="deepseek_v2"):
    """DeepSeek-V3's layers, its router a softmax over the experts."""
