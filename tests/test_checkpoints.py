"""Hugging Face checkpoints (one file and sharded) on a tiny random checkpoint, the GGUF reader on
the embedded model, and the weights each part of a layer names, which both follow."""

import json

import pytest
import torch

from llmtrace_book import Config, LlmTraceError, load_model
from llmtrace_book.model import meta_model, state_dict_from_weights
from llmtrace_book.parts import layer_params
from llmtrace_book.weights.names import expected_shapes
from llmtrace_book.weights.gguf import embedded_gguf_path, load_gguf
from llmtrace_book.weights.hf import save_hf
from helpers import PROMPT


@pytest.fixture(scope="module")
def state_dict(tiny):
    return state_dict_from_weights(tiny.config, tiny.weights)


@pytest.mark.parametrize("name", ["tinyllama-1.1b", "deepseek-v3", "gemma-4-e2b",
                                  "qwen3-next-80b-a3b", "gpt-oss-20b"])
def test_parts_name_every_weight(name):
    """A layer's weights are what its parts name (`Part.tensors`), each loaded under its field;
    a part that keeps its weights in an object of its own (latent attention's `MlaWeights`, a
    mixture of experts' `MoeWeights`) fills every field of it it names."""
    model = meta_model(name)
    for block, lw in zip(model.blocks, model.weights.layers):
        fields = layer_params(block)
        nested = {f.split(".")[0] for f in fields if "." in f and not f.startswith("linear_attn")}
        assert set(vars(lw)) == {f for f in fields if "." not in f} | nested | (
            {"linear"} if any(f.startswith("linear_attn") for f in fields) else set())
        if "mla" in nested:
            assert {f.split(".")[1] for f in fields if f.startswith("mla.")} == {
                f for f, t in vars(lw.mla).items() if t is not None}
        if "moe" in nested:
            named = {f.split(".")[1] for f in fields if f.startswith("moe.")}
            assert named == {f for f, t in vars(lw.moe).items() if t is not None}


def test_tinyllama_weights_by_name():
    shapes = expected_shapes(Config.from_name("tinyllama-1.1b"))
    assert shapes["model.layers.21.self_attn.k_proj.weight"] == (256, 2048)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (2048, 5632)
    assert shapes["lm_head.weight"] == (32000, 2048) and len(shapes) == 3 + 22 * 9


def test_gguf_reads_config_and_tokenizer():
    config, sd, tok = load_gguf(embedded_gguf_path())
    assert config == Config.from_name("smollm2-135m")
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert sd["model.embed_tokens.weight"].dtype == torch.float32
    assert set(sd) == set(expected_shapes(config))  # tied: no lm_head.weight
    assert tok.encode(PROMPT) == [504, 3575, 282, 4649, 314]


@pytest.mark.parametrize("shard", [None, 40_000])
def test_hf_checkpoint_round_trip(tmp_path, tiny, state_dict, shard):
    d = save_hf(tmp_path / "ckpt", tiny.config, state_dict, max_shard_bytes=shard)
    if shard:
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    model = load_model(str(d))
    ids = tiny.encode(PROMPT)
    assert torch.equal(model.run(ids, keep_values=False)[0], tiny.run(ids, keep_values=False)[0])


def test_tiny_checkpoint_reads_its_tokenizer(tiny):
    assert tiny.config.n_layers == 2 and tiny.config.n_kv_heads == 2 and tiny.config.head_dim == 16
    assert tiny.encode(PROMPT)[0].tolist() == [1, 450, 7483, 310, 3444, 338]


def test_checkpoint_that_disagrees_with_its_config(tmp_path, tiny, state_dict):
    bad = dict(state_dict)
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(100, 64)
    d = save_hf(tmp_path / "bad", tiny.config, bad)
    with pytest.raises(LlmTraceError, match=r"model.layers.1.mlp.up_proj.weight has shape "
                                            r"\[100, 64\] but the config implies \[176, 64\]"):
        load_model(str(d))


def test_config_that_disagrees_with_its_checkpoint(tmp_path, tiny, state_dict):
    d = save_hf(tmp_path / "bad", tiny.config, state_dict)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 4
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LlmTraceError,
                       match=r"k_proj.weight has shape \[32, 64\] but the config implies \[64, 64\]"):
        load_model(str(d))


def test_missing_tensor_and_missing_files(tmp_path, tiny, state_dict):
    partial = {k: v for k, v in state_dict.items() if "layers.1." not in k}
    d = save_hf(tmp_path / "partial", tiny.config, partial)
    with pytest.raises(LlmTraceError, match="model.layers.1.input_layernorm.weight is missing"):
        load_model(str(d))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LlmTraceError, match="no config.json"):
        load_model(str(tmp_path / "empty"))


def test_hf_config_round_trip():
    for c in (Config.from_name("tinyllama"), Config.from_name("smollm2-135m")):
        assert Config.from_hf(c.to_hf(), name=c.name) == c


def test_presets_by_name():
    c = Config.from_name("embedded")
    shape = (c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim)
    assert c.name == "smollm2-135m-instruct" and shape == (30, 576, 9, 3, 64)
    assert c.tied_lm_head and c.rope_theta == 100000.0
    assert Config.from_name("70b").n_kv_heads == 8


def test_unknown_names():
    with pytest.raises(LlmTraceError, match="unknown model 'gpt-5'"):
        load_model("gpt-5")
    with pytest.raises(LlmTraceError, match="unknown config 'nope'"):
        Config.from_name("nope")
    with pytest.raises(LlmTraceError, match="n_heads=32 is not a multiple of n_kv_heads=5"):
        Config.from_name("tinyllama").replace(n_kv_heads=5)
