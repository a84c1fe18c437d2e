"""Each family the library computes, in a home of its own: one module per HF `model_type`, each
holding its `Family` entry (its HF classes, the fields of `Config` it sets, HF's default for each
key its config.json may leave out, how those keys are read into `Config`'s fields and written
back, its refusals) and its model: a subclass of `model.Model` that states how its layers differ
from Llama's parts, as HF's modular_*.py files do, e.g. Qwen2's:

    class Qwen2(Model, family="qwen2"):
        def attention(self, i):
            c = self.config
            return part(c.qkv_bias and Biased, window(c, i), Attention)(c, i)

Llama's parts (attention.py, mlp.py, norm.py, block.py) never name a family; what other families
add is `mechanisms/` (a step of Llama's attention overridden, a mixture of experts, latent
attention...), and `_parts.py` the choices several families read from the same fields.

Every part names the weights it reads, under HF's names, with their shapes (`parts.Part`:
`tensors`, and `load`, `save`, `on_disk` where it stores them otherwise); loading, saving,
checking a checkpoint and counting parameters loop over a layer's parts. A family that stores a
part's weights under other names subclasses it and says so, as Mixtral's experts do:

    class MixtralMoE(MoE):
        block, kinds = "block_sparse_moe", ("w1", "w3", "w2")

To add a family: write `families/<name>.py` (copy the nearest one: `olmoe.py` is the newest),
holding `FAMILY = Family(...)` and its `Model` subclass, and add its line to `REGISTRY` below.
If it brings a mechanism no family had, write it as a part (or one step) in `mechanisms/`, with
its weights (`tensors`) and its fields in `Config` (validated in `config_checks.py`). Then one
row in `tests/tiny_checkpoint.py`'s `ROWS` (HF's classes, a tiny config.json, the fields to turn
off, the records only it has): the parity, map and shape tests read it.

A mixture of experts is fields: `read` sets n_experts, n_experts_active, moe_ffn_size,
moe_router (a `mechanisms.moe.Router` by its name in config_checks.ROUTERS), moe_renormalize
and, when some layers stay dense, mlp_types (per layer "dense" or "moe"); `Config.is_moe(i)`
says which layers are a `mechanisms.moe.MoE` (or the family's subclass), whose weights are
`w.moe` (moe.MoeWeights).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from ..config import FIELD_DEFAULTS, FORMATS, Config, config_problems
from ..config_checks import YARN_FAMILIES
from ..errors import LlmTraceError
from ..model import Model
from ._read import HFKeys, common_fields, llama_hf, plain_rope, read_hf_config, rope_kind


def _nothing(*_) -> dict:
    return {}


@dataclass(frozen=True)
class Family:
    model_type: str  # HF's model_type, the key of the registry and `Config.family`
    label: str  # what a reader calls it, for the list of families computed
    model_class: str  # HF's model class: "LlamaForCausalLM"
    config_class: str  # HF's config class: "LlamaConfig"
    defaults: dict  # what HF's config class gives a key config.json leaves out (a test checks)
    switches: dict = field(default_factory=dict)  # Config fields the family always sets so
    varies: tuple = ()  # switches each model of the family sets (read by `read`)
    read: Callable[[HFKeys], dict] = plain_rope  # the family's own fields from its config.json
    write: Callable[[Config, dict], dict] = lambda c, hf: hf  # Llama's config.json made its own
    refuse: Callable[[dict, str], None] = _nothing  # raise on settings the family has but
    # llmtrace does not compute
    biased: tuple = ()  # keys that, true, add a bias llmtrace does not compute
    not_null: tuple = ()  # NULLABLE keys HF's class types as int: a null is refused
    keys: dict = field(default_factory=dict)  # field -> the config.json key it is read from,
    # where the family's differs from _read.HF_KEYS' (errors name what the user wrote)


from . import gemma3, gemma4, llama, mistral, olmo2, olmo3  # noqa: E402  (they import Family)
from . import qwen2, qwen3, smollm3  # noqa: E402
from . import mixtral, olmoe, qwen3_moe  # noqa: E402  (mixtures of experts)
from . import deepseek_v2, deepseek_v3  # noqa: E402  (latent attention)
from . import gpt_oss  # noqa: E402  (sinks, experts with biases)
from . import qwen3_5_text, qwen3_next  # noqa: E402  (Gated DeltaNet layers)
from . import llama4  # noqa: E402  (chunked attention, experts scaling their input)

# model_type -> its entry: one line per family
REGISTRY: dict[str, Family] = {f.model_type: f for f in (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    gemma3.FAMILY,
    olmo2.FAMILY,
    gemma4.FAMILY,
    mixtral.FAMILY,
    qwen3_moe.FAMILY,
    olmo3.FAMILY,
    smollm3.FAMILY,
    deepseek_v3.FAMILY,
    deepseek_v2.FAMILY,
    gpt_oss.FAMILY,
    qwen3_next.FAMILY,
    qwen3_5_text.FAMILY,
    olmoe.FAMILY,
    llama4.FAMILY,
)}
# the fields of Config that only some families set; a family sets each to its default, to the
# value in its `switches`, or (in `varies`) to what its config.json says
SWITCHES = ("qkv_bias", "qk_norm", "qk_proj_norm", "sliding_window", "norm_offset",
            "sandwich_norm", "pre_norm", "mlp_act", "embed_scale", "attn_scale", "layer_types",
            "rope_local_theta", "global_head_dim", "global_kv_heads", "k_eq_v",
            "kv_shared_layers", "double_wide_mlp", "ple_size", "ple_vocab", "rope_partial",
            "v_norm", "layer_scalar", "final_softcap", "n_experts", "n_experts_active",
            "moe_ffn_size", "moe_router", "moe_renormalize", "mlp_types", "kv_lora_rank",
            "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "rope_interleave",
            "n_shared_experts", "moe_groups", "moe_groups_chosen", "moe_scaling",
            "no_rope_layers", "attn_sinks", "o_bias", "swiglu_limit", "swiglu_alpha",
            "attn_output_gate", "partial_rotary_factor", "linear_attn", "shared_ffn_size",
            "attention_chunk", "qk_l2_norm", "attn_temperature")
# each family's model refuses a field of another family set on its config (`Model.check_fields`)
Model.family_fields = SWITCHES
for _family in REGISTRY.values():
    Model.families[_family.model_type].computes = frozenset((*_family.switches, *_family.varies))
COMPUTED = ("llmtrace computes Llama-family models "
            f"({', '.join(f.label for f in REGISTRY.values())})")
# model_types refused by name, for what they compute instead of a Llama block
MOE = ("qwen2_moe", "dbrx", "granitemoe", "phimoe", "jamba")  # llama4: NOT_TEXT
# the families whose experts are computed (moe.py): their config.json's experts are read
WITH_EXPERTS = tuple(f.model_type for f in REGISTRY.values() if "n_experts" in f.varies)
MLA = ("kimi_k2",)
# the families whose YaRN is computed and checked against their HF class (rope.py)
YARN = YARN_FAMILIES
# the families whose latent attention is computed (mla.py)
MLA_COMPUTED = tuple(f.model_type for f in REGISTRY.values() if "kv_lora_rank" in f.varies)
SOFTCAP = ("gemma2",)
FINAL_SOFTCAP = ("gemma4_text",)  # its final_logit_softcapping is computed (gemma4.softcap)
# a family's text model is computed, not this one
NOT_TEXT = {"gemma3": gemma3.WITH_VISION, "gemma4": gemma4.WITH_TOWERS,
            "qwen3_5": qwen3_5_text.WITH_VISION, "llama4": llama4.WITH_VISION}


def family_of(model_type: str, where: str) -> Family:
    """The registry's entry for a config.json's model_type, or one line saying why none."""
    if model_type in NOT_TEXT:
        raise LlmTraceError(f"{where}: {NOT_TEXT[model_type]}")
    if model_type not in REGISTRY:
        raise LlmTraceError(f"{where}: model_type {model_type!r} is not a Llama-family model: "
                            f"{COMPUTED}")
    return REGISTRY[model_type]


def read_hf(source, name: str | None) -> dict:
    """`Config`'s fields from a config.json (`Config.from_hf`): what every family reads alike,
    then the family's switches and its own keys, all checked by the key they came from."""
    c, where, name = read_hf_config(source, name)
    refuse_unsupported(c, where)  # first: it names what a refused model_type lacks
    family = family_of(c.get("model_type", "llama"), where)
    for key in family.biased:
        if c.get(key):
            raise LlmTraceError(f"{where}: {key}=true (projections with a bias vector) is not "
                                f"implemented, only Qwen2's bias on Q, K and V: {COMPUTED}")
    family.refuse(c, where)
    keys = HFKeys(c, where, family)
    fields = {**common_fields(keys), **family.switches, **family.read(keys)}
    fields["name"] = name if name is not None else c.get("_name_or_path") or "hf-model"
    problems = config_problems({**FIELD_DEFAULTS, **fields}, keys.key)
    if problems:
        raise LlmTraceError(keys.problems_said(problems))
    return fields


def check_switches(c: Config, family: Family) -> None:
    """Refuse a switch the family's HF class does not compute as set: written as that family,
    it would be a different model."""
    for name in SWITCHES:
        value, default = getattr(c, name), FIELD_DEFAULTS[name]
        if name in family.switches and value != family.switches[name]:
            raise LlmTraceError(f"config {c.name!r}: {name}={value!r}, but HF's "
                                f"{family.model_class} always computes "
                                f"{name}={family.switches[name]!r}: set it so, or another family")
        if name not in family.switches and name not in family.varies and value != default:
            those = [f.model_type for f in REGISTRY.values()
                     if name in f.varies or f.switches.get(name, default) == value]
            raise LlmTraceError(f"config {c.name!r}: {name}={value!r} set with family "
                                f"{c.family!r}: HF's {family.model_class} does not compute it; "
                                f"set family to one that does ({', '.join(those) or 'none'})")


def write_hf(c: Config) -> dict:
    """The config.json of the family's HF class for this config (`Config.to_hf`)."""
    if c.family not in REGISTRY:
        raise LlmTraceError(f"config {c.name!r}: family {c.family!r} has no Hugging "
                            f"Face class here: use one of {', '.join(REGISTRY)}")
    family = REGISTRY[c.family]
    check_switches(c, family)
    return family.write(c, {"architectures": [family.model_class], **llama_hf(c)})


FORMATS.update(from_hf=read_hf, to_hf=write_hf)  # what Config.from_hf and Config.to_hf call


def listed(labels) -> str:
    """"A, B and C"."""
    *rest, last = labels
    return f"{', '.join(rest)} and {last}" if rest else last


def refuse_unsupported(c: dict, where: str) -> None:
    """Settings that change what the model computes, which this forward pass does not implement:
    running such a checkpoint would print wrong logits as if they were right."""
    family = c.get("model_type", "llama")
    if family in NOT_TEXT:  # its towers first: the text model alone may be computed
        raise LlmTraceError(f"{where}: {NOT_TEXT[family]}")
    if c.get("enable_moe_block"):  # Gemma 4's experts beside the MLP, said by their key
        raise LlmTraceError(f"{where}: enable_moe_block=true (experts beside each layer's "
                            f"MLP) is not implemented for Gemma 4: only its dense models")
    experts = next((k for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(c.get(k), int) and c[k] > 0), None)
    if (experts or family in MOE) and family not in WITH_EXPERTS:
        what = f"{experts}={c[experts]}" if experts else f"model_type {family!r}"
        labels = listed(REGISTRY[f].label for f in WITH_EXPERTS)
        raise LlmTraceError(f"{where}: a mixture of experts ({what}: each token goes through a "
                            f"few of many MLPs) is implemented only as {labels} compute it, "
                            f"not for model_type {family!r}: {COMPUTED}")
    latent = next((k for k in ("kv_lora_rank", "q_lora_rank") if c.get(k)), None)
    latent = None if family in MLA_COMPUTED else latent
    if latent or family in MLA:
        what = f"{latent}={c[latent]}" if latent else f"model_type {family!r}"
        labels = listed(REGISTRY[f].label for f in MLA_COMPUTED)
        raise LlmTraceError(f"{where}: multi-head latent attention ({what}: K and V rebuilt "
                            f"from a small latent) is implemented for {labels} only: "
                            f"{COMPUTED}")
    capped = next((k for k in ("attn_logit_softcapping", "final_logit_softcapping")
                   if c.get(k) and not (k == "final_logit_softcapping"
                                        and family in FINAL_SOFTCAP)), None)
    if capped or family in SOFTCAP:
        what = f"{capped}={c[capped]}" if capped else f"model_type {family!r}"
        raise LlmTraceError(f"{where}: attention logit soft-capping ({what}: scores squashed "
                            f"by tanh) is not implemented: {COMPUTED}")
    kind, _ = rope_kind(c)
    if kind not in ("default", "llama3", "yarn"):
        raise LlmTraceError(f"{where}: rope_scaling of type {kind!r} (RoPE stretched for long "
                            f"contexts) is not implemented, only Llama 3's 'llama3' and "
                            f"'yarn': {COMPUTED}")
    if kind == "yarn" and family not in YARN:
        raise LlmTraceError(f"{where}: rope_scaling of type 'yarn' (RoPE stretched for long "
                            f"contexts) is implemented for "
                            f"{listed(REGISTRY[f].label for f in YARN)} only: {COMPUTED}")
    rope = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), dict) else {}
    partial = family in NOT_TEXT or family in REGISTRY and \
        "partial_rotary_factor" in REGISTRY[family].varies  # (a text model: said by family_of)
    for label, params in () if partial else (("partial_rotary_factor", c),
                                             ("rope_parameters.partial_rotary_factor", rope)):
        if params.get("partial_rotary_factor", 1.0) not in (1, 1.0):
            raise LlmTraceError(f"{where}: {label}={params['partial_rotary_factor']!r} (RoPE on "
                                f"part of each head) is not implemented: {COMPUTED}")
    act = c.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise LlmTraceError(f"{where}: hidden_act {act!r} is not implemented (the MLP is SwiGLU, "
                            f"with SiLU): {COMPUTED}")
