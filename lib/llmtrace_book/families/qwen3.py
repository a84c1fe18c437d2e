"""Qwen3: Llama with QK-norm, an RMSNorm on each head of Q and K before RoPE."""

from . import Family
from .qwen2 import DEFAULTS as QWEN2, refuse_window
from ..attention import Attention
from ..mechanisms import part
from ..mechanisms.attention_steps import HeadNormed
from ..model import Model
from ._parts import window

FAMILY = Family("qwen3", "Qwen3", "Qwen3ForCausalLM", "Qwen3Config",
                {**QWEN2, "head_dim": 128},
                switches={"qk_norm": True}, refuse=refuse_window,
                biased=("attention_bias",), not_null=("head_dim",))


class Qwen3(Model, family="qwen3"):
    """Llama with QK-norm: each head of Q and K normalized before RoPE."""

    def attention(self, i):
        c = self.config
        return part(c.qk_norm and HeadNormed, window(c, i), Attention)(c, i)
