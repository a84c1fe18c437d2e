"""Hugging Face checkpoints: a directory with `config.json` and safetensors weights, one file
(`model.safetensors`) or sharded (`model.safetensors.index.json` naming the shard of each tensor).
Weights are read in the dtype they are stored in (TinyLlama ships bf16), or in the one asked
for; `weights.stream` reads a layer at a time instead of the whole checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..config import Config
from .names import expected_shapes
from ..errors import LlmTraceError, first_line, read_json
from ..tokenize import HFTokenizer, SentencePieceTokenizer


FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")  # a cast to fp32 reads these; int8 needs its scales
TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "F64": torch.float64}


def _weight_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        content = read_json(index, "a safetensors index with a weight_map")
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise LlmTraceError(f"{index} has no weight_map (tensor name -> shard file): "
                                f"download it again")
        shards = sorted(set(map(str, weight_map.values())))
        missing = [s for s in shards if not (d / s).is_file()]
        if missing:
            raise LlmTraceError(f"{d}: shard {missing[0]} named in the index is missing: "
                                "download it again")
        return [d / s for s in shards]
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    raise LlmTraceError(f"{d} has no model.safetensors nor model.safetensors.index.json: "
                        f"only safetensors checkpoints are read")


def safetensors_header(f: Path) -> dict:
    """The header of a safetensors file, checked against the file's size: a file cut short (an
    interrupted download or copy) is refused here, before anything maps it."""
    bad = f"{f} is not a complete safetensors file"
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if size < 8 or n > size - 8:
                raise LlmTraceError(f"{bad} ({size:,} bytes, shorter than its header): "
                                    f"download it again")
            header = json.loads(fh.read(n))
        assert isinstance(header, dict)
        tensors = [t for k, t in header.items() if k != "__metadata__"]
        end = max((int(t["data_offsets"][1]) for t in tensors), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AssertionError):
        raise LlmTraceError(f"{bad} (its header is unreadable): download it again") from None
    if size != 8 + n + end:
        raise LlmTraceError(f"{bad}: {size:,} bytes where its header describes {8 + n + end:,}: "
                            f"download it again")
    for k, t in header.items():
        if k != "__metadata__" and t.get("dtype") not in FLOAT_DTYPES:
            raise LlmTraceError(f"{f}: tensor {k} is {t.get('dtype')}, not a float type: quantized "
                                f"weights need their scales, which llmtrace does not read; "
                                f"use an fp32, fp16 or bf16 checkpoint")
    return header


def headers(d: Path) -> dict[str, tuple[Path, dict]]:
    """Every tensor of the checkpoint in directory d: name -> (its file, its header entry:
    dtype, shape, data_offsets), each file's header checked; nothing is read past the headers."""
    return {k: (f, t) for f in _weight_files(d) for k, t in safetensors_header(f).items()
            if k != "__metadata__"}


def stored_dtype(entries: dict[str, tuple[Path, dict]]) -> torch.dtype:
    """The dtype most of the checkpoint's numbers are stored in (a few norms kept in fp32 beside
    bf16 matrices do not make it an fp32 checkpoint)."""
    count: dict[str, int] = {}
    for _, t in entries.values():
        count[t["dtype"]] = count.get(t["dtype"], 0) + math.prod(t["shape"])
    return TORCH_DTYPES[max(count, key=count.get)] if count else torch.float32


def load_tokenizer(d: Path, config: Config):
    extra = d / "tokenizer_config.json"
    settings = read_json(extra, "the tokenizer's settings") if extra.is_file() else {}
    if not isinstance(settings, dict):
        raise LlmTraceError(f"{extra} holds a {type(settings).__name__}, not an object of settings")
    add_bos = settings.get("add_bos_token")
    tok = None
    try:
        if (d / "tokenizer.model").is_file():
            tok = SentencePieceTokenizer(d / "tokenizer.model",
                                         add_bos=add_bos is None or bool(add_bos))
        elif (d / "tokenizer.json").is_file():
            tok = HFTokenizer.from_file(d / "tokenizer.json", config.bos_id, config.eos_id,
                                        add_bos=bool(add_bos))
            if add_bos is None:  # as HF does: BOS if tokenizer.json's post-processor adds it
                tok.add_bos = tok.tok.encode("a").ids[:1] == [config.bos_id] != \
                    tok.tok.encode("a", add_special_tokens=False).ids[:1]
    except LlmTraceError as e:  # settings that contradict config.json
        raise LlmTraceError(f"{d}: {e}") from None
    except Exception as e:  # sentencepiece and tokenizers raise their own kinds for a corrupt file
        first = first_line(e)[:120]
        raise LlmTraceError(f"{d}: the tokenizer file cannot be read ({first}): "
                            f"download it again") from None
    if tok is not None and tok.vocab_size > config.vocab_size:
        raise LlmTraceError(f"{d}: the tokenizer has {tok.vocab_size:,} pieces but the model's "
                            f"embedding only {config.vocab_size:,} rows: the tokenizer belongs to "
                            f"another model")
    return tok


def is_mtp(name: str, n_layers: int) -> bool:
    """Is this tensor in a layer past the model's last (model.layers.61.* of DeepSeek-V3)?"""
    parts = name.split(".")
    return name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= n_layers


def is_empty_shared_expert(name: str, config: Config) -> bool:
    """Is this tensor part of a shared expert of width 0 (DeepSeek's n_shared_experts 0,
    Qwen3-Next's shared_expert_intermediate_size 0)? HF's class still holds its empty matrices,
    and Qwen3-Next the gate that scales its zeros: what they add is 0."""
    return ".mlp.shared_expert" in name and bool(config.n_experts) and not (
        config.n_shared_experts or config.shared_ffn_size)


def read_config(directory: str | Path, name: str | None = None) -> tuple[Path, Config]:
    d = Path(directory)
    if not d.is_dir():
        raise LlmTraceError(f"{d} is not a directory: "
                            "point at a folder holding config.json and safetensors")
    return d, Config.from_hf(d, name=name or d.name)


def used(names, config: Config, d: Path) -> list[str]:
    """The tensors the model reads, of those the checkpoint holds: not a tied head's copy,
    DeepSeek-V3's multi-token-prediction layer past the last one (HF skips it too), nor an
    empty shared expert; a tensor no part of the model reads is refused by its name."""
    keep = [k for k in names if not (config.tied_lm_head and k == "lm_head.weight")
            and not (config.kv_lora_rank and is_mtp(k, config.n_layers))
            and not is_empty_shared_expert(k, config)]
    unexpected = sorted(set(keep) - set(expected_shapes(config)) - {"model.rotary_emb.inv_freq"})
    if unexpected:
        raise LlmTraceError(f"{d}: unexpected tensor {unexpected[0]} for a Llama model")
    return keep


def read_tensors(f: Path, names, dtype=None, device="cpu") -> dict[str, torch.Tensor]:
    """Those tensors of one safetensors file, memory-mapped by safetensors, in `dtype` (None:
    as stored) on `device`."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(f, framework="pt") as fh:
            return {k: fh.get_tensor(k).to(device=device, dtype=dtype) for k in names}
    except (SafetensorError, OSError) as e:
        raise LlmTraceError(f"{f} cannot be read as safetensors ({e}): "
                            f"download it again") from None


COPY_BLOCK = 64 * 2**20  # bytes copied out of a file's mapping at a time (`read_copies`)


def read_copies(f: Path, names, dtype=None, device="cpu") -> dict[str, torch.Tensor]:
    """Those tensors, copied out of safetensors' mapping a block of rows at a time, the file
    opened afresh for each block: the mapping, and the pages it read, go when the block is
    copied. (A tensor that views the mapping keeps the whole file mapped, and every page read
    through it resident, for as long as it lives.)"""
    from safetensors import SafetensorError, safe_open

    out = {}
    try:
        for k in names:
            with safe_open(f, framework="pt") as fh:
                view = fh.get_slice(k)
                shape, stored = view.get_shape(), TORCH_DTYPES[view.get_dtype()]
            t = torch.empty(shape, dtype=dtype or stored, device=device)
            row = math.prod(shape[1:]) * stored.itemsize if shape else 1
            step = max(1, COPY_BLOCK // max(row, 1))
            for a in range(0, shape[0] if shape else 1, step):
                with safe_open(f, framework="pt") as fh:
                    if shape:
                        t[a:a + step].copy_(fh.get_slice(k)[a:a + step])
                    else:
                        t.copy_(fh.get_tensor(k))
            out[k] = t
    except (SafetensorError, OSError) as e:
        raise LlmTraceError(f"{f} cannot be read as safetensors ({e}): "
                            f"download it again") from None
    return out


def load_hf(directory: str | Path, name: str | None = None, dtype: torch.dtype | None = None,
            device="cpu"):
    """(config, state dict, tokenizer) from a Hugging Face model directory: every tensor the
    model reads, in `dtype` (None: the dtype it is stored in) on `device`."""
    d, config = read_config(directory, name)
    entries = headers(d)
    keep = set(used(entries, config, d))
    sd = {}
    for f in dict.fromkeys(f for f, _ in entries.values()):
        sd.update(read_tensors(f, [k for k, (g, _) in entries.items() if g == f and k in keep],
                               dtype, device))
    return config, sd, load_tokenizer(d, config)


def save_hf(directory: str | Path, config: Config, sd: dict[str, torch.Tensor], tokenizer=None,
            max_shard_bytes: int | None = None) -> Path:
    """Write a checkpoint HF's `LlamaForCausalLM.from_pretrained` reads: config.json and
    safetensors, sharded with an index when max_shard_bytes is given."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config.to_hf(), indent=2))
    tensors = {k: v.contiguous() for k, v in sd.items()}
    if max_shard_bytes is None:
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    else:
        shards, current, size = [], {}, 0
        for k, v in tensors.items():
            if current and size + v.numel() * v.element_size() > max_shard_bytes:
                shards.append(current)
                current, size = {}, 0
            current[k] = v
            size += v.numel() * v.element_size()
        shards.append(current)
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, d / fname, metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
        total = sum(v.numel() * v.element_size() for v in tensors.values())
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": tokenizer.add_bos}))
    return d
