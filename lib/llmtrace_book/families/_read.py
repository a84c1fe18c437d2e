"""Reading a config.json key by key, as HF's config classes read them; shared by every family."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..config import LLAMA3_KEYS, Config
from ..errors import LlmTraceError, read_json
from ..config_checks import yarn_checked

KIND_WORDS = {int: "an integer", float: "a number", bool: "true or false"}
# The keys whose null HF reads as "none" (no BOS, no end id, no pad, no window, no soft cap) or
# as "derive it" (num_key_value_heads, head_dim); a null elsewhere is refused
NULLABLE = ("num_key_value_heads", "head_dim", "bos_token_id", "eos_token_id", "pad_token_id",
            "sliding_window", "final_logit_softcapping")
# The config.json key each field of Config is read from: errors name what the user wrote
HF_KEYS = {"n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
           "n_kv_heads": "num_key_value_heads", "ffn_size": "intermediate_size",
           "max_positions": "max_position_embeddings", "norm_eps": "rms_norm_eps",
           "tied_lm_head": "tie_word_embeddings", "bos_id": "bos_token_id",
           "eos_id": "eos_token_id", "stop_ids": "eos_token_id", "pad_id": "pad_token_id",
           "rope_local_theta": "rope_local_base_freq", "attn_scale": "query_pre_attn_scalar"}
REQUIRED = object()  # HFKeys.get's default: the key must be there


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


class HFKeys:
    """A config.json's settings, read key by key as HF's config class of its model_type reads
    them: a key left out takes the class's default (the family's `defaults`), a null means
    what HF makes of it (`NULLABLE`) or is refused, a value of the wrong kind is refused by
    its key."""

    def __init__(self, c: dict, where: str, family):
        self.c, self.where, self.family = c, where, family.model_type
        self.defaults, self.not_null = family.defaults, family.not_null
        self.config_class = family.config_class
        self.keys = {**HF_KEYS, **family.keys}
        self.left_out: set[str] = set()

    def get(self, key: str, kind, default=REQUIRED, least: int | None = None):
        if key not in self.c:
            if default is REQUIRED:
                raise LlmTraceError(f"{self.where} lacks {key!r}: a Llama config.json names it")
            self.left_out.add(key)
            return default
        value = self.c[key]
        if value is None:
            if key in NULLABLE and key not in self.not_null:
                return None
            default_word = "" if default is REQUIRED else \
                f", or leave the key out for {self.config_class}'s {default}"
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
        return self.keys.get(field, field)

    def problems_said(self, problems: list[str]) -> str:
        """The problems as one line, saying which of the keys they name were left out."""
        named = sorted(k for k in self.left_out if any(f"{k}=" in p for p in problems))
        note = f" ({', '.join(named)} left out of the file: {self.config_class}'s " \
               f"default)" if named else ""
        return f"{self.where}: " + "; ".join(problems) + note


def common_fields(k: HFKeys) -> dict:
    """The fields every family reads alike: the shapes, the ids, Llama 3's rope_scaling. Each key
    is read explicitly (never `value or default`: a value written is used as written, or refused
    by its key)."""
    shapes = {field: k.get(HF_KEYS.get(field, field), int) for field in
              ("vocab_size", "hidden_size", "n_layers", "n_heads", "ffn_size")}  # no default
    kv, head_dim = k.default("num_key_value_heads", int), k.default("head_dim", int, least=1)
    eos_id, stop_ids = end_ids_of(k)
    return dict(
        **shapes,
        n_kv_heads=shapes["n_heads"] if kv is None else kv,  # None: num_attention_heads
        max_positions=k.default("max_position_embeddings", int),
        norm_eps=float(k.default("rms_norm_eps", float)),
        tied_lm_head=k.default("tie_word_embeddings", bool),
        bos_id=k.default("bos_token_id", int),
        eos_id=eos_id, stop_ids=stop_ids, pad_id=k.default("pad_token_id", int),
        head_dim=0 if head_dim is None else head_dim,  # 0: hidden_size // n_heads
        family=k.family,
        rope_scaling=rope_scaling_of(k.c, k.where),
    )


def plain_rope(k: HFKeys) -> dict:
    """RoPE's one base, from any of the places a config.json may give it: what a family reads
    when it has no fields of its own."""
    c = k.c
    return dict(rope_theta=rope_theta_of(k, {
        "rope_parameters.rope_theta": (c.get("rope_parameters"), "rope_theta"),
        "rope_scaling.rope_theta": (c.get("rope_scaling"), "rope_theta"),
        "rope_theta": (c, "rope_theta")}))


def llama_hf(c: Config) -> dict:
    """The config.json of Llama's HF class for these shapes: every family's starting point."""
    extra = {"rope_scaling": dict(c.rope_scaling)} if c.rope_scaling else {}
    return {
        "model_type": c.family,
        **extra,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.ffn_size,
        "max_position_embeddings": c.max_positions,
        "rope_theta": c.rope_theta,
        "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tied_lm_head,
        "bos_token_id": c.bos_id,
        "eos_token_id": [c.eos_id, *c.stop_ids] if c.stop_ids else c.eos_id,
        "pad_token_id": c.pad_id,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


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
    """Llama 3's or YaRN's rope_scaling as sorted (key, value) pairs, checked; () for plain
    RoPE. YaRN's older "type" key is read as rope_type; its rope_theta is `rope_theta`'s."""
    kind, params = rope_kind(c)
    if kind == "default":
        return ()
    if kind == "yarn":
        s = {k: v for k, v in params.items() if k not in ("type", "rope_theta")}
        try:
            yarn_checked({**s, "rope_type": "yarn"})
        except LlmTraceError as e:
            raise LlmTraceError(f"{where}: {e}") from None
        return tuple(sorted({**s, "rope_type": "yarn"}.items()))
    values = {k: params.get(k) for k in LLAMA3_KEYS}
    bad = [k for k, v in values.items()
           if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0]
    if bad or values["high_freq_factor"] < values["low_freq_factor"]:  # equal: Llama 4 Scout's
        raise LlmTraceError(f"{where}: rope_scaling of type 'llama3' needs positive "
                            f"{', '.join(LLAMA3_KEYS)} (high at least low), got "
                            f"{ {k: values[k] for k in bad} or values }")
    return tuple(sorted({**values, "rope_type": "llama3"}.items()))
