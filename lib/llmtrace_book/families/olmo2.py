"""OLMo 2: a norm only after each sublayer (none before: h = x + norm(attn(x))), and QK-norm over
the whole projection (one RMSNorm of width H*hd on q_proj's output, KV*hd on k_proj's) before
the heads are split. Its RMSNorm rounds after the weight, not before (`rounded_last_rms_norm`)."""

from . import Family
from .llama import DEFAULTS as LLAMA
from ..attention import Attention
from ..mechanisms import part
from ..mechanisms.attention_steps import ProjNormed
from ..mechanisms.gemma import SandwichBlock, rounded_last_rms_norm
from ..model import Model
from ._parts import window

FAMILY = Family("olmo2", "OLMo 2", "Olmo2ForCausalLM", "Olmo2Config",
                {**LLAMA, "rms_norm_eps": 1e-5, "bos_token_id": None, "eos_token_id": 50279,
                 "pad_token_id": 1},
                switches={"pre_norm": False, "sandwich_norm": True, "qk_proj_norm": True},
                biased=("attention_bias",))  # on Q, K, V and the output projection


class OlmoProjNormed(ProjNormed):
    norm = staticmethod(rounded_last_rms_norm)


class Olmo2(Model, family="olmo2"):
    """Llama with a norm only after each sublayer (h = x + norm(attn(x))), and QK-norm over
    the whole projection, before the heads are split."""
    norm = staticmethod(rounded_last_rms_norm)  # OLMo's: the weight in fp32, rounded last

    def block(self, i):
        c = self.config
        if not c.sandwich_norm:
            return super().block(i)
        return SandwichBlock(self.attention(i), self.mlp(i), c, self.norm, c.pre_norm)

    def attention(self, i):
        c = self.config
        return part(c.qk_proj_norm and OlmoProjNormed, window(c, i), Attention)(c, i)
