"""OLMoE: OLMo 2's QK-norm over the whole projection on Llama's pre-norm block, and a mixture of
experts in every layer's MLP: a softmax over the router's logits, the top k of E experts, their
weights renormalized only if `norm_topk_prob` (each expert as wide as intermediate_size)."""

from ..attention import Attention
from ..errors import LlmTraceError
from ..mechanisms import part
from ..mechanisms.attention_steps import ProjNormed
from ..model import Model
from . import Family
from ._parts import mlp_of
from ._read import HFKeys, plain_rope

# OlmoeConfig's defaults (transformers 5.24, models/olmoe/configuration_olmoe.py)
DEFAULTS = {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "head_dim": None,
            "rope_theta": 10_000.0, "num_key_value_heads": None, "max_position_embeddings": 4096,
            "bos_token_id": None, "eos_token_id": 50279, "pad_token_id": 1, "num_experts": 64,
            "num_experts_per_tok": 8, "norm_topk_prob": False}


def refuse(c: dict, where: str) -> None:
    if c.get("clip_qkv") is not None:
        raise LlmTraceError(f"{where}: clip_qkv={c['clip_qkv']!r} (Q, K and V clamped) is not "
                            f"implemented for OLMoE: only clip_qkv null")


def read(k: HFKeys) -> dict:
    return dict(**plain_rope(k), n_experts=k.default("num_experts", int, least=1),
                n_experts_active=k.default("num_experts_per_tok", int, least=1),
                moe_ffn_size=k.get("intermediate_size", int),  # every expert's width
                moe_renormalize=k.default("norm_topk_prob", bool))


def write(c, hf: dict) -> dict:
    if c.ffn_size != c.moe_ffn_size or c.mlp_types:
        raise LlmTraceError(f"config {c.name!r}: HF's OlmoeForCausalLM has experts in every "
                            f"layer, each intermediate_size wide: give moe_ffn_size=ffn_size="
                            f"{c.moe_ffn_size} and no mlp_types")
    for key in ("mlp_bias", "head_dim"):
        hf.pop(key)
    return {**hf, "num_experts": c.n_experts, "num_experts_per_tok": c.n_experts_active,
            "norm_topk_prob": c.moe_renormalize, "clip_qkv": None}


FAMILY = Family("olmoe", "OLMoE", "OlmoeForCausalLM", "OlmoeConfig", DEFAULTS,
                switches={"qk_proj_norm": True, "moe_router": "softmax_topk"},
                varies=("n_experts", "n_experts_active", "moe_ffn_size", "moe_renormalize"),
                read=read, write=write, refuse=refuse, biased=("attention_bias",),
                keys={"n_experts": "num_experts", "n_experts_active": "num_experts_per_tok",
                      "moe_ffn_size": "intermediate_size", "moe_renormalize": "norm_topk_prob"})


class Olmoe(Model, family="olmoe"):
    """Llama with QK-norm over the whole projection and a mixture of experts in every layer."""

    def attention(self, i):
        c = self.config
        return part(c.qk_proj_norm and ProjNormed, Attention)(c, i)

    def mlp(self, i):
        return mlp_of(self.config, i)
