"""Qwen2: Llama with a bias vector on Q, K and V (HF's class has it whatever the keys say)."""

from ..errors import LlmTraceError
from . import Family
from .llama import DEFAULTS as LLAMA
from ..attention import Attention
from ..mechanisms import part
from ..mechanisms.attention_steps import Biased
from ..model import Model
from ._parts import window

DEFAULTS = {**LLAMA, "num_key_value_heads": 32, "max_position_embeddings": 32768,
            "bos_token_id": None, "eos_token_id": None}


def refuse_window(c: dict, where: str) -> None:
    """Qwen's window on the upper layers only, which llmtrace does not compute."""
    from . import COMPUTED

    layers = c.get("layer_types") if isinstance(c.get("layer_types"), list) else []
    if "sliding_attention" in layers or c.get("use_sliding_window") and \
            c.get("max_window_layers", 28) < c.get("num_hidden_layers", 0):
        raise LlmTraceError(f"{where}: use_sliding_window=true (a window on the layers from "
                            f"max_window_layers on, full attention below) is not implemented: "
                            f"{COMPUTED}")


FAMILY = Family("qwen2", "Qwen2", "Qwen2ForCausalLM", "Qwen2Config", DEFAULTS,
                switches={"qkv_bias": True}, refuse=refuse_window, not_null=("head_dim",))


class Qwen2(Model, family="qwen2"):
    """Llama with a bias on Q, K and V."""

    def attention(self, i):
        c = self.config
        return part(c.qkv_bias and Biased, window(c, i), Attention)(c, i)
