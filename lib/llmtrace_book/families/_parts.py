"""What several families' modules build their layers from, read from the fields of their config
that they share: a window on a sliding layer, the kind of MLP a layer has, Gemma's norms, YaRN's
tables. Each family's module (`families/<name>.py`) states its own parts with these; a field
left at Llama's value gives Llama's part."""

import torch

from ..attention import Positions
from ..mechanisms.attention_steps import Windowed
from ..mechanisms.gemma import GeGLU, offset_rms_norm
from ..mechanisms.moe import MoE
from ..mechanisms.yarn import yarn_cos_sin
from ..mlp import MLP
from ..norm import rms_norm
from ..rope import rope_cos_sin


def window(c, i: int):
    """`Windowed` on a layer that slides (every layer of Mistral's; a sliding kind's)."""
    return Windowed if c.is_sliding(i) else None


def mlp_of(c, i: int, moe=MoE):
    """Layer i's MLP: a mixture of experts where the config says (`moe`, the family's kind),
    else the gated MLP (GeGLU if its activation is Gemma's)."""
    if c.is_moe(i):
        return moe(c, i)
    return (GeGLU if c.mlp_act == "gelu_tanh" else MLP)(c.hidden_size, c.ffn_size)


def norm_of(c):
    """Gemma's RMSNorm, times (1 + weight), where the config says `norm_offset`."""
    return offset_rms_norm if c.norm_offset else rms_norm


def rope_of(c):
    """RoPE's tables: YaRN's where the config's rope_scaling says so, else Llama's."""
    return yarn_cos_sin if c.rope_type == "yarn" else rope_cos_sin


def positions_of(model, start: int, T: int) -> Positions:
    """The pass's positions with the config's RoPE tables, and, where the sliding layers turn
    at a base of their own (`rope_local_theta`), their tables as `pos.more["local"]`."""
    c = model.config
    pos = Positions.of(start, T, c, model.device, rope_of(c))
    if c.layer_types:
        local = pos
        if c.rope_local_theta:  # a base of their own, unscaled (Gemma 3, OLMo 3)
            p = torch.arange(start, start + T, device=model.device)  # [T]
            local = Positions(start, *rope_cos_sin(p, c.head_dim, c.rope_local_theta),
                              pos.mask, pos.more)
        pos.more["local"] = local
    return pos
