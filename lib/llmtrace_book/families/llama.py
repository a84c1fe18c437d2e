"""Llama 2 and 3 (and TinyLlama, SmolLM2): the family every default of `Config` is."""

from . import Family
from ..model import Model

# HF's LlamaConfig's default for each key config.json may leave out. None for
# num_key_value_heads: num_attention_heads; for head_dim: hidden_size // num_attention_heads.
# The keys that fix the weights' shapes (hidden_size, vocab_size...) have no default here: a file
# without them is refused.
DEFAULTS = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "head_dim": None,
            "rope_theta": 10_000.0, "num_key_value_heads": None, "max_position_embeddings": 2048,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None}

FAMILY = Family("llama", "Llama 2 and 3", "LlamaForCausalLM", "LlamaConfig", DEFAULTS,
                # attention_bias adds one to the output projection too, mlp_bias to the MLP's
                biased=("attention_bias", "mlp_bias"))


class Llama(Model, family="llama"):
    """Llama's parts, as `model.Model` builds them; its RoPE stretched as Llama 3's config says."""
