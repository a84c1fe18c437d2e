"""Loaders under bad input: config.json, weights, tokenizers, GGUF files, model names. Each
failure is one line that says what was wrong and what to do. The checkpoints are copies of the
tiny one (`ckpt`), broken on purpose."""

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import edit_config, one_line
from llmtrace_book import Config, LlmTraceError, load_model


# --- loaders: config.json -----------------------------------------------------------------
@pytest.mark.parametrize("change, says", [
    ({"hidden_size": "64"}, "hidden_size must be an integer, got '64'"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers must be an integer, got 2.5"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number"),
    ({"num_attention_heads": 0}, "num_attention_heads=0 must be at least 1"),
    ({"num_key_value_heads": 3},
     "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    ({"rope_theta": -10000.0, "rope_parameters": None},
     "rope_theta=-10000.0 must be a positive number"),
    ({"bos_token_id": 99999}, "bos_token_id=99999 is not below vocab_size=32000"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope_scaling of type 'llama3' needs positive factor, high_freq_factor"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_scaling of type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not implemented"),
    ({"attention_bias": True}, "attention_bias=true (projections with a bias vector) is not"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 1},
     "use_sliding_window=true (a window on the layers from max_window_layers on"),
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not a Llama-family model"),
    ({"num_local_experts": 8}, "a mixture of experts (num_local_experts=8: each token"),
    ({"model_type": "qwen2_moe"}, "a mixture of experts (model_type 'qwen2_moe'"),
    ({"kv_lora_rank": 512}, "multi-head latent attention (kv_lora_rank=512: K and V"),
    ({"attn_logit_softcapping": 50.0}, "attention logit soft-capping (attn_logit_softcapping=50"),
    ({"final_logit_softcapping": 30.0}, "soft-capping (final_logit_softcapping=30.0"),
    ({"model_type": "gemma2"}, "attention logit soft-capping (model_type 'gemma2'"),
])
def test_config_values(ckpt, change, says):
    edit_config(ckpt, **change)
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert says in one_line(err)


def test_unsupported_says_what_is_computed(ckpt):
    edit_config(ckpt, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(LlmTraceError, match="llmtrace computes Llama-family models"):
        load_model(ckpt)


def test_sliding_window_is_mistrals(ckpt):
    edit_config(ckpt, sliding_window=3)  # HF's Llama class ignores the key, so does llmtrace
    assert load_model(ckpt).config.sliding_window == 0
    edit_config(ckpt, model_type="mistral")
    assert load_model(ckpt).config.sliding_window == 3


@pytest.mark.parametrize("content, says", [
    ("{not json", "config.json is not valid JSON"),
    ("[1, 2]", "holds a list, not an object of settings"),
    (json.dumps({"model_type": "llama"}), "lacks 'vocab_size': a Llama config.json names it"),
])
def test_config_file(ckpt, content, says):
    (ckpt / "config.json").write_text(content)
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert says in one_line(err)


def test_config_dataclass_validates_before_dividing():
    with pytest.raises(LlmTraceError, match=r"n_heads=0 must be at least 1; n_kv_heads=0 must be"):
        Config("x", 100, 64, 2, 0, 0, 128, 256)


# --- loaders: weights and tokenizers --------------------------------------------------------
def test_truncated_safetensors(ckpt):
    f = ckpt / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 1000)
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert "is not a complete safetensors file" in one_line(err)
    assert "download it again" in str(err.value)


def test_safetensors_garbage(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(LlmTraceError, match="its header is unreadable"):
        load_model(ckpt)


def test_int8_weights_are_refused(ckpt):
    from safetensors.torch import load_file, save_file

    sd = load_file(ckpt / "model.safetensors")
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].to(torch.int8)
    save_file(sd, ckpt / "model.safetensors")
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert "up_proj.weight is I8, not a float type" in one_line(err)
    assert "use an fp32, fp16 or bf16 checkpoint" in str(err.value)


@pytest.mark.parametrize("index, says", [
    ({"metadata": {}}, "has no weight_map (tensor name -> shard file)"),
    ({"weight_map": []}, "has no weight_map"),
    ("{broken", "model.safetensors.index.json is not valid JSON"),
    ({"weight_map": {"model.norm.weight": "m-2.safetensors"}}, "shard m-2.safetensors named in"),
])
def test_index(ckpt, index, says):
    (ckpt / "model.safetensors").unlink()
    text = index if isinstance(index, str) else json.dumps(index)
    (ckpt / "model.safetensors.index.json").write_text(text)
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert says in one_line(err)


@pytest.mark.parametrize("file, content, says", [
    ("tokenizer.model", b"\x00garbage" * 100, "the tokenizer file cannot be read"),
    ("tokenizer_config.json", b"{", "tokenizer_config.json is not valid JSON"),
    ("tokenizer_config.json", b"[]", "not an object of settings"),
])
def test_tokenizer_files(ckpt, file, content, says):
    (ckpt / file).write_bytes(content)
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert says in one_line(err)


def test_corrupt_tokenizer_json(ckpt):
    (ckpt / "tokenizer.model").unlink()
    (ckpt / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 7}}')
    with pytest.raises(LlmTraceError, match="tokenizer file cannot be read .*download it again"):
        load_model(ckpt)


def test_tokenizer_larger_than_the_vocabulary(ckpt):
    edit_config(ckpt, vocab_size=1000)
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert "tokenizer has 32,000 pieces but the model's embedding only 1,000 rows" in one_line(err)


def write_gguf(path: Path, tokens=True, merges=True, int8=False, heads=4):
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.vocab_size", 8)
    w.add_uint32("llama.embedding_length", 8)
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.attention.head_count", heads)
    w.add_uint32("llama.attention.head_count_kv", 2)
    w.add_uint32("llama.feed_forward_length", 16)
    w.add_uint32("llama.context_length", 32)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("tokenizer.ggml.model", "gpt2")
    if tokens:
        w.add_array("tokenizer.ggml.tokens", ["a", "b", "c", "d", "ab", "cd", "<s>", "</s>"])
        w.add_array("tokenizer.ggml.token_type", [1] * 6 + [3, 3])
    if merges:
        w.add_array("tokenizer.ggml.merges", ["a b", "c d"])
    w.add_tensor("token_embd.weight", np.ones((8, 8), dtype=np.int8 if int8 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind, says", [
    (dict(tokens=False), "lacks tokenizer.ggml.tokens: the file has no complete tokenizer"),
    (dict(merges=False), "lacks tokenizer.ggml.merges: the file has no complete tokenizer"),
    (dict(int8=True), "token_embd.weight holds raw I8 integers"),
    (dict(heads=0), "llama.attention.head_count=0 must be at least 1"),
])
def test_gguf_contents(tmp_path, kind, says):
    write_gguf(tmp_path / "m.gguf", **kind)
    with pytest.raises(LlmTraceError) as err:
        load_model(tmp_path / "m.gguf")
    assert says in one_line(err)


def test_gguf_garbage_and_upper_case(tmp_path):
    (tmp_path / "M.GGUF").write_bytes(b"GGUF" + b"\xff" * 64)  # read as GGUF, not as a directory
    with pytest.raises(LlmTraceError) as err:
        load_model(tmp_path / "M.GGUF")
    assert "cannot read" in one_line(err) and "as GGUF" in str(err.value)


def test_fifo_named_gguf_does_not_hang(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    start = time.perf_counter()
    with pytest.raises(LlmTraceError) as err:
        load_model(fifo)
    assert "is neither a regular file nor a directory" in one_line(err)
    assert time.perf_counter() - start < 1


def test_a_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 10)
    with pytest.raises(LlmTraceError, match="is a file but not a .gguf one"):
        load_model(tmp_path / "weights.bin")


def test_tinyllama_label_on_another_model(tiny_dir, monkeypatch):
    monkeypatch.setenv("LLMTRACE_TINYLLAMA", str(tiny_dir))
    with pytest.raises(LlmTraceError) as err:
        load_model("tinyllama")
    assert "is not TinyLlama-1.1B: hidden_size=64 (TinyLlama: 2048)" in one_line(err)
    assert "point LLMTRACE_TINYLLAMA at TinyLlama" in str(err.value)


@pytest.mark.parametrize("name, says", [
    (123, "load_model takes a model name or a path (str or pathlib.Path), got int"),
    (b"embedded", "got bytes"),
    ("", "the model name is empty"),
    ("  ", "the model name is empty"),
])
def test_load_model_argument(name, says):
    with pytest.raises(LlmTraceError) as err:
        load_model(name)
    assert says in one_line(err)
