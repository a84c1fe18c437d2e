"""Qwen3.5's text model: Qwen3-Next's layers (three Gated DeltaNet to one gated full-attention
layer, RoPE on a quarter of each head, (1 + w) norms) with the DeltaNet projections stored apart
and a dense MLP in every layer. Its M-RoPE gives text the same angles as plain RoPE (the three
position ids of a text token are equal), so its mrope keys are read and left unused."""

from ..errors import LlmTraceError
from . import Family
from .qwen3_next import DEFAULTS as QWEN3_NEXT, FAMILY as NEXT, read
from ..mechanisms.deltanet import GatedDeltaNet
from .qwen3_next import Qwen3Next

MROPE_KEYS = ("mrope_section", "mrope_interleaved")
WITH_VISION = ("model_type 'qwen3_5' (Qwen3.5 with its vision tower) is not implemented: use its "
               "text model (qwen3_5_text, the text_config of its config.json)")


def refuse(c: dict, where: str) -> None:
    """Qwen3-Next's refusals, with M-RoPE's own keys allowed (text positions only)."""
    rope = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
    NEXT.refuse({**c, "rope_parameters": {k: v for k, v in rope.items()
                                          if k not in MROPE_KEYS}}, where)
    if c.get("num_experts"):
        raise LlmTraceError(f"{where}: num_experts={c['num_experts']} in a qwen3_5_text "
                            f"config: Qwen3.5's MoE models are model_type qwen3_5_moe")


def write(c, hf: dict) -> dict:
    """Qwen3-Next's config.json, as Qwen3_5TextConfig's (no experts to name)."""
    hf = NEXT.write(c, hf)
    for key in [k for k in hf if "expert" in k or k in ("norm_topk_prob",
                                                           "decoder_sparse_step",
                                                           "mlp_only_layers")]:
        hf.pop(key)
    return {**hf, "architectures": ["Qwen3_5ForCausalLM"]}


FAMILY = Family("qwen3_5_text", "Qwen3.5 (text)", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig",
                {**QWEN3_NEXT, "vocab_size": 248320, "num_key_value_heads": 4,
                 "num_experts": 0},  # a dense MLP in every layer
                switches={k: v for k, v in NEXT.switches.items() if k != "moe_router"},
                varies=("layer_types", "linear_attn", "partial_rotary_factor"),
                read=read, write=write,
                refuse=refuse, biased=NEXT.biased, not_null=NEXT.not_null, keys=NEXT.keys)


class ApartDeltaNet(GatedDeltaNet):
    """Qwen3.5 stores a DeltaNet layer's projections apart, flat: in_proj_qkv, in_proj_z,
    in_proj_b, in_proj_a."""
    layout = "qwen3_5_text"


class Qwen35Text(Qwen3Next, family="qwen3_5_text"):
    """Qwen3-Next's layers with a dense MLP, their DeltaNet projections stored apart."""
    deltanet = ApartDeltaNet
