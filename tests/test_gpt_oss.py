"""gpt-oss beyond the parity of tests/test_families.py (tiny_checkpoint.ROWS's gpt_oss row: logits
within 1e-4 of HF's GptOssForCausalLM at prefill and decode past the window of 4, and each switch
off, sinks, clamp, YaRN, biases, window, moving them far more): the router's bias matters too,
tokens go to different experts, the sinks leave each row of weights summing below 1, both kinds
of layer turn by the same YaRN RoPE, a checkpoint written back is one HF loads to the same
logits, the preset's parameters are HF's and the published ones, and what is not computed is
refused by its key."""

import dataclasses
import math

import pytest
import torch
import transformers

from llmtrace_book import Config, LlmTraceError, load_model, trace_shapes
from llmtrace_book.cost import parameter_count
from llmtrace_book.model import Model, state_dict_from_weights
from llmtrace_book.weights.hf import save_hf
from test_presets import hf_meta_count
from tiny_checkpoint import hf_config, make_tiny_checkpoint

TOL = 1e-4
IDS = torch.randint(3, 32000, (1, 11), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def tiny_oss(tmp_path_factory):
    d = make_tiny_checkpoint(tmp_path_factory.mktemp("oss") / "tiny-gpt_oss", family="gpt_oss")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(IDS).logits[0]  # [T, V]
    return load_model(d), hf, ref


def test_the_routers_bias_matters(tiny_oss):
    model, _, ref = tiny_oss
    ours, _ = model.run(IDS, keep_values=False)
    assert (ours[0] - ref).abs().max().item() < TOL
    layers = [lw.replace(moe=dataclasses.replace(lw.moe, router_bias=None))
              for lw in model.weights.layers]
    w = dataclasses.replace(model.weights, layers=layers)
    off, trace = Model(model.config, w).run(IDS, keep_values=False)
    assert (off[0] - ref).abs().max().item() > 100 * TOL
    assert trace.get("layers.0.mlp.router").op == "x @ W_router^T"  # no "+ b_router"


def test_tokens_go_to_different_experts_with_weights_summing_to_1(tiny_oss):
    model, _, _ = tiny_oss
    _, trace = model.run(IDS)
    for i in range(model.config.n_layers):
        chosen = trace.get(f"layers.{i}.mlp.experts_chosen").tensor  # [1, T, k]
        assert chosen.shape == (1, 11, 2) and len(set(chosen.flatten().tolist())) >= 2
        sums = trace.get(f"layers.{i}.mlp.expert_weights").tensor.sum(-1)  # [1, T]
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6)  # a softmax over k
        assert trace.get(f"layers.{i}.mlp.router").op == "x @ W_router^T + b_router"


def test_sinks_take_attention_away_and_both_kinds_turn_alike(tiny_oss):
    """Every row of weights sums below 1 by the sink's share; the sliding layer sees 4 keys,
    the full one all; both turn by the same YaRN tables (gpt-oss has one rotary embedding)."""
    model, hf, _ = tiny_oss
    _, trace = model.run(IDS)
    for i, seen in ((0, 4), (1, 11)):
        w = trace.get(f"layers.{i}.attn.weights").tensor  # [1, H, T, S]
        both = trace.get(f"layers.{i}.attn.weights_with_sink").tensor  # [1, H, T, S+1]
        assert torch.allclose(w.sum(-1) + both[..., -1], torch.ones(w.shape[:-1]), atol=1e-6)
        assert float(w.sum(-1).max()) < 1
        assert int((w[0, 0, -1] > 0).sum()) == seen
    q0, q1 = (trace.get(f"layers.{i}.attn.rope_q").op for i in (0, 1))
    assert q0 == q1 == "rotate pairs (d, d+head_dim/2) by position * yarn-scaled freq"
    rotary = hf.model.rotary_emb
    assert rotary.attention_scaling == pytest.approx(0.1 * math.log(8) + 1)
    assert model.config.rope_type == "yarn"


def test_written_back_hf_loads_the_same_model(tiny_oss, tmp_path):
    """to_hf's config.json and the weights in HF's names (the experts fused, gate and up
    interleaved, as save_pretrained writes them), read by HF's class: the same logits."""
    model, _, ref = tiny_oss
    d = save_hf(tmp_path / "back", model.config,
                state_dict_from_weights(model.config, model.weights))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32).eval()
    assert type(hf).__name__ == "GptOssForCausalLM"
    with torch.inference_mode():
        back = hf(IDS).logits[0]  # [T, V]
    assert (back - ref).abs().max().item() < TOL


# OpenAI's gpt-oss model card: 20.9B parameters in all, 3.6B active per token, which it counts
# without the embedding table (a position reads one of its rows; the unembedding is counted)
PUBLISHED_TOTAL, PUBLISHED_ACTIVE = 20.9, 3.6


def test_preset_counts_are_hfs_and_the_published_ones(capsys):
    c = Config.from_name("gpt-oss-20b")
    total, active = parameter_count(c), parameter_count(c, active=True)
    print(f"gpt-oss-20b: {total:,} parameters, {active:,} active per token")
    assert total == hf_meta_count(c) == 20_914_757_184
    assert round(total / 1e9, 1) == PUBLISHED_TOTAL
    table = c.vocab_size * c.hidden_size
    assert round((active - table) / 1e9, 1) == PUBLISHED_ACTIVE
    experts = 24 * 32 * (3 * 2880 * 2880 + 2 * 2880 + 2880)  # gate, up, down and their biases
    assert total - active == experts // 32 * (32 - 4)  # only the unchosen experts differ
    assert "active per token" in capsys.readouterr().out


def test_preset_traces_on_meta():
    c = Config.from_name("gpt-oss-20b")
    prefill, decode = trace_shapes(c, 6, 1)
    for trace, T, S in ((prefill, 6, 6), (decode, 1, 7)):  # S: the keys the cache holds
        for i in (0, 1):
            get = lambda op: trace.get(f"layers.{i}.attn.{op}")  # noqa: E731
            assert get("scores_with_sink").shape == (1, 64, T, S + 1)  # and the sink
            assert get("weights").shape == (1, 64, T, S)
        assert trace.get("layers.0.mlp.expert_out").macs == T * 4 * 3 * 2880 * 2880
    names = {r.name for r in prefill}
    assert "layers.0.attn.window_mask" in names and "layers.1.attn.window_mask" not in names


def oss_json(**changes) -> dict:
    return {**hf_config("gpt_oss").to_dict(), **changes}


@pytest.mark.parametrize("change, says", [
    ({"quantization_config": {"quant_method": "mxfp4"}},
     "quantization_config quant_method='mxfp4' (weights stored quantized"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "dequantize the checkpoint first"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 8.0, "finetuned": True,
                          "original_max_position_embeddings": 32}},
     "rope_scaling finetuned=True is not computed for YaRN"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": "8",
                          "original_max_position_embeddings": 32}},
     "rope_scaling factor='8' must be a positive number"),
    ({"rope_parameters": {"rope_type": "longrope", "factor": 8.0}},
     "rope_scaling of type 'longrope'"),
    ({"experts_per_token": 3}, "experts_per_token=3 and num_experts_per_tok=2 disagree"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok=5 must lie in 1 .. num_local_experts=4"),
    ({"swiglu_limit": 0}, "swiglu_limit=0.0 must be a positive number"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types must list"),
])
def test_what_is_not_computed_is_refused_by_its_key(change, says):
    with pytest.raises(LlmTraceError) as err:
        Config.from_hf(oss_json(**change))
    assert says in str(err.value)


def test_yarn_is_computed_for_gpt_oss_only():
    llama = {**hf_config("llama").to_dict(),
             "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4,
                                 "original_max_position_embeddings": 32}}
    with pytest.raises(LlmTraceError, match="'yarn' .* implemented for DeepSeek-V3, DeepSeek-V2 and gpt-oss only"):
        Config.from_hf(llama)


def test_a_config_json_without_rope_or_layer_types_reads_as_hfs_class():
    """GptOssConfig's defaults: even layers sliding, YaRN 32x over 4096 positions."""
    settings = oss_json(num_hidden_layers=4)
    for key in ("rope_parameters", "layer_types"):
        settings.pop(key)
    c = Config.from_hf({**settings, "rope_theta": 10000.0})
    hf = transformers.GptOssConfig(**{k: v for k, v in settings.items()
                                      if k not in ("model_type", "transformers_version")},
                                   rope_theta=10000.0)
    assert c.layer_types == ("sliding", "full") * 2
    assert [t.split("_")[0] for t in hf.layer_types] == list(c.layer_types)
    assert dict(c.rope_scaling) == {k: v for k, v in hf.rope_parameters.items()
                                    if k != "rope_theta"}
    assert Config.from_hf(c.to_hf(), name=c.name) == c


def test_switches_gpt_oss_does_not_compute_are_refused():
    oss = Config.from_name("gpt-oss-20b")
    with pytest.raises(LlmTraceError, match="attn_sinks=False, but HF's GptOssForCausalLM"):
        oss.replace(attn_sinks=False).to_hf()
    with pytest.raises(LlmTraceError, match="one attention_bias for Q, K, V and O"):
        oss.replace(o_bias=False).to_hf()
    with pytest.raises(LlmTraceError, match="attn_sinks=True set with family 'llama'"):
        Config.from_name("tinyllama").replace(attn_sinks=True).to_hf()
    with pytest.raises(LlmTraceError, match="mlp_act='gpt_oss' is the clamped GLU"):
        Config.from_name("tinyllama").replace(mlp_act="gpt_oss")


# openai/gpt-oss-20b's config.json on the hub, as published (its quantization_config left out:
# the hub's experts are MXFP4, refused above); each key checked against the preset
PUBLISHED_JSON = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
    "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
    "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "use_cache": True,
    "vocab_size": 201088}


def test_the_published_config_json_reads_as_the_preset():
    assert Config.from_hf(PUBLISHED_JSON, name="gpt-oss-20b") == Config.from_name("gpt-oss-20b")
    with pytest.raises(LlmTraceError, match="quant_method='mxfp4'"):
        Config.from_hf({**PUBLISHED_JSON, "quantization_config": {"quant_method": "mxfp4"}})
