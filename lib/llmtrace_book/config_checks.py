"""The checks of the fields one mechanism brings to `Config`, one function each: Qwen3-Next's
(Gated DeltaNet), Gemma 4's, a mixture of experts', SmolLM3's layers without RoPE, RoPE's
stretch (Llama 3, YaRN), latent attention's (DeepSeek), gpt-oss's and Llama 4's.
`config.config_problems` runs them in the order of `CHECKS`, after the checks every model has.

Each takes the fields as a dict and `key`, which spells a field as the user wrote it (see
`config_problems`), and returns its problems, [] if none. This module imports nothing of the
library but errors.py: config.py imports it, and so do moe.py (`ROUTERS`) and rope.py
(`yarn_checked`), which compute what these fields say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import LlmTraceError

# linear_attn's five numbers, as errors name them (`key` gives Qwen3-Next's config.json keys)
LINEAR_PARTS = tuple(f"linear_attn.{part}" for part in (
    "key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv_kernel"))
ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_group",
           "topk_sigmoid")  # how moe.py's routers choose
MLP_TYPES = ("dense", "moe")
LLAMA3_KEYS = ("factor", "high_freq_factor", "low_freq_factor", "original_max_position_embeddings")
# The keys of a YaRN rope_scaling that are computed here; HF's `partial_rotary_factor` (RoPE on
# part of each head) is not, and is refused by name.
YARN_KEYS = ("attention_factor", "beta_fast", "beta_slow", "factor", "mscale", "mscale_all_dim",
             "original_max_position_embeddings", "rope_theta", "rope_type", "truncate")


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


def qwen3_next_problems(v: dict, key=str) -> list[str]:
    """Qwen3-Next's fields: the DeltaNet layers' sizes (`linear_attn`), RoPE on part of each
    head, the attention's output gate."""
    problems = []
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
    return problems


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


def no_rope_problems(v: dict, key=str) -> list[str]:
    """SmolLM3's `no_rope_layers`: per layer 1 (RoPE) or 0 (none: NoPE)."""
    wrong = per_layer_problem(v, "no_rope_layers", (1, 0), key)
    return [wrong] if wrong else []


# the families whose models turn by YaRN's tables (`mechanisms.yarn`, read by families/_parts.py)
YARN_FAMILIES = ("deepseek_v3", "deepseek_v2", "gpt_oss")


def rope_scaling_problems(v: dict, key=str) -> list[str]:
    """RoPE's stretch for long contexts: Llama 3's, or YaRN's (DeepSeek-V3, gpt-oss)."""
    scaling = dict(v["rope_scaling"])
    if scaling.get("rope_type") == "yarn" and v["family"] not in YARN_FAMILIES:
        return [f"{key('rope_scaling')} of type 'yarn' with family {v['family']!r}: YaRN is "
                f"computed for {', '.join(YARN_FAMILIES)} (their models' RoPE tables)"]
    if scaling.get("rope_type") == "yarn":  # YaRN: `yarn_checked` checks its keys
        return yarn_problems(scaling, key)
    if scaling and (scaling.get("rope_type") != "llama3" or set(LLAMA3_KEYS) - set(scaling)):
        return [f"{key('rope_scaling')}={scaling} is not Llama 3's (rope_type 'llama3' "
                f"and {', '.join(LLAMA3_KEYS)}) nor YaRN's (rope_type 'yarn')"]
    return []


def yarn_problems(scaling: dict, key=str) -> list[str]:
    try:
        yarn_checked(scaling)
    except LlmTraceError as e:
        return [f"{key('rope_scaling')}: {e}"]
    return []


def yarn_checked(s: dict, theta: float | None = None) -> dict:
    """s, a YaRN rope_scaling, or a one-line error naming the key not computed here."""
    for key in s:
        if key not in YARN_KEYS:
            raise LlmTraceError(f"rope_scaling {key}={s[key]!r} is not computed for YaRN "
                                f"(known: {', '.join(YARN_KEYS)}): remove it")
    for key in ("factor", "original_max_position_embeddings"):
        if not s.get(key):
            raise LlmTraceError(f"rope_scaling of type 'yarn' needs a positive {key}, "
                                f"got {s.get(key)!r}: write it in the config")
    for key in ("attention_factor", "beta_fast", "beta_slow", "factor", "mscale",
                "mscale_all_dim", "original_max_position_embeddings"):
        v = s.get(key)
        least = 0 if key.startswith("mscale") else 1e-300  # mscale 0: not used, as in HF
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                              or v < least):
            raise LlmTraceError(f"rope_scaling {key}={v!r} must be a "
                                f"{'number' if least == 0 else 'positive number'}")
    if "truncate" in s and not isinstance(s["truncate"], bool):
        raise LlmTraceError(f"rope_scaling truncate={s['truncate']!r} must be true or false")
    if theta is not None and s.get("rope_theta", theta) != theta:
        raise LlmTraceError(f"rope_scaling rope_theta={s['rope_theta']!r} differs from the "
                            f"RoPE base {theta!r}: write one base")
    return s


def mla_problems(v: dict, key=str) -> list[str]:
    """What makes a latent-attention config no DeepSeek model (HF's DeepseekV3Attention);
    nothing without latent attention (kv_lora_rank 0)."""
    if not v["kv_lora_rank"]:
        return []
    problems = [f"{key(f)}=0 must be at least 1 with {key('kv_lora_rank')} set"
                for f in ("qk_nope_head_dim", "v_head_dim") if not v[f]]
    if v["n_kv_heads"] != v["n_heads"]:
        problems.append(f"{key('n_kv_heads')}={v['n_kv_heads']} must equal {key('n_heads')}="
                        f"{v['n_heads']}: latent attention rebuilds K and V for every head")
    if any((v["sliding_window"], v["layer_types"])):
        problems.append("a sliding window with latent attention is no model computed here")
    return problems


def gpt_oss_problems(v: dict, key=str) -> list[str]:
    """gpt-oss's fields: the attention's sinks and output bias, its experts' clamped GLU."""
    problems = []
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
    return problems


def llama4_problems(v: dict, key=str) -> list[str]:
    """Llama 4's fields: chunked layers need the chunk's width; the NoPE layers' temperature is
    () or (floor, scale), a whole number of positions and a strength."""
    problems = []
    types, chunk = v["layer_types"], v["attention_chunk"]
    if isinstance(types, tuple) and "chunked" in types and chunk == 0:
        problems.append(f"{key('layer_types')} has chunked layers but {key('attention_chunk')}"
                        f"=0: give the chunk's width")
    t = v["attn_temperature"]
    if t != () and not (isinstance(t, tuple) and len(t) == 2 and isinstance(t[0], int)
                        and not isinstance(t[0], bool) and t[0] >= 1
                        and isinstance(t[1], (int, float)) and not isinstance(t[1], bool)
                        and math.isfinite(t[1]) and t[1] >= 0):
        problems.append(f"{key('attn_temperature')}={t!r:.60} must be () or (floor_scale, "
                        f"attn_scale): a whole number of positions >= 1 and a number >= 0")
    return problems


# In the order config_problems reports their problems (tests match it)
CHECKS = (qwen3_next_problems, gemma4_problems, moe_problems, no_rope_problems,
          rope_scaling_problems, mla_problems, gpt_oss_problems, llama4_problems)


@dataclass(frozen=True)
class DeltaNetDims:
    """A DeltaNet layer's sizes (HF's config keys beside each)."""
    n_k_heads: int  # linear_num_key_heads
    n_v_heads: int  # linear_num_value_heads
    k_head_dim: int  # linear_key_head_dim
    v_head_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim
    norm_eps: float = 1e-6  # rms_norm_eps, for the gated RMSNorm

    @property
    def key_dim(self) -> int:  # Hk * dk: q and k each
        return self.n_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:  # Hv * dv: v and z each
        return self.n_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:  # C: q, k and v convolved side by side
        return 2 * self.key_dim + self.value_dim

    def check(self) -> "DeltaNetDims":
        if self.n_v_heads % self.n_k_heads:
            raise LlmTraceError(
                f"linear_num_value_heads ({self.n_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.n_k_heads}): each key head serves a "
                f"whole group of value heads")
        if self.conv_kernel < 2:
            raise LlmTraceError(f"linear_conv_kernel_dim must be 2 or more, "
                                f"got {self.conv_kernel}")
        return self
