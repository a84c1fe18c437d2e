"""Qwen3: Llama with QK-norm, an RMSNorm on each head of Q and K before RoPE."""

from . import Family
from .qwen2 import DEFAULTS as QWEN2, refuse_window

FAMILY = Family("qwen3", "Qwen3", "Qwen3ForCausalLM", "Qwen3Config",
                {**QWEN2, "head_dim": 128},
                switches={"qk_norm": True}, refuse=refuse_window,
                biased=("attention_bias",), not_null=("head_dim",))
