"""Hugging Face checkpoints: a directory with `config.json` and safetensors weights, one file
(`model.safetensors`) or sharded (`model.safetensors.index.json` naming the shard of each tensor).
Weights are read as fp32 whatever they were saved in (TinyLlama ships bf16)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import Config, expected_shapes
from ..errors import LlmTraceError
from ..tokenize import HFTokenizer, SentencePieceTokenizer


def _weight_files(d: Path) -> list[Path]:
    index = d / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (d / s).is_file()]
        if missing:
            raise LlmTraceError(f"{d}: shard {missing[0]} named in the index is missing: download it again")
        return [d / s for s in shards]
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    raise LlmTraceError(f"{d} has no model.safetensors nor model.safetensors.index.json: "
                        f"only safetensors checkpoints are read")


def load_tokenizer(d: Path, config: Config):
    extra = d / "tokenizer_config.json"
    settings = json.loads(extra.read_text()) if extra.is_file() else {}
    if (d / "tokenizer.model").is_file():
        return SentencePieceTokenizer(d / "tokenizer.model", add_bos=settings.get("add_bos_token", True))
    if (d / "tokenizer.json").is_file():
        return HFTokenizer.from_file(d / "tokenizer.json", config.bos_id, config.eos_id,
                                     add_bos=settings.get("add_bos_token", False))
    return None


def load_hf(directory: str | Path, name: str | None = None):
    """(config, state dict, tokenizer) from a Hugging Face model directory."""
    from safetensors.torch import load_file

    d = Path(directory)
    if not d.is_dir():
        raise LlmTraceError(f"{d} is not a directory: point at a folder holding config.json and safetensors")
    config = Config.from_hf(d, name=name or d.name)
    sd = {}
    for f in _weight_files(d):
        sd.update({k: v.float() for k, v in load_file(f).items()})
    if config.tied_lm_head:
        sd.pop("lm_head.weight", None)
    unexpected = sorted(set(sd) - set(expected_shapes(config)) - {"model.rotary_emb.inv_freq"})
    if unexpected:
        raise LlmTraceError(f"{d}: unexpected tensor {unexpected[0]} for a Llama model")
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
