"""DeepSeek-V3 and V2 (V2-Lite's form) as families of the library, beside tests/test_families.py's
parity rows: experts routed apart, the switches that are weights (the router's bias, the shared
experts) each mattering, the latent cache a decode step reads, the deepseek-v3 preset against
HF's class on the meta device, the cache's bytes of every kind of layer, and the refusals by
key."""

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from llmtrace_book import Config, LlmTraceError, load_model, meta_model
from llmtrace_book.cost import cache_bytes, parameter_count
from llmtrace_book.mechanisms.mla import LatentCache, cache_bytes_per_token
from llmtrace_book.model import Model
from tiny_checkpoint import ROWS, make_tiny_checkpoint

TOL = 1e-4
FAMILIES = ("deepseek_v3", "deepseek_v2")


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    f = request.param
    d = make_tiny_checkpoint(tmp_path_factory.mktemp(f) / f"tiny-{f}", family=f)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32).eval()
    ids = torch.randint(3, 32000, (1, 11), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        ref = hf(ids).logits[0]  # [T, V]
    return f, d, load_model(d), ids, ref


def off_by(model, ids, ref, **layer_changes) -> float:
    """How far the logits move from HF's when every MoE layer's weights change so."""
    layers = [lw.replace(moe=dataclasses.replace(lw.moe, **layer_changes))
              if lw.moe is not None else lw for lw in model.weights.layers]
    w = dataclasses.replace(model.weights, layers=layers)
    logits, _ = Model(model.config, w).run(ids, keep_values=False)
    return (logits[0] - ref).abs().max().item()


def test_positions_go_to_different_experts(tiny):
    f, _, model, ids, ref = tiny
    logits, trace = model.run(ids)
    assert (logits[0] - ref).abs().max().item() < TOL
    chosen = trace.get("layers.1.mlp.experts_chosen").tensor  # [1, T, k]
    assert chosen.shape == (1, 11, model.config.n_experts_active)
    assert len(chosen.unique()) >= 2
    assert "layers.0.mlp.down" in trace.names and "layers.1.mlp.down" not in trace.names


def test_the_weights_that_are_switches_matter(tiny):
    """Without the shared experts, or (V3) without the router's bias, the logits move."""
    f, _, model, ids, ref = tiny
    assert off_by(model, ids, ref, shared=None) > 100 * TOL
    if f == "deepseek_v3":
        assert off_by(model, ids, ref, score_bias=None) > 100 * TOL
        c = model.config.replace(moe_router="softmax_topk")  # V2's router on V3's weights
        logits, _ = Model(c, model.weights).run(ids, keep_values=False)
        assert (logits[0] - ref).abs().max().item() > 100 * TOL


def test_the_cache_holds_latents(tiny):
    f, _, model, ids, _ = tiny
    c = model.config
    cache = model.new_cache(16)
    assert all(isinstance(layer, LatentCache) for layer in cache)
    assert sum(layer.nbytes() for layer in cache) == cache_bytes(c, 16, bytes_per_value=4)
    model.forward(ids, cache=cache)
    step = model.run(ids)[1]  # names only
    assert step.shape("layers.0.attn.kv_cache.latent") == (1, 11, c.kv_lora_rank)
    assert step.shape("layers.0.attn.kv_cache.k_rope") == (1, 11, c.head_dim)


def test_the_config_json_written_back_is_hfs(tiny, tmp_path):
    """to_hf's config.json makes HF's class with the checkpoint's own weights: same logits."""
    f, d, model, ids, ref = tiny
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_hf()))
    save_file(load_file(d / "model.safetensors"), tmp_path / "model.safetensors")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float32).eval()
    assert type(hf).__name__ == ROWS[f].model_class
    with torch.inference_mode():
        assert (hf(ids).logits[0] - ref).abs().max().item() == 0


def test_the_mtp_layer_is_skipped_as_hf_skips_it(tiny, tmp_path):
    f, d, model, ids, ref = tiny
    sd = load_file(d / "model.safetensors")
    sd["model.layers.2.eh_proj.weight"] = torch.zeros(4, 4)  # a layer past the last
    save_file(sd, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    logits, _ = load_model(tmp_path).run(ids, keep_values=False)
    assert (logits[0] - ref).abs().max().item() < TOL


def test_deepseek_v3_preset_is_hfs_671b():
    c = Config.from_name("deepseek-v3")
    hf_config = transformers.DeepseekV3Config(
        **{k: v for k, v in c.to_hf().items() if k != "architectures"})
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(hf_config)
    total, active = parameter_count(c), parameter_count(c, active=True)
    assert total == sum(p.numel() for p in hf.parameters()) == 671_026_404_352
    assert round(total / 1e9) == 671 and 37e9 < active < 38e9  # "37B activated"
    lw = meta_model(c).weights.layers
    assert lw[2].moe is None and lw[3].moe.gate.shape == (256, 2048, 7168)
    assert lw[3].moe.shared.gate.shape == (2048, 7168) and lw[0].mla.q_a.shape == (1536, 7168)


def test_cache_bytes_of_every_kind_of_layer():
    v3, llama, mistral = (Config.from_name(n) for n in ("deepseek-v3", "llama-2-70b",
                                                         "mistral-7b"))
    assert cache_bytes(v3, 1) == (512 + 64) * 61 * 2 == cache_bytes_per_token(v3) == 70_272
    assert cache_bytes(llama, 10) == 10 * 2 * 8 * 128 * 80 * 2
    W = mistral.sliding_window
    assert cache_bytes(mistral, 2 * W) == cache_bytes(mistral, W) == W * 2 * 8 * 128 * 32 * 2
    gemma = Config.from_name("gemma-3-270m")
    full = gemma.layer_types.count("full")
    per = 2 * gemma.n_kv_heads * gemma.head_dim * 2
    assert cache_bytes(gemma, 4096) == per * (4096 * full + 512 * (gemma.n_layers - full))


def v3_json(**changes) -> dict:
    return {**transformers.DeepseekV3Config(**ROWS["deepseek_v3"].config).to_dict(), **changes}


@pytest.mark.parametrize("changes, message", [
    (dict(attention_bias=True), "attention_bias=true .projections with a bias"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2 must equal num_attention_heads=4"),
    (dict(head_dim=16), "head_dim=16 differs from qk_rope_head_dim=8"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config .fp8"),
    (dict(topk_method="greedy"), "topk_method='greedy' is not implemented: only 'noaux_tc'"),
    (dict(scoring_func="softmax"), "scoring_func='softmax' is not implemented"),
    (dict(n_group=3), "n_group=3 groups, topk_group=2 chosen: the groups must split"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                           "original_max_position_embeddings": 16, "finetuned": True}),
     "rope_scaling finetuned=True is not computed for YaRN"),
])
def test_v3_settings_not_computed_are_refused_by_key(changes, message):
    with pytest.raises(LlmTraceError, match=message):
        Config.from_hf(v3_json(**changes))


@pytest.mark.parametrize("changes, message", [
    (dict(topk_method="group_limited_greedy"), "topk_method='group_limited_greedy' is not"),
    (dict(norm_topk_prob=True), "norm_topk_prob=true is not what DeepseekV2ForCausalLM"),
    (dict(rope_interleave=False), "rope_interleave=false is not what DeepseekV2ForCausalLM"),
])
def test_v2_settings_not_computed_are_refused_by_key(changes, message):
    c = {**transformers.DeepseekV2Config(**ROWS["deepseek_v2"].config).to_dict(), **changes}
    with pytest.raises(LlmTraceError, match=message):
        Config.from_hf(c)


def test_yarn_of_the_old_kind_is_read():
    """DeepSeek-V3's own config.json says rope_scaling with "type": "yarn"."""
    old = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
           "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 4096}
    c = Config.from_hf(v3_json(rope_parameters=None, rope_scaling=old, rope_theta=10000.0,
                               max_position_embeddings=163840))
    assert c.rope_scaling == Config.from_name("deepseek-v3").rope_scaling
