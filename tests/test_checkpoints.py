"""Hugging Face checkpoints (one file and sharded) and the GGUF reader, on the embedded weights."""

import json

import pytest
import torch

from llmtrace import Config, LlmTraceError, load_model
from llmtrace.model import state_dict_from_weights
from llmtrace.weights.gguf import embedded_gguf_path, load_gguf
from llmtrace.weights.hf import save_hf


@pytest.fixture(scope="module")
def state_dict(embedded):
    return state_dict_from_weights(embedded.config, embedded.weights)


def test_gguf_reads_config_and_tokenizer():
    config, sd, tok = load_gguf(embedded_gguf_path())
    assert config == Config.from_name("smollm2-135m")
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert sd["model.embed_tokens.weight"].dtype == torch.float32
    assert "lm_head.weight" not in sd  # tied
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]


@pytest.mark.parametrize("shard", [None, 60_000_000])
def test_hf_checkpoint_round_trip(tmp_path, embedded, state_dict, shard):
    d = save_hf(tmp_path / "ckpt", embedded.config, state_dict, embedded.tokenizer, max_shard_bytes=shard)
    if shard:
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    model = load_model(str(d))
    ids = embedded.encode("The capital of France is")
    ours, _ = model.run(ids, keep_values=False)
    ref, _ = embedded.run(ids, keep_values=False)
    assert torch.equal(ours, ref)
    assert model.tokenizer.encode("The capital of France is") == ids[0].tolist()


def test_checkpoint_that_disagrees_with_its_config(tmp_path, embedded, state_dict):
    bad = dict(state_dict)
    bad["model.layers.7.mlp.up_proj.weight"] = torch.zeros(1000, 576)
    d = save_hf(tmp_path / "bad", embedded.config, bad, embedded.tokenizer)
    with pytest.raises(LlmTraceError, match=r"model.layers.7.mlp.up_proj.weight has shape \[1000, 576\] "
                                            r"but the config implies \[1536, 576\]"):
        load_model(str(d))


def test_config_that_disagrees_with_its_checkpoint(tmp_path, embedded, state_dict):
    d = save_hf(tmp_path / "bad", embedded.config, state_dict, embedded.tokenizer)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_key_value_heads"] = 9
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LlmTraceError, match=r"k_proj.weight has shape \[192, 576\] but the config implies \[576, 576\]"):
        load_model(str(d))


def test_missing_tensor_and_missing_files(tmp_path, embedded, state_dict):
    partial = {k: v for k, v in state_dict.items() if "layers.29." not in k}
    d = save_hf(tmp_path / "partial", embedded.config, partial, embedded.tokenizer)
    with pytest.raises(LlmTraceError, match="tensor model.layers.29.input_layernorm.weight is missing"):
        load_model(str(d))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LlmTraceError, match="no config.json"):
        load_model(str(tmp_path / "empty"))


def test_hf_config_round_trip():
    for c in (Config.from_name("tinyllama"), Config.from_name("smollm2-135m")):
        assert Config.from_hf(c.to_hf(), name=c.name) == c


def test_unknown_names():
    with pytest.raises(LlmTraceError, match="unknown model 'gpt-5'"):
        load_model("gpt-5")
    with pytest.raises(LlmTraceError, match="unknown config 'nope'"):
        Config.from_name("nope")
    with pytest.raises(LlmTraceError, match="n_heads=32 is not a multiple of n_kv_heads=5"):
        Config.from_name("tinyllama").replace(n_kv_heads=5)
