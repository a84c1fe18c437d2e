"""Mistral: Llama with a sliding window, a query sees only its last W keys."""

from . import Family
from ._read import HFKeys, plain_rope
from .llama import DEFAULTS as LLAMA
from ..attention import Attention
from ..mechanisms import part
from ..model import Model
from ._parts import window


def read(k: HFKeys) -> dict:
    window = k.default("sliding_window", int, least=1)
    return dict(**plain_rope(k), sliding_window=0 if window is None else window)  # null: none


def write(c, hf: dict) -> dict:
    return {**hf, "sliding_window": c.sliding_window or None}  # 0 is written as HF's null


FAMILY = Family("mistral", "Mistral", "MistralForCausalLM", "MistralConfig",
                {**LLAMA, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                 "sliding_window": 4096},
                varies=("sliding_window",), read=read, write=write,
                not_null=("num_key_value_heads",))  # HF's class ignores both biases


class Mistral(Model, family="mistral"):
    """Llama with a sliding window on every layer."""

    def attention(self, i):
        return part(window(self.config, i), Attention)(self.config, i)
