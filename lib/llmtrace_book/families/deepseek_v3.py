"""DeepSeek-V3: multi-head latent attention (`mla.py`: K and V rebuilt from a cached latent,
queries through a latent of their own, RoPE on a separate part of each head, YaRN) and
DeepSeek's mixture of experts (`moe.py`: sigmoid scores, a bias for choosing only, groups of
experts, shared experts), its first `first_k_dense_replace` layers dense."""

from ..errors import LlmTraceError
from . import Family
from ._read import HFKeys, plain_rope
from ..mechanisms.mla import LatentAttention
from ..mechanisms.moe import MoE, SigmoidGroup
from ..model import Model
from ._parts import mlp_of, positions_of

# DeepseekV3Config's defaults (transformers 5.24) of the keys a config.json may leave out
DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "head_dim": None,
            "rope_theta": 10_000.0, "num_key_value_heads": 128, "max_position_embeddings": 4096,
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None, "kv_lora_rank": 512,
            "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "rope_interleave": True, "first_k_dense_replace": 3, "n_routed_experts": 256,
            "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
            "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True}


def refuse_settings(c: dict, where: str, fixed: dict) -> None:
    """What the checkpoint says that HF's class would compute otherwise or not at all: a
    setting kept only if it is what is computed here, else refused by its key."""
    if c.get("quantization_config"):
        method = c["quantization_config"].get("quant_method", "?") \
            if isinstance(c["quantization_config"], dict) else "?"
        raise LlmTraceError(f"{where}: quantization_config ({method}: weights stored in 8 bits "
                            f"with scales, as DeepSeek-V3's FP8 release) is not read: convert "
                            f"the checkpoint to bf16 first")
    for key, allowed in fixed.items():
        if key in c and c[key] not in allowed:
            said = " or ".join(repr(a) for a in allowed if a is not None)
            raise LlmTraceError(f"{where}: {key}={c[key]!r} is not implemented: only {said}")


def mla_fields(k: HFKeys, interleave: bool) -> dict:
    """The latent attention's sizes; head_dim is qk_rope_head_dim (HF sets it so)."""
    c, where = k.c, k.where
    dr = k.default("qk_rope_head_dim", int, least=2)
    if c.get("head_dim") is not None and c["head_dim"] != dr:
        raise LlmTraceError(f"{where}: head_dim={c['head_dim']} differs from "
                            f"qk_rope_head_dim={dr}: HF's class sets head_dim to "
                            f"qk_rope_head_dim; remove head_dim or make them equal")
    q = c["q_lora_rank"] if "q_lora_rank" in c else k.defaults["q_lora_rank"]
    if q is not None and (isinstance(q, bool) or not isinstance(q, int) or q < 1):
        raise LlmTraceError(f"{where}: q_lora_rank={q!r} must be a positive integer, or null "
                            f"(one q_proj, as DeepSeek-V2-Lite)")
    # HF's attention rebuilds K and V for every head and reads no num_key_value_heads: left
    # out, it is num_attention_heads (written otherwise, config_problems refuses it)
    heads = {} if "num_key_value_heads" in c else {"n_kv_heads": k.get("num_attention_heads", int)}
    return dict(**heads, kv_lora_rank=k.default("kv_lora_rank", int, least=1),
                q_lora_rank=q or 0,
                qk_nope_head_dim=k.default("qk_nope_head_dim", int, least=1),
                v_head_dim=k.default("v_head_dim", int, least=1),
                head_dim=dr, rope_interleave=interleave)


def moe_fields(k: HFKeys, router: str, renormalize: bool) -> dict:
    """DeepSeek's experts: the first `first_k_dense_replace` layers dense (an MLP
    intermediate_size wide), every later one n_routed_experts experts and the shared ones."""
    n = k.get("num_hidden_layers", int)
    dense = min(k.default("first_k_dense_replace", int, least=0), n)
    if dense == n:  # no layer has experts
        return {}
    grouped = router == "sigmoid_group"  # V2's greedy softmax router reads no groups
    if k.c.get("num_experts_per_tok", k.defaults["num_experts_per_tok"]) is None:
        raise LlmTraceError(f"{k.where}: num_experts_per_tok is null or left out "
                            f"({k.config_class}'s default, which routes to no expert): give "
                            f"the number of experts each position goes to, e.g. 6")
    return dict(n_experts=k.default("n_routed_experts", int, least=1),
                n_experts_active=k.default("num_experts_per_tok", int, least=1),
                moe_ffn_size=k.default("moe_intermediate_size", int, least=1),
                n_shared_experts=k.default("n_shared_experts", int, least=0),
                moe_groups=k.default("n_group", int, least=1) if grouped else 1,
                moe_groups_chosen=k.default("topk_group", int, least=1) if grouped else 1,
                moe_scaling=float(k.default("routed_scaling_factor", float)),
                moe_router=router, moe_renormalize=renormalize,
                mlp_types=("dense",) * dense + ("moe",) * (n - dense))


def switch(k: HFKeys, key: str) -> bool:
    """A switch DeepseekV3Config types `bool | None`: its class tests it for truth (`if
    config.rope_interleave:`), so a null computes as false."""
    return False if key in k.c and k.c[key] is None else k.default(key, bool)


def read(k: HFKeys) -> dict:
    refuse_settings(k.c, k.where, {"topk_method": (None, "noaux_tc"),
                                   "scoring_func": (None, "sigmoid"), "moe_layer_freq": (1,)})
    return dict(**plain_rope(k), **mla_fields(k, switch(k, "rope_interleave")),
                **moe_fields(k, "sigmoid_group", switch(k, "norm_topk_prob")))


def rope_parameters(c) -> dict:
    """HF 5.x's rope_parameters: the base and any scaling in one dict."""
    return {"rope_type": "default", "rope_theta": c.rope_theta, **dict(c.rope_scaling)}


def mla_hf(c, hf: dict) -> dict:
    """A Llama config.json made into a DeepSeek one: the latent's sizes, RoPE in one dict."""
    for key in ("rope_theta", "rope_scaling", "mlp_bias", "head_dim"):
        hf.pop(key, None)
    return {**hf, "rope_parameters": rope_parameters(c), "kv_lora_rank": c.kv_lora_rank,
            "q_lora_rank": c.q_lora_rank or None, "qk_nope_head_dim": c.qk_nope_head_dim,
            "qk_rope_head_dim": c.head_dim, "v_head_dim": c.v_head_dim, **moe_hf(c)}


def moe_hf(c) -> dict:
    """The experts' keys; dense layers only where DeepSeek has them, first."""
    kinds = c.mlp_types or (("moe",) if c.n_experts else ("dense",)) * c.n_layers
    dense = kinds.count("dense")
    if kinds != ("dense",) * dense + ("moe",) * (c.n_layers - dense):
        raise LlmTraceError(f"config {c.name!r}: mlp_types {kinds!r:.60} are not DeepSeek's: "
                            f"its dense layers come first (first_k_dense_replace)")
    if not c.n_experts:
        return {"first_k_dense_replace": c.n_layers}
    return {"first_k_dense_replace": dense, "n_routed_experts": c.n_experts,
            "num_experts_per_tok": c.n_experts_active,
            "moe_intermediate_size": c.moe_ffn_size, "n_shared_experts": c.n_shared_experts,
            "n_group": c.moe_groups, "topk_group": c.moe_groups_chosen,
            "routed_scaling_factor": c.moe_scaling, "norm_topk_prob": c.moe_renormalize}


def write(c, hf: dict) -> dict:
    return {**mla_hf(c, hf), "rope_interleave": c.rope_interleave}


MLA_VARIES = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim")
MOE_VARIES = ("n_experts", "n_experts_active", "moe_ffn_size", "n_shared_experts",
              "moe_scaling", "mlp_types", "moe_router")  # moe_router: none in a dense model
KEYS = {"n_experts": "n_routed_experts", "n_experts_active": "num_experts_per_tok",
        "moe_ffn_size": "moe_intermediate_size", "moe_groups": "n_group",
        "moe_groups_chosen": "topk_group", "moe_scaling": "routed_scaling_factor",
        "moe_renormalize": "norm_topk_prob", "mlp_types": "first_k_dense_replace",
        "head_dim": "qk_rope_head_dim"}

FAMILY = Family("deepseek_v3", "DeepSeek-V3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
                DEFAULTS, varies=(*MLA_VARIES, "rope_interleave", *MOE_VARIES, "moe_groups",
                                  "moe_groups_chosen", "moe_renormalize"),
                read=read, write=write, biased=("attention_bias",), keys=KEYS)


class DeepseekMoE(MoE):
    """DeepSeek's experts, named as Qwen3-MoE's; its shared experts one dense MLP
    (n_shared_experts x moe_intermediate_size wide); V3's router bias, for choosing only."""

    def __init__(self, config, layer: int = 0):
        super().__init__(config, layer)
        self.shared = config.n_shared_experts * config.moe_ffn_size  # 0: none

    def tensors(self):
        out = super().tensors()
        if isinstance(self.router, SigmoidGroup):  # V3: e_score_correction_bias
            out["moe.score_bias"] = ("mlp.gate.e_score_correction_bias", (self.n_experts,))
        if self.shared:
            out.update(self.shared_expert("mlp.shared_experts", self.shared))
        return out


class DeepseekV3(Model, family="deepseek_v3"):
    """Llama with multi-head latent attention (K and V rebuilt from a cached latent), YaRN, and a
    mixture of experts (sigmoid scores, groups, a shared expert) after the first dense layers."""

    def attention(self, i):
        return LatentAttention(self.config, i)

    def mlp(self, i):
        return mlp_of(self.config, i, DeepseekMoE)

    def positions(self, start, T):
        return positions_of(self, start, T)
