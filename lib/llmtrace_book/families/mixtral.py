"""Mixtral: Mistral's attention (a sliding window if its config sets one) and, in every layer, a
mixture of experts in place of the MLP: a softmax over the router's logits, the top k of E
experts, their weights renormalized to sum 1 (moe.py)."""

from ..errors import LlmTraceError
from . import Family
from ._read import HFKeys
from .llama import DEFAULTS as LLAMA
from .mistral import read as mistral_read, write as mistral_write
from ..mechanisms.moe import MoE
from ._parts import mlp_of
from .mistral import Mistral

# MixtralConfig's defaults (transformers 5.24, models/mixtral/configuration_mixtral.py)
DEFAULTS = {**LLAMA, "rms_norm_eps": 1e-5, "num_key_value_heads": 8, "rope_theta": 1_000_000.0,
            "max_position_embeddings": 131072, "sliding_window": None, "num_local_experts": 8,
            "num_experts_per_tok": 2}


def read(k: HFKeys) -> dict:
    E = k.default("num_local_experts", int, least=1)
    return dict(**mistral_read(k), n_experts=E,
                n_experts_active=k.default("num_experts_per_tok", int, least=1),
                moe_ffn_size=k.get("intermediate_size", int))  # every expert's width


def write(c, hf: dict) -> dict:
    if c.ffn_size != c.moe_ffn_size or c.mlp_types:
        raise LlmTraceError(f"config {c.name!r}: HF's MixtralForCausalLM has experts in every "
                            f"layer, each intermediate_size wide: give moe_ffn_size=ffn_size="
                            f"{c.moe_ffn_size} and no mlp_types")
    return {**mistral_write(c, hf), "num_local_experts": c.n_experts,
            "num_experts_per_tok": c.n_experts_active}


FAMILY = Family("mixtral", "Mixtral", "MixtralForCausalLM", "MixtralConfig", DEFAULTS,
                switches={"moe_router": "softmax_topk", "moe_renormalize": True},
                varies=("sliding_window", "n_experts", "n_experts_active", "moe_ffn_size"),
                read=read, write=write,
                keys={"n_experts": "num_local_experts", "n_experts_active": "num_experts_per_tok",
                      "moe_ffn_size": "intermediate_size"})  # HF's class has no bias


class MixtralMoE(MoE):
    """Mixtral's experts as HF stores them: block_sparse_moe.experts.{e}.w1 (gate), w3 (up) and
    w2 (down), its router block_sparse_moe.gate."""
    block, kinds = "block_sparse_moe", ("w1", "w3", "w2")


class Mixtral(Mistral, family="mixtral"):
    """Mistral with a mixture of experts in every layer's MLP."""

    def mlp(self, i):
        return mlp_of(self.config, i, MixtralMoE)
