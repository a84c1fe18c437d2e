"""OLMo 2: a norm only after each sublayer (none before: h = x + norm(attn(x))), and QK-norm over
the whole projection (one RMSNorm of width H*hd on q_proj's output, KV*hd on k_proj's) before
the heads are split."""

from . import Family
from .llama import DEFAULTS as LLAMA

FAMILY = Family("olmo2", "OLMo 2", "Olmo2ForCausalLM", "Olmo2Config",
                {**LLAMA, "rms_norm_eps": 1e-5, "bos_token_id": None, "eos_token_id": 50279,
                 "pad_token_id": 1},
                switches={"pre_norm": False, "sandwich_norm": True, "qk_proj_norm": True},
                biased=("attention_bias",))  # on Q, K, V and the output projection
