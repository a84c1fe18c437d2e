"""gpt-oss: Llama's block with a learned sink logit per head in every softmax of attention,
biases on Q, K, V and the output projection, sliding-window layers alternating with full ones
(the same RoPE on both: YaRN's), and in every layer a mixture of experts: a router with a bias,
the top k logits softmaxed, each expert a clamped GLU with biases of its own (moe.py)."""

from ..errors import LlmTraceError
from . import Family
from ._read import HFKeys, plain_rope
from .gemma3 import HF_LAYER_KINDS
from ..attention import Attention
from ..mechanisms import part
from ..mechanisms.attention_steps import Biased, OutBiased, Sinks
from ..model import Model
from ._parts import mlp_of, positions_of, window

# GptOssConfig's defaults (transformers 5.24, models/gpt_oss/configuration_gpt_oss.py)
DEFAULTS = {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "head_dim": 64,
            "rope_theta": 150_000.0, "num_key_value_heads": 8, "max_position_embeddings": 131072,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            "sliding_window": 128, "attention_bias": True, "num_local_experts": 128,
            "num_experts_per_tok": 4,
            "swiglu_limit": 7.0, "swiglu_alpha": 1.702}
# what GptOssConfig computes when a config.json names no RoPE at all (its __post_init__)
DEFAULT_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def refuse(c: dict, where: str) -> None:
    """Quantized checkpoints (the published ones: experts in MXFP4 blocks) are not read."""
    q = c.get("quantization_config")
    if q:
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise LlmTraceError(f"{where}: quantization_config quant_method={method!r} (weights "
                            f"stored quantized, e.g. MXFP4 expert blocks) is not read: "
                            f"dequantize the checkpoint first (transformers' "
                            f"Mxfp4Config(dequantize=True), then save_pretrained)")
    given = c.get("experts_per_token")  # OpenAI's own key, beside HF's num_experts_per_tok
    if given is not None and given != c.get("num_experts_per_tok", given):
        raise LlmTraceError(f"{where}: experts_per_token={given!r} and num_experts_per_tok="
                            f"{c['num_experts_per_tok']!r} disagree: keep one")


def layer_kinds(k: HFKeys) -> tuple:
    """Each layer's attention, as GptOssConfig reads it: `layer_types`, or even layers
    sliding and odd ones full when it is left out."""
    n, kinds = k.get("num_hidden_layers", int), k.c.get("layer_types")
    if kinds is None:
        k.left_out.add("layer_types")
        kinds = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if not isinstance(kinds, list) or any(t not in HF_LAYER_KINDS for t in kinds):
        raise LlmTraceError(f"{k.where}: layer_types must list 'full_attention' or "
                            f"'sliding_attention' per layer, got {kinds!r:.80}")
    return tuple(HF_LAYER_KINDS[t] for t in kinds)


def number(k: HFKeys, key: str) -> float:
    """A positive number HF's class has a default for (inf allowed: no clamp)."""
    value = float(k.default(key, float))
    if not value > 0:
        raise LlmTraceError(f"{k.where}: {key}={value!r} must be a positive number")
    return value


def read(k: HFKeys) -> dict:
    c = k.c
    named = any(isinstance(c.get(key), dict) for key in ("rope_scaling", "rope_parameters"))
    scaling = {} if named else {"rope_scaling": tuple(sorted(DEFAULT_YARN.items()))}
    if not named:
        k.left_out.add("rope_parameters")
    window, bias = k.default("sliding_window", int, least=1), k.default("attention_bias", bool)
    given = {key: k.get(key, int, least=1) for key in ("num_local_experts", "num_experts")
             if key in c}  # HF maps num_experts to num_local_experts
    if len(set(given.values())) > 1:
        raise LlmTraceError(f"{k.where}: num_experts and num_local_experts disagree "
                            f"({given}): keep one")
    E = next(iter(given.values())) if given else k.default("num_local_experts", int)
    return dict(**plain_rope(k), **scaling, layer_types=layer_kinds(k),
                sliding_window=0 if window is None else window, qkv_bias=bias, o_bias=bias,
                n_experts=E, n_experts_active=k.default("num_experts_per_tok", int, least=1),
                moe_ffn_size=k.get("intermediate_size", int),  # every expert's width
                swiglu_limit=number(k, "swiglu_limit"), swiglu_alpha=number(k, "swiglu_alpha"))


def write(c, hf: dict) -> dict:
    """A Llama config.json made into GptOssConfig's."""
    if c.ffn_size != c.moe_ffn_size or c.mlp_types or c.qkv_bias != c.o_bias:
        raise LlmTraceError(f"config {c.name!r}: HF's GptOssForCausalLM has experts in every "
                            f"layer, each intermediate_size wide, and one attention_bias for "
                            f"Q, K, V and O: give moe_ffn_size=ffn_size, no mlp_types and "
                            f"qkv_bias=o_bias")
    for key in ("mlp_bias", "rope_scaling", "rope_theta", "attention_bias"):
        hf.pop(key, None)
    kinds = {v: k for k, v in HF_LAYER_KINDS.items()}
    rope = dict(c.rope_scaling) if c.rope_scaling else {"rope_type": "default"}
    return {**hf, "rope_parameters": {**rope, "rope_theta": c.rope_theta},
            "layer_types": [kinds[t] for t in c.layer_types or ("full",) * c.n_layers],
            "sliding_window": c.sliding_window or None, "attention_bias": c.qkv_bias,
            "num_local_experts": c.n_experts, "num_experts_per_tok": c.n_experts_active,
            "swiglu_limit": c.swiglu_limit, "swiglu_alpha": c.swiglu_alpha}


FAMILY = Family("gpt_oss", "gpt-oss", "GptOssForCausalLM", "GptOssConfig", DEFAULTS,
                switches={"attn_sinks": True, "moe_router": "topk_softmax", "mlp_act": "gpt_oss"},
                varies=("qkv_bias", "o_bias", "sliding_window", "layer_types", "n_experts",
                        "n_experts_active", "moe_ffn_size", "swiglu_limit", "swiglu_alpha"),
                read=read, write=write, refuse=refuse,
                keys={"n_experts": "num_local_experts", "n_experts_active": "num_experts_per_tok",
                      "moe_ffn_size": "intermediate_size", "qkv_bias": "attention_bias",
                      "o_bias": "attention_bias"})


class GptOss(Model, family="gpt_oss"):
    """Llama with biases on Q, K, V and O, a learned sink per head, sliding layers between full
    ones, YaRN, and a mixture of experts with biases and a clamped GLU."""

    def attention(self, i):
        c = self.config
        return part(c.attn_sinks and Sinks, c.o_bias and OutBiased, c.qkv_bias and Biased,
                    window(c, i), Attention)(c, i)

    def mlp(self, i):
        return mlp_of(self.config, i)

    def positions(self, start, T):
        return positions_of(self, start, T)
