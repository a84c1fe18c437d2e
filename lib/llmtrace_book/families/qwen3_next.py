"""Qwen3-Next: three Gated DeltaNet layers (a fixed state per head in place of a KV cache) to one
full-attention layer, whose queries bring a gate per head and whose RoPE turns a quarter of each
head; QK-norm; every RMSNorm but DeltaNet's gated one multiplies by (1 + weight)."""

from ..config import LINEAR_PARTS
from ..errors import LlmTraceError
from . import Family
from ._read import HFKeys, plain_rope
from .qwen3_moe import mlp_types_of
from ..attention import Attention, Positions
from ..mechanisms import part
from ..mechanisms.attention_steps import HeadNormed
from ..mechanisms.deltanet import GatedAttention, GatedDeltaNet
from ..mechanisms.gemma import OffsetNorm
from ..mechanisms.moe import MoE
from ..model import Model
from ._parts import mlp_of, norm_of, rope_of

HF_LAYER_KINDS = {"linear_attention": "linear", "full_attention": "full"}
# Qwen3NextConfig's defaults (transformers 5.24), which are Qwen3-Next-80B-A3B's shapes
LINEAR_KEYS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32,
               "linear_key_head_dim": 128, "linear_value_head_dim": 128,
               "linear_conv_kernel_dim": 4}
DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "head_dim": 256,
            "rope_theta": 10_000.0, "num_key_value_heads": 2, "max_position_embeddings": 32768,
            "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            "partial_rotary_factor": 0.25, "full_attention_interval": 4, **LINEAR_KEYS,
            "num_experts": 512,
            "num_experts_per_tok": 10, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": None}


def layer_kinds(k: HFKeys) -> tuple:
    """Each layer's kind: `layer_types` as written, else every `full_attention_interval`-th
    layer full (HF's rule: layer i is full when (i + 1) % interval == 0)."""
    n, kinds = k.get("num_hidden_layers", int), k.c.get("layer_types")
    if kinds is None:
        every = k.default("full_attention_interval", int, least=1)
        kinds = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                 for i in range(n)]
    if not isinstance(kinds, list) or any(t not in HF_LAYER_KINDS for t in kinds):
        raise LlmTraceError(f"{k.where}: layer_types must list 'linear_attention' or "
                            f"'full_attention' per layer, got {kinds!r:.80}")
    return tuple(HF_LAYER_KINDS[t] for t in kinds)


def rotary_factor(k: HFKeys) -> float:
    """The share of each head RoPE turns: rope_parameters' partial_rotary_factor, else the
    top-level key (HF moves it there), else Qwen3NextConfig's 0.25."""
    rope = k.c.get("rope_parameters") if isinstance(k.c.get("rope_parameters"), dict) else {}
    given = {label: d["partial_rotary_factor"] for label, d in (
        ("rope_parameters.partial_rotary_factor", rope), ("partial_rotary_factor", k.c))
        if d.get("partial_rotary_factor") is not None}
    for label, value in given.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise LlmTraceError(f"{k.where}: {label}={value!r} must be a number in (0, 1] (the "
                                f"share of each head RoPE turns; Qwen3-Next's is 0.25)")
    if len(set(given.values())) > 1:
        raise LlmTraceError(f"{k.where}: " + " and ".join(f"{a}={b}" for a, b in given.items())
                            + " disagree: keep one")
    return float(next(iter(given.values()), k.defaults["partial_rotary_factor"]))


def experts(k: HFKeys) -> dict:
    """The mixture of experts (`moe.moe_mlp`: a softmax over E, the top k, renormalized as
    norm_topk_prob says) and its one shared expert; num_experts 0: every MLP dense."""
    E = k.default("num_experts", int, least=0)
    moe = dict(n_experts=E, n_experts_active=k.default("num_experts_per_tok", int, least=1),
               moe_ffn_size=k.default("moe_intermediate_size", int, least=1),
               moe_renormalize=k.default("norm_topk_prob", bool),
               # 0: HF's class builds an empty shared expert, whose gate scales zeros
               shared_ffn_size=k.default("shared_expert_intermediate_size", int, least=0)
               ) if E else {}
    return dict(**moe, mlp_types=mlp_types_of(k, E))  # Qwen3-MoE's rule: HF's is the same


def read(k: HFKeys) -> dict:
    linear = tuple(k.default(key, int, least=1) for key in LINEAR_KEYS)
    return dict(**plain_rope(k), layer_types=layer_kinds(k), linear_attn=linear,
                partial_rotary_factor=rotary_factor(k), **experts(k))


def refuse(c: dict, where: str) -> None:
    """Settings Qwen3-Next's class has that llmtrace does not compute."""
    rope = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
    scaled = c.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default"
                                       else None)
    if scaled:
        raise LlmTraceError(f"{where}: a scaled RoPE ({scaled!r:.60}) is not implemented for "
                            f"Qwen3-Next: only plain RoPE")


def write(c, hf: dict) -> dict:
    """A Llama config.json made into Qwen3NextConfig's."""
    for key in ("mlp_bias", "rope_theta"):
        hf.pop(key)
    kinds = {v: k for k, v in HF_LAYER_KINDS.items()}
    return {**hf, "layer_types": [kinds[t] for t in c.layer_types or ("full",) * c.n_layers],
            **dict(zip(LINEAR_KEYS, c.linear_attn or LINEAR_KEYS.values())),
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                                "partial_rotary_factor": c.partial_rotary_factor},
            **experts_hf(c)}


def experts_hf(c) -> dict:
    """The experts' keys of Qwen3NextConfig; num_experts 0 makes every MLP dense."""
    if not c.n_experts:
        return {"num_experts": 0}
    only = [i for i, t in enumerate(c.mlp_types) if t == "dense"]  # any pattern
    return {"num_experts": c.n_experts, "num_experts_per_tok": c.n_experts_active,
            "moe_intermediate_size": c.moe_ffn_size, "norm_topk_prob": c.moe_renormalize,
            "shared_expert_intermediate_size": c.shared_ffn_size,
            "decoder_sparse_step": 1, "mlp_only_layers": only}


FAMILY = Family("qwen3_next", "Qwen3-Next", "Qwen3NextForCausalLM", "Qwen3NextConfig",
                DEFAULTS, switches={"qk_norm": True, "norm_offset": True,
                                    "attn_output_gate": True, "moe_router": "softmax_topk"},
                varies=("layer_types", "linear_attn", "partial_rotary_factor", "n_experts",
                        "n_experts_active", "moe_ffn_size", "moe_renormalize", "mlp_types",
                        "shared_ffn_size"),
                keys={"n_experts": "num_experts", "n_experts_active": "num_experts_per_tok",
                      "moe_ffn_size": "moe_intermediate_size",
                      "moe_renormalize": "norm_topk_prob", "mlp_types": "mlp_only_layers",
                      "shared_ffn_size": "shared_expert_intermediate_size",
                      **dict(zip(LINEAR_PARTS, LINEAR_KEYS))},
                read=read, write=write, refuse=refuse, biased=("attention_bias",),
                not_null=("head_dim", "num_key_value_heads"))


class SharedGatedMoE(MoE):
    """Qwen3-MoE's experts, and one shared expert (shared_expert_intermediate_size wide, 0:
    none) that each position scales by a sigmoid gate of its own."""

    def __init__(self, config, layer: int = 0):
        super().__init__(config, layer)
        self.shared = config.shared_ffn_size

    def tensors(self):
        if not self.shared:
            return super().tensors()
        return {**super().tensors(), **self.shared_expert("mlp.shared_expert", self.shared),
                "moe.shared_gate": ("mlp.shared_expert_gate.weight", (1, self.hidden))}


class Qwen3Next(Model, family="qwen3_next"):
    """Gated DeltaNet layers (a fixed state per head) between gated attention layers (each
    head's output times a sigmoid gate, RoPE on a quarter of each head, QK-norm), norms around
    1 + weight, and a mixture of experts with a gated shared expert."""

    def __init__(self, config, *args, **kwargs):
        self.norm = norm_of(config)
        super().__init__(config, *args, **kwargs)

    deltanet = GatedDeltaNet  # its linear layers, as its checkpoints store them

    def attention(self, i):
        c = self.config
        if c.is_linear(i):
            return self.deltanet(c, i)
        return part(c.qk_norm and c.norm_offset and OffsetNorm, c.qk_norm and HeadNormed,
                    GatedAttention if c.attn_output_gate else Attention)(c, i)

    def mlp(self, i):
        return mlp_of(self.config, i, SharedGatedMoE)

    def positions(self, start, T):
        c, rope = self.config, rope_of(self.config)

        def turned(positions, head_dim, theta, scaling):  # RoPE on rotary_dim of each head
            return rope(positions, c.rotary_dim or head_dim, theta, scaling)

        return Positions.of(start, T, c, self.device, turned)
