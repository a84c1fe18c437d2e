"""Today's presets, shapes only: each one's parameter count, as llmtrace counts it (cost.py, and the
meta model's tensors), equals the count of HF's own model class built on the meta device from the
config.json llmtrace writes, and the model's published total. Each traces on the meta device."""

import time

import pytest
import torch
import transformers

from llmtrace import Config, meta_model, trace_shapes
from llmtrace.cost import parameter_count

# the totals the model cards and the HF hub's safetensors metadata give (a float: in billions,
# as rounded where only that is published: Mixtral's 46.7B from Mistral's announcement, Qwen's
# 30.5B from Qwen3-30B-A3B's model card)
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248,
             "qwen3-0.6b": 596_049_920, "mistral-7b-v0.1": 7_241_732_096, "olmo-2-1b": 1.48,
             "mixtral-8x7b": 46.7, "qwen3-30b-a3b": 30.5,
             "olmo-3-7b": 7.3, "smollm3-3b": 3.08,
             "olmoe-1b-7b": 6.9}  # SmolLM3-3B's card: 3.08B; OLMoE's: 6.9B; OLMo 3's
# only says "7B" (7B and 32B scales): 7.30B is its HF class's count, to two digits
FAMILY = {"llama-3.2-1b": "llama", "llama-3.1-8b": "llama", "qwen3-0.6b": "qwen3",
          "mistral-7b-v0.1": "mistral", "olmo-2-1b": "olmo2", "mixtral-8x7b": "mixtral",
          "qwen3-30b-a3b": "qwen3_moe", "olmo-3-7b": "olmo3", "smollm3-3b": "smollm3",
          "olmoe-1b-7b": "olmoe"}
# active parameters per token, as published (OLMoE's card: 1.3B of 6.9B)
ACTIVE = {"olmoe-1b-7b": 1.3}


def hf_meta_count(c: Config) -> int:
    """Parameters of HF's class for the family, on the meta device (no memory); a tied head's
    table is one parameter, counted once."""
    settings = c.to_hf()
    hf_config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    assert type(model).__name__ == settings["architectures"][0]
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_count(name):
    c = Config.from_name(name)
    assert c.family == FAMILY[name]
    weights = meta_model(c).weights
    tensors = {id(t): t for t in [weights.embed, weights.final_norm, weights.lm_head]}
    for lw in weights.layers:
        tensors.update({id(t): t for t in vars(lw).values() if isinstance(t, torch.Tensor)})
        if lw.moe is not None:  # the experts, stacked
            tensors.update({id(t): t for t in vars(lw.moe).values() if t is not None})
    assert parameter_count(c) == sum(t.numel() for t in tensors.values())
    assert parameter_count(c) == hf_meta_count(c)
    published = PUBLISHED[name]
    digits = len(str(published).split(".")[1]) if isinstance(published, float) else 0
    assert (round(parameter_count(c) / 1e9, digits) if isinstance(published, float)
            else parameter_count(c)) == published


@pytest.mark.parametrize("name", ACTIVE)
def test_active_parameter_count(name):
    """What one token reads: the router and k of the E experts, counted on HF's class on the
    meta device (its experts' tensors, at k / E), and as published."""
    c = Config.from_name(name)
    settings = c.to_hf()
    hf_config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    hf_active = hf_meta_count(c) - experts + experts * c.n_experts_active // c.n_experts
    assert parameter_count(c, active=True) == hf_active
    assert round(hf_active / 1e9, 1) == ACTIVE[name]


@pytest.mark.parametrize("name", PUBLISHED)
def test_round_trip_through_hf_config(name):
    c = Config.from_name(name)
    assert Config.from_hf(c.to_hf(), name=name) == c


@pytest.mark.parametrize("name", PUBLISHED)
def test_traces_on_meta(name):
    """Prefill of 6 tokens and one decode step, every layer: well under a second a layer."""
    c = Config.from_name(name)
    started = time.perf_counter()
    prefill, decode = trace_shapes(c, 6, 1)
    seconds = time.perf_counter() - started
    assert seconds < 0.2 * c.n_layers
    assert prefill.get("lm_head").shape == (1, 6, c.vocab_size)
    q = prefill.get("layers.0.attn.q").shape
    assert q == (1, 6, c.n_heads, c.head_dim)
    assert decode.get("layers.0.attn.kv_cache.k").shape == (1, 7, c.n_kv_heads, c.head_dim)
    names = {r.name for r in prefill}
    assert ("layers.0.attn.q_norm" in names) == (c.qk_norm or c.qk_proj_norm)
    if c.qk_proj_norm:  # over the whole projection, before the heads are split
        assert prefill.get("layers.0.attn.q_norm").shape == (1, 6, c.n_heads * c.head_dim)
    assert ("layers.0.attn_norm" in names) == c.pre_norm
    assert ("layers.0.attn.window_mask" in names) == bool(c.sliding_window)
