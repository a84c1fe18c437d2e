"""SmolLM3: a Llama whose every fourth layer has no RoPE (NoPE): q and k enter attention as
projected, so those layers see where a key sits only through the causal mask. Optionally
(`use_sliding_window`) the NoPE layers see only their last `sliding_window` keys."""

from ..errors import LlmTraceError
from . import Family
from ._read import HFKeys, plain_rope
from .gemma3 import HF_LAYER_KINDS
from .llama import DEFAULTS as LLAMA
from ..attention import Attention
from ..mechanisms import part
from ..mechanisms.attention_steps import Unturned
from ..model import Model
from ._parts import window


def read(k: HFKeys) -> dict:
    """`no_rope_layers` (1: RoPE, 0: none) as written, else SmolLM3Config's: 0 on every
    `no_rope_layer_interval`-th layer; the kinds of layer as SmolLM3Config derives them (NoPE
    layers slide when use_sliding_window is true and a window is given)."""
    c, where = k.c, k.where
    n = k.get("num_hidden_layers", int)
    flags = c.get("no_rope_layers")
    if flags is None:
        every = k.default("no_rope_layer_interval", int, least=1)
        flags = [int((i + 1) % every != 0) for i in range(n)]
    if not isinstance(flags, list) or any(f not in (0, 1) or isinstance(f, bool)
                                          for f in flags) or len(flags) != n:
        raise LlmTraceError(f"{where}: no_rope_layers must list 1 (RoPE) or 0 (none) for each "
                            f"of the {n} layers (num_hidden_layers), got {flags!r:.80}")
    slide = k.default("use_sliding_window", bool)
    window = k.default("sliding_window", int, least=1)
    if slide and window is None:
        raise LlmTraceError(f"{where}: use_sliding_window=true with sliding_window null: give "
                            f"the window's width, or set use_sliding_window false")
    kinds = c.get("layer_types")
    if kinds is None:
        kinds = ["sliding_attention" if slide and window is not None and not f
                 else "full_attention" for f in flags]
    if not isinstance(kinds, list) or len(kinds) != n or any(t not in HF_LAYER_KINDS
                                                             for t in kinds):
        raise LlmTraceError(f"{where}: layer_types must list 'full_attention' or "
                            f"'sliding_attention' for each of the {n} layers, got {kinds!r:.80}")
    sliding = "sliding_attention" in kinds
    if sliding and not slide:  # HF's masks would slide, its flash kernel would not
        raise LlmTraceError(f"{where}: layer_types names sliding_attention layers but "
                            f"use_sliding_window is false: set it true (with sliding_window) "
                            f"or list only full_attention")
    return dict(**plain_rope(k), no_rope_layers=() if all(flags) else tuple(flags),
                sliding_window=window if sliding else 0,
                layer_types=tuple(HF_LAYER_KINDS[t] for t in kinds) if sliding else ())


def write(c, hf: dict) -> dict:
    """A Llama config.json made into SmolLM3Config's."""
    names = {v: k for k, v in HF_LAYER_KINDS.items()}
    every = ("sliding" if c.sliding_window else "full",) * c.n_layers  # () : all alike
    return {**hf, "no_rope_layers": list(c.no_rope_layers or (1,) * c.n_layers),
            "use_sliding_window": bool(c.sliding_window),
            "sliding_window": c.sliding_window or None,
            "layer_types": [names[t] for t in c.layer_types or every]}


FAMILY = Family("smollm3", "SmolLM3", "SmolLM3ForCausalLM", "SmolLM3Config",
                {**LLAMA, "tie_word_embeddings": True, "rope_theta": 2_000_000.0,
                 "num_key_value_heads": 4, "max_position_embeddings": 32768,
                 "bos_token_id": 128000, "eos_token_id": 128001, "pad_token_id": 128004,
                 "sliding_window": None, "use_sliding_window": False,
                 "no_rope_layer_interval": 4},
                varies=("no_rope_layers", "sliding_window", "layer_types"),
                read=read, write=write, biased=("attention_bias", "mlp_bias"))


class SmolLM3(Model, family="smollm3"):
    """Llama with no RoPE on every fourth layer (NoPE), and sliding layers where it says."""

    def attention(self, i):
        c = self.config
        return part(not c.has_rope(i) and Unturned, window(c, i), Attention)(c, i)
