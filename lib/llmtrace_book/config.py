"""The numbers that fix every shape in the model.

A config decides every tensor shape in the forward pass; the weights only fill them in. That is why
TinyLlama's shapes are exact here even without its weights (see `model.meta_model`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from .config_checks import CHECKS, DeltaNetDims, per_layer_problem
from .config_checks import LINEAR_PARTS, LLAMA3_KEYS  # noqa: F401  (families/ reads them here)
from .errors import LlmTraceError
from .presets import ALIASES, PRESETS


# the integer fields and their least value (head_dim 0 means hidden_size // n_heads)
INT_FIELDS = {"vocab_size": 1, "hidden_size": 1, "n_layers": 1, "n_heads": 1, "n_kv_heads": 1,
              "ffn_size": 1, "max_positions": 1, "head_dim": 0, "bos_id": 0, "eos_id": 0,
              "pad_id": 0, "sliding_window": 0, "global_head_dim": 0, "global_kv_heads": 0,
              "kv_shared_layers": 0, "ple_size": 0, "ple_vocab": 0, "n_experts": 0,
              "n_experts_active": 0, "moe_ffn_size": 0, "shared_ffn_size": 0,
              "kv_lora_rank": 0, "q_lora_rank": 0,
              "qk_nope_head_dim": 0, "v_head_dim": 0, "n_shared_experts": 0, "moe_groups": 1,
              "moe_groups_chosen": 1, "attention_chunk": 0}
OPTIONAL_IDS = ("bos_id", "eos_id")  # None: the model has none
NULLABLE_FIELDS = (*OPTIONAL_IDS, "pad_id")


def config_problems(v: dict, key=str) -> list[str]:
    """What makes these values of `Config`'s fields no model, each problem naming its field as
    `key(field)` spells it: the field's own name, or the config.json or GGUF key it was read
    from, so that an error names what the user wrote."""
    problems = []
    for field, least in INT_FIELDS.items():
        value = v[field]
        if value is None and field in NULLABLE_FIELDS:
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
    for field in ("attn_scale", "rope_local_theta", "final_softcap", "moe_scaling"):
        value = v[field]
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value < 0:
            problems.append(f"{key(field)}={value!r} must be a finite number >= 0")
    if v["mlp_act"] not in MLP_ACTS:
        problems.append(f"{key('mlp_act')}={v['mlp_act']!r} must be one of "
                        f"{', '.join(MLP_ACTS)}")
    for field in ("qk_proj_norm", "pre_norm", "k_eq_v", "double_wide_mlp", "v_norm",
                  "layer_scalar", "rope_interleave", "qk_l2_norm"):
        if v[field] is not True and v[field] is not False:
            problems.append(f"{key(field)}={v[field]!r} must be True or False")
    if v["qk_norm"] is True and v["qk_proj_norm"] is True:
        problems.append("qk_norm and qk_proj_norm both set: Q and K are normalized per head "
                        "(Qwen3, Gemma 3) or over the whole projection (OLMo 2), not both")
    if v["pre_norm"] is False and v["sandwich_norm"] is False:
        problems.append("pre_norm=False without sandwich_norm: a block with no norm is no "
                        "model computed here; OLMo 2 sets sandwich_norm=True")
    types = v["layer_types"]
    wrong = per_layer_problem(v, "layer_types", LAYER_KINDS, key)
    if wrong:
        problems.append(wrong)
    elif "sliding" in types and not v["sliding_window"]:
        problems.append(f"{key('layer_types')} has sliding layers but {key('sliding_window')}="
                        f"{v['sliding_window']}: give its width")
    elif "linear" in types and not v["linear_attn"]:
        problems.append(f"{key('layer_types')} has linear layers but no linear_attn "
                        f"(key heads, value heads, key and value head sizes, conv kernel)")
    for check in CHECKS:  # each mechanism's own fields (config_checks.py)
        problems += check(v, key)
    return problems or shape_problems(v, key)  # the rest divides by a head count


def shape_problems(v: dict, key=str) -> list[str]:
    """What `config_problems` finds once every count is a positive integer."""
    problems = []
    head_dim = v["head_dim"] if v["head_dim"] != 0 else v["hidden_size"] // v["n_heads"]
    # a head_dim left at 0 is derived: the error names the keys it came from
    width = f"{key('head_dim')}={head_dim}" if v["head_dim"] else \
        f"{key('hidden_size')}={v['hidden_size']} / {key('n_heads')}={v['n_heads']}"
    if v["n_heads"] % v["n_kv_heads"]:
        problems.append(f"{key('n_heads')}={v['n_heads']} is not a multiple of "
                        f"{key('n_kv_heads')}={v['n_kv_heads']}")
    if head_dim < 2:
        problems.append(f"{width} gives heads of {head_dim} dims: RoPE needs at least 2")
    elif head_dim % 2:
        problems.append(f"{width} gives heads of {head_dim} dims, odd: RoPE rotates pairs")
    elif int(head_dim * v["partial_rotary_factor"]) % 2:
        problems.append(f"{key('partial_rotary_factor')}={v['partial_rotary_factor']} turns "
                        f"{int(head_dim * v['partial_rotary_factor'])} of {head_dim} dims: "
                        f"RoPE rotates pairs")
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


# How a config.json is read and written and GGUF metadata read: in modules above this one, which
# register their functions here as they are imported (families/: "from_hf" -> read_hf, "to_hf" ->
# write_hf; weights/gguf.py: "from_gguf" -> config_fields), so that this module imports nothing
# above it. llmtrace_book/__init__.py imports both, so `Config.from_hf`, `to_hf` and `from_gguf` work
# after any import of the package.
FORMATS: dict = {}


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
    # config.json's pad_token_id, which nothing here computes with: kept so that `to_hf` writes
    # it back (HF's embedding checks it against the vocabulary, and a key left out would take
    # the class's default, SmolLM3's 128004); None: null
    pad_id: int | None = None
    # What today's families change (each default is Llama 2's, so a Llama config is untouched):
    family: str = "llama"  # the HF model_type: llama, mistral, qwen2, qwen3, gemma3_text
    qkv_bias: bool = False  # Qwen2: a bias vector added to Q, K and V
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of Q and K, before RoPE
    qk_proj_norm: bool = False  # OLMo 2: RMSNorm over all of q_proj's [H*hd] (k_proj's too)
    sliding_window: int = 0  # Mistral: a query sees only its last W keys (0: all earlier ones)
    # Llama 3.x (or YaRN, gpt-oss): HF's rope_scaling as sorted (key, value) pairs, e.g.
    # (("factor", 32.0), ..., ("rope_type", "llama3")); () is plain RoPE
    rope_scaling: tuple = ()
    # Gemma 3's differences from Llama 2; each default is Llama 2's
    norm_offset: bool = False  # RMSNorm multiplies by (1 + weight): weights are stored around 0
    sandwich_norm: bool = False  # a norm after each sublayer too, before its residual add
    pre_norm: bool = True  # False (OLMo 2): no norm before a sublayer, only sandwich_norm's after
    mlp_act: str = "silu"  # the gate's activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: bool = False  # embedding rows times sqrt(hidden_size)
    attn_scale: float = 0.0  # scores = q @ k^T * attn_scale; 0 means 1 / sqrt(head_dim)
    layer_types: tuple = ()  # per layer "full", "sliding" or "chunked"; () = every layer alike
    rope_local_theta: float = 0.0  # RoPE base of the sliding layers; 0 means rope_theta
    # Qwen3-Next's differences (layer_types also names "linear" layers: Gated DeltaNet)
    attn_output_gate: bool = False  # W_q gives each head a gate: out * sigmoid(gate)
    partial_rotary_factor: float = 1.0  # RoPE turns this share of each head's dims
    linear_attn: tuple = ()  # DeltaNet layers' (key heads, value heads, dk, dv, conv kernel)
    # Gemma 4's differences from Gemma 3 (gemma4.py); each default leaves a model as it was
    global_head_dim: int = 0  # the full layers' head width; 0 means head_dim
    global_kv_heads: int = 0  # the full layers' KV heads; 0 means n_kv_heads
    k_eq_v: bool = False  # full layers: V is K's projection (no W_v)
    kv_shared_layers: int = 0  # the last N layers read the K, V of an earlier layer
    double_wide_mlp: bool = False  # those shared layers' MLP twice ffn_size wide
    ple_size: int = 0  # per-layer inputs: P numbers per token and layer; 0: none
    ple_vocab: int = 0  # rows of the per-layer table
    rope_partial: float = 1.0  # full layers: the fraction of pairs RoPE turns (proportional)
    v_norm: bool = False  # V normalized per head, with no weight
    layer_scalar: bool = False  # each layer's output times a stored scalar
    final_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0: none
    # A mixture of experts (Mixtral, Qwen3-MoE): the MLP is E expert MLPs, a router sends each
    # position to k of them (moe.py); 0 experts is a dense model
    n_experts: int = 0  # E
    n_experts_active: int = 0  # k, chosen per position (HF's num_experts_per_tok)
    moe_ffn_size: int = 0  # each expert's intermediate size (ffn_size stays the dense MLP's)
    moe_router: str = "softmax_topk"  # moe.ROUTERS: how the router's logits choose and weigh
    moe_renormalize: bool = True  # the k chosen weights rescaled to sum 1 (norm_topk_prob)
    mlp_types: tuple = ()  # per layer "dense" or "moe"; () = every layer MoE if n_experts
    # gpt-oss's experts (mlp_act "gpt_oss", moe.gpt_oss_glu): gate clamped above, up on both
    # sides, at swiglu_limit (inf: no clamp); gate * sigmoid(swiglu_alpha * gate)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    # gpt-oss's attention: a learned sink logit per head beside every row of scores (rows of
    # weights sum below 1), and a bias on the output projection (o_proj) beside Q, K and V's
    attn_sinks: bool = False
    o_bias: bool = False
    shared_ffn_size: int = 0  # Qwen3-Next: one shared expert this wide, scaled by a sigmoid gate
    # SmolLM3: per layer 1 (RoPE) or 0 (no RoPE: NoPE), HF's no_rope_layers; () = RoPE everywhere
    no_rope_layers: tuple = ()
    # Llama 4: a "chunked" layer's query sees only the keys of its own block of C positions;
    # q and k to RMS 1 per head, no weight, after RoPE (RoPE layers); NoPE layers' queries
    # scaled by 1 + scale * log1p(floor((position + 1) / floor)), (floor, scale); () none
    attention_chunk: int = 0
    qk_l2_norm: bool = False
    attn_temperature: tuple = ()
    # DeepSeek's multi-head latent attention (`mla`): K and V rebuilt from a cached latent of
    # kv_lora_rank numbers; 0 is grouped-query attention. head_dim is then the rotated part
    # of each query and key (HF's qk_rope_head_dim), beside qk_nope_head_dim without RoPE
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # the queries' own latent (DeepSeek-V3); 0: one q_proj (V2-Lite)
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE turns adjacent pairs (2i, 2i+1): DeepSeek, Llama 4
    # DeepSeek's mixture of experts: shared experts every position runs, groups of experts
    n_shared_experts: int = 0  # one dense MLP n_shared_experts x moe_ffn_size wide
    moe_groups: int = 1  # the experts split into groups (HF's n_group) ...
    moe_groups_chosen: int = 1  # ... of which each position chooses the best (topk_group)
    moe_scaling: float = 1.0  # the chosen experts' weights' factor (routed_scaling_factor)

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

    @property
    def rope_type(self) -> str:
        """How RoPE's frequencies are stretched: "default" (not), "llama3" or "yarn"."""
        return dict(self.rope_scaling).get("rope_type", "default")

    @property
    def qk_rope_head_dim(self) -> int:
        """Latent attention: the rotated part of each query and key head (head_dim, as HF)."""
        return self.head_dim

    def is_sliding(self, layer: int) -> bool:
        """Does this layer attend through a sliding window? Gemma 3 names each layer's kind;
        without `layer_types`, a window (Mistral) applies to every layer."""
        if self.layer_types:
            return self.layer_types[layer] == "sliding"
        return self.sliding_window > 0

    @property
    def rotary_dim(self) -> int | None:
        """How many of each head's dims RoPE turns, if not all (Qwen3-Next: a quarter)."""
        turned = int(self.head_dim * self.partial_rotary_factor)
        return turned if turned < self.head_dim else None

    def is_linear(self, layer: int) -> bool:
        """Is this a Gated DeltaNet layer (Qwen3-Next), a fixed state in place of a KV cache?"""
        return bool(self.layer_types) and self.layer_types[layer] == "linear"

    @property
    def deltanet_dims(self):
        """The DeltaNet layers' sizes (`DeltaNetDims`), or None if there are none."""

        return DeltaNetDims(*self.linear_attn, self.norm_eps) if self.linear_attn else None

    @property
    def varied_layers(self) -> bool:
        """Do the layers' attention and MLP differ in shape, or read each other's K, V
        (Gemma 4: `gemma4.config_layer_shapes`)?"""
        return bool(self.v_norm or self.k_eq_v or self.kv_shared_layers or self.global_head_dim)

    def is_moe(self, layer: int) -> bool:
        """Is this layer's MLP a mixture of experts? Qwen3-MoE may leave some layers dense
        (`mlp_types`); without it, every layer is MoE when the model has experts."""
        if self.mlp_types:
            return self.mlp_types[layer] == "moe"
        return self.n_experts > 0

    def has_rope(self, layer: int) -> bool:
        """Does this layer turn q and k by their position? SmolLM3 leaves every fourth alone."""
        return not self.no_rope_layers or self.no_rope_layers[layer] == 1

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
        dict), read as HF's config class of its model_type reads it (`families`): a key left out
        takes that class's default, a value that makes no model is refused by its key."""
        return cls(**FORMATS["from_hf"](source, name))

    def to_hf(self) -> dict:
        """The `config.json` HF's model class of this family (`LlamaForCausalLM`...) needs for
        these shapes (`families`)."""
        return FORMATS["to_hf"](self)

    @classmethod
    def from_gguf(cls, fields: dict, name: str = "gguf-model", where: str = "GGUF") -> Config:
        """From GGUF metadata, as a plain dict of key -> value (see
        `weights.gguf.read_metadata`); `where` names the file in errors. A key llama.cpp
        derives when it is left out is derived as llama.cpp does; ids are never invented."""
        return cls(**FORMATS["from_gguf"](fields, name, where))


FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}
MLP_ACTS = ("silu", "gelu_tanh", "gpt_oss")  # gpt_oss: experts only
LAYER_KINDS = ("full", "sliding", "linear", "chunked")

