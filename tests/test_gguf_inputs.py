"""A GGUF file, every tensor accounted for: the tiny Llama checkpoint written as a llama.cpp
converter writes it (W_q, W_k in the adjacent-pair RoPE layout, Llama-2's SentencePiece
vocabulary), built at test time with the gguf package; then broken, one way at a time."""

import hashlib

import numpy as np
import pytest

from helpers import PROMPT, one_line
from llmtrace_book import LlmTraceError, load_model
from llmtrace_book.model import state_dict_from_weights
from llmtrace_book.weights.gguf import GGUF_LAYER_NAMES, GGUF_NAMES
from llmtrace_book.rope import half_split_to_adjacent
from llmtrace_book.weights import tokenizer_llama


def gguf_tensors(model) -> dict[str, np.ndarray]:
    """The model's weights under their GGUF names, Q and K permuted as llama.cpp's converter
    permutes them."""
    c, sd = model.config, state_dict_from_weights(model.config, model.weights)
    out = {gguf: sd.get(hf, model.weights.lm_head) for gguf, hf in GGUF_NAMES.items()}
    for i in range(c.n_layers):
        for gguf, hf in GGUF_LAYER_NAMES.items():
            t = sd[f"model.layers.{i}.{hf}"]
            if gguf in ("attn_q.weight", "attn_k.weight"):
                t = half_split_to_adjacent(t, c.n_heads if gguf == "attn_q.weight"
                                           else c.n_kv_heads)
            out[f"blk.{i}.{gguf}"] = t
    return {k: v.detach().numpy().astype(np.float32) for k, v in out.items()}


def llama2_vocab() -> dict:
    """Llama-2's tokens, scores and types, from llama.cpp's test vocabulary (in the cache)."""
    from gguf import GGUFReader

    fields = GGUFReader(tokenizer_llama.vocab_dir() / tokenizer_llama.VOCAB).fields
    return {k: fields[f"tokenizer.ggml.{k}"].contents() for k in ("tokens", "scores",
                                                                   "token_type")}


@pytest.fixture(scope="module")
def vocab():
    return llama2_vocab()


@pytest.fixture(scope="module")
def small(vocab):
    """Its first 259 pieces (the specials and the bytes), for a file refused before its
    vocabulary is used: a file of 32,000 token strings takes seconds to parse."""
    return {k: v[:259] for k, v in vocab.items()}


def write_gguf(path, model, vocab, arch="llama", extra=None, drop=(), tokenizer="llama",
               changes=None, omit=()):
    """The tiny model as a GGUF file: its metadata with `changes`, less the keys in `drop`;
    its tensors but those in `omit`, and `extra` ones."""
    from gguf import GGUFWriter

    c = model.config
    w = GGUFWriter(str(path), arch)
    numbers = {"block_count": c.n_layers, "context_length": c.max_positions,
               "embedding_length": c.hidden_size, "feed_forward_length": c.ffn_size,
               "attention.head_count": c.n_heads, "attention.head_count_kv": c.n_kv_heads,
               **(changes or {})}
    if len(vocab["tokens"]) != c.vocab_size:  # else the size is the vocabulary's, as here
        numbers["vocab_size"] = c.vocab_size
    for key, value in numbers.items():
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.rope.freq_base", c.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", c.norm_eps)
    w.add_string("tokenizer.ggml.model", tokenizer)
    w.add_array("tokenizer.ggml.tokens", vocab["tokens"])
    w.add_array("tokenizer.ggml.scores", vocab["scores"])
    w.add_array("tokenizer.ggml.token_type", vocab["token_type"])
    for key, value in (("bos_token_id", c.bos_id), ("eos_token_id", c.eos_id),
                       ("unknown_token_id", 0)):
        if key not in drop:
            w.add_uint32(f"tokenizer.ggml.{key}", value)
    for name, t in {**gguf_tensors(model), **(extra or {})}.items():
        if name not in omit:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_sentencepiece_gguf_loads_as_its_checkpoint(tiny, vocab, tmp_path):
    """Every Llama 2 and TinyLlama GGUF has this vocabulary: the SentencePiece model built from
    it is Meta's tokenizer.model byte for byte, and the logits are the checkpoint's."""
    from llmtrace_book.weights.tokenizer_llama import LLAMA2_SHA256, gguf_sentencepiece

    meta = {f"tokenizer.ggml.{k}": v for k, v in vocab.items()}
    assert hashlib.sha256(gguf_sentencepiece(meta, 1, 2)).hexdigest() == LLAMA2_SHA256
    model = load_model(write_gguf(tmp_path / "tiny.gguf", tiny, vocab))
    assert model.tokenizer.kind == "sentencepiece" and model.tokenizer.add_bos
    assert model.encode(PROMPT).tolist() == tiny.encode(PROMPT).tolist()
    assert model.config.replace(name=tiny.config.name) == tiny.config
    ids = tiny.encode(PROMPT)
    ours, ref = model.run(ids, keep_values=False)[0], tiny.run(ids, keep_values=False)[0]
    assert (ours - ref).abs().max().item() < 1e-5


def test_a_gguf_without_special_ids_invents_none(tiny, vocab, tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny, vocab, drop=("bos_token_id", "eos_token_id"))
    model = load_model(path)
    assert (model.config.bos_id, model.config.end_ids) == (None, ())
    assert not model.tokenizer.add_bos and model.tokenizer.bos_id is None


def test_a_tensor_the_model_does_not_compute_is_refused(tiny, small, tmp_path):
    """A llama-architecture file has no bias on Q: dropping it would compute another model."""
    bias = {"blk.0.attn_q.bias": np.ones(tiny.config.hidden_size, dtype=np.float32)}
    path = write_gguf(tmp_path / "biased.gguf", tiny, small, extra=bias)
    with pytest.raises(LlmTraceError) as err:
        load_model(path)
    said = one_line(err)
    assert f"{path}: tensor blk.0.attn_q.bias is not a weight of the Llama model" in said
    assert "load the Hugging Face directory of the same model" in said


def test_rope_freqs_says_llama3_ggufs_are_not_supported(tiny, small, tmp_path):
    freqs = {"rope_freqs.weight": np.ones(tiny.config.head_dim // 2, dtype=np.float32)}
    path = write_gguf(tmp_path / "llama3.gguf", tiny, small, extra=freqs)
    with pytest.raises(LlmTraceError) as err:
        load_model(path)
    said = one_line(err)
    assert "rope_freqs.weight" in said and "Llama 3 GGUF files are not supported" in said
    assert "Hugging Face directory" in said and "not a Llama weight" not in said


def test_another_architecture_names_the_file_and_what_to_do(tiny, small, tmp_path):
    path = write_gguf(tmp_path / "qwen.gguf", tiny, small, arch="qwen2")
    with pytest.raises(LlmTraceError) as err:
        load_model(path)
    assert one_line(err) == (f"{path}: GGUF architecture 'qwen2' is not read, only 'llama': "
                             f"load the Hugging Face directory of the same model (config.json "
                             f"and safetensors) instead")


def test_another_vocabulary_kind_is_refused_with_advice(tiny, small, tmp_path):
    path = write_gguf(tmp_path / "bert.gguf", tiny, small, tokenizer="bert")
    with pytest.raises(LlmTraceError) as err:
        load_model(path)
    said = one_line(err)
    assert "tokenizer.ggml.model 'bert' is not read (only 'gpt2'" in said
    assert "load the Hugging Face directory" in said


def test_gguf_keys_are_named_in_errors(tiny, small, tmp_path):
    path = write_gguf(tmp_path / "kv.gguf", tiny, small, changes={"attention.head_count_kv": 3})
    with pytest.raises(LlmTraceError) as err:
        load_model(path)
    assert ("llama.attention.head_count=4 is not a multiple of "
            "llama.attention.head_count_kv=3") in one_line(err)


def test_a_missing_or_misshapen_tensor_is_named_by_its_gguf_name(tiny, small, vocab, tmp_path):
    path = write_gguf(tmp_path / "short.gguf", tiny, small, omit=("blk.1.attn_v.weight",))
    with pytest.raises(LlmTraceError) as err:
        load_model(path)
    assert "tensor blk.1.attn_v.weight is missing" in one_line(err)
    path = write_gguf(tmp_path / "short.gguf", tiny, vocab,
                      changes={"feed_forward_length": tiny.config.ffn_size * 2})
    with pytest.raises(LlmTraceError) as err:
        load_model(path)
    assert "tensor blk.0.ffn_gate.weight has shape [176, 64] but the file's metadata implies " \
           "[352, 64]" in one_line(err)
