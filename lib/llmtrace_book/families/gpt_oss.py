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
import torch

from ..mechanisms.moe import MoE, MoeWeights
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


class GptOssMoE(MoE):
    """gpt-oss's experts, with a bias on the router and on each matrix, stored fused as HF's
    GptOssExperts holds them: gate and up interleaved on the last axis (g0 u0 g1 u1 ...), each
    matrix as x @ W, transposed from F.linear's."""

    def tensors(self):
        E, D, Fm = self.n_experts, self.hidden, self.width
        return {"moe.router": ("mlp.router.weight", (E, D)),
                "moe.router_bias": ("mlp.router.bias", (E,)),
                "moe.gate": ("mlp.experts.gate_up_proj[..., ::2]", (E, Fm, D)),
                "moe.up": ("mlp.experts.gate_up_proj[..., 1::2]", (E, Fm, D)),
                "moe.down": ("mlp.experts.down_proj", (E, D, Fm)),
                "moe.gate_bias": ("mlp.experts.gate_up_proj_bias[:, ::2]", (E, Fm)),
                "moe.up_bias": ("mlp.experts.gate_up_proj_bias[:, 1::2]", (E, Fm)),
                "moe.down_bias": ("mlp.experts.down_proj_bias", (E, D))}

    def on_disk(self):
        E, D, Fm, p = self.n_experts, self.hidden, self.width, "mlp"
        return {f"{p}.router.weight": (E, D), f"{p}.router.bias": (E,),
                f"{p}.experts.gate_up_proj": (E, D, 2 * Fm),  # g0 u0 g1 u1 ... on the last axis
                f"{p}.experts.gate_up_proj_bias": (E, 2 * Fm),
                f"{p}.experts.down_proj": (E, Fm, D), f"{p}.experts.down_proj_bias": (E, D)}

    def load(self, get, prefix):
        p = f"{prefix}.mlp"
        gate_up = get(f"{p}.experts.gate_up_proj")  # [E, D, 2F]: g0 u0 g1 u1 ...
        gate_up_bias = get(f"{p}.experts.gate_up_proj_bias")  # [E, 2F]
        return {"moe": MoeWeights(
            router=get(f"{p}.router.weight"), router_bias=get(f"{p}.router.bias"),
            gate=gate_up[..., ::2].transpose(1, 2).contiguous(),  # [E, F, D]
            up=gate_up[..., 1::2].transpose(1, 2).contiguous(),  # [E, F, D]
            down=get(f"{p}.experts.down_proj").transpose(1, 2).contiguous(),  # [E, D, F]
            gate_bias=gate_up_bias[:, ::2].contiguous(),  # [E, F]
            up_bias=gate_up_bias[:, 1::2].contiguous(),  # [E, F]
            down_bias=get(f"{p}.experts.down_proj_bias"))}  # [E, D]

    def save(self, w, prefix):
        m, p = w.moe, f"{prefix}.mlp"
        E, Fm, D = m.gate.shape
        gate_up = torch.stack([m.gate, m.up], dim=-1)  # [E, F, D, 2]: gate, up side by side
        gate_up = gate_up.permute(0, 2, 1, 3).reshape(E, D, 2 * Fm)  # [E, D, 2F]: g0 u0 g1 u1
        return {f"{p}.router.weight": m.router, f"{p}.router.bias": m.router_bias,
                f"{p}.experts.gate_up_proj": gate_up,
                f"{p}.experts.gate_up_proj_bias": torch.stack([m.gate_bias, m.up_bias],
                                                              dim=-1).reshape(E, 2 * Fm),
                f"{p}.experts.down_proj": m.down.transpose(1, 2),  # [E, F, D]
                f"{p}.experts.down_proj_bias": m.down_bias}  # [E, D]


class GptOss(Model, family="gpt_oss"):
    """Llama with biases on Q, K, V and O, a learned sink per head, sliding layers between full
    ones, YaRN, and a mixture of experts with biases and a clamped GLU."""

    def attention(self, i):
        c = self.config
        return part(c.attn_sinks and Sinks, c.o_bias and OutBiased, c.qkv_bias and Biased,
                    window(c, i), Attention)(c, i)

    def mlp(self, i):
        return mlp_of(self.config, i, GptOssMoE)

    def positions(self, start, T):
        return positions_of(self, start, T)
