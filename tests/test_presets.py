"""Today's presets, shapes only: each one's parameter count, as llmtrace counts it (cost.py, and the
meta model's tensors), equals the count of HF's own model class built on the meta device from the
config.json llmtrace writes, and the model's published total. Each traces on the meta device."""

import time

import pytest
import torch
import transformers

from llmtrace_book import Config, meta_model, trace_shapes
from llmtrace_book.cost import parameter_count
from llmtrace_book.rope import rope_frequencies

# the totals the model cards and the HF hub's safetensors metadata give (a float: in billions,
# as rounded where only that is published: Mixtral's 46.7B from Mistral's announcement, Qwen's
# 30.5B from Qwen3-30B-A3B's model card)
PUBLISHED = {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248,
             "qwen3-0.6b": 596_049_920, "mistral-7b-v0.1": 7_241_732_096, "olmo-2-1b": 1.48,
             "mixtral-8x7b": 46.7, "qwen3-30b-a3b": 30.5,
             "olmo-3-7b": 7.3, "smollm3-3b": 3.08,
             "olmoe-1b-7b": 6.9,  # SmolLM3-3B's card: 3.08B; OLMoE's: 6.9B; OLMo 3's
             "llama-4-scout-17b-16e": 109.0}  # only says "7B" (7B and 32B scales): 7.30B is
# its HF class's count, to two digits; a whole number of billions (109.0: Llama 4 Scout's card)
# is rounded so. Scout's 109B counts its vision encoder and projector too (`TOWERS`)
FAMILY = {"llama-3.2-1b": "llama", "llama-3.1-8b": "llama", "qwen3-0.6b": "qwen3",
          "mistral-7b-v0.1": "mistral", "olmo-2-1b": "olmo2", "mixtral-8x7b": "mixtral",
          "qwen3-30b-a3b": "qwen3_moe", "olmo-3-7b": "olmo3", "smollm3-3b": "smollm3",
          "olmoe-1b-7b": "olmoe", "llama-4-scout-17b-16e": "llama4_text"}
# active parameters per token, as published (OLMoE's card: 1.3B of 6.9B; Llama 4 Scout's: 17B
# of 109B, its text model's)
ACTIVE = {"olmoe-1b-7b": 1.3, "llama-4-scout-17b-16e": 17.0}
# what a published total counts beside the text model: Llama 4 Scout's vision encoder and its
# projector, in HF's Llama4ForConditionalGeneration (`test_the_towers_are_hfs`)
TOWERS = {"llama-4-scout-17b-16e": 871_932_416}
# meta-llama/Llama-4-Scout-17B-16E config.json's vision_config
SCOUT_VISION = dict(hidden_size=1408, image_size=336, intermediate_size=5632, num_channels=3,
                    num_attention_heads=16, num_hidden_layers=34, patch_size=14, norm_eps=1e-5,
                    pixel_shuffle_ratio=0.5, projector_input_dim=4096, hidden_act="gelu",
                    projector_output_dim=4096, vision_output_dim=4096, rope_theta=10000,
                    multi_modal_projector_bias=False)


def billions(count: int, published: float) -> float:
    """count in billions, to as many digits as `published` gives (a whole number: none)."""
    digits = 0 if published.is_integer() else len(str(published).split(".")[1])
    return round(count / 1e9, digits)


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
        if lw.moe is not None:  # the experts, stacked, and a shared expert's MLP
            shared = vars(lw.moe.shared).values() if lw.moe.shared is not None else ()
            tensors.update({id(t): t for t in [*vars(lw.moe).values(), *shared]
                            if isinstance(t, torch.Tensor)})
    assert parameter_count(c) == sum(t.numel() for t in tensors.values())
    assert parameter_count(c) == hf_meta_count(c)
    published, count = PUBLISHED[name], parameter_count(c) + TOWERS.get(name, 0)
    assert (billions(count, published) if isinstance(published, float) else count) == published


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
    assert billions(hf_active, ACTIVE[name]) == ACTIVE[name]


@pytest.mark.parametrize("name", TOWERS)
def test_the_towers_are_hfs(name):
    """What the published total counts beside the text model: HF's multimodal class of the
    same text model on the meta device, less its text model."""
    settings = Config.from_name(name).to_hf()
    text = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    with torch.device("meta"):
        model = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(
            text_config=text.to_dict(), vision_config=SCOUT_VISION))
    towers = sum(p.numel() for n, p in model.named_parameters()
                 if not n.startswith("language_model."))
    assert towers == TOWERS[name]


def test_llama4_scouts_rope_is_hfs():
    """Scout's llama3 rope_scaling gives low_freq_factor = high_freq_factor (1): no pair is
    blended, each is kept or slowed 16 times, as HF's class computes it (with a warning)."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding

    c = Config.from_name("llama-4-scout-17b-16e")
    settings = c.to_hf()
    hf = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    ours = rope_frequencies(c.head_dim, c.rope_theta, scaling=c.rope_scaling)  # [hd/2]
    theirs = Llama4TextRotaryEmbedding(hf).inv_freq
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)
    ratio = rope_frequencies(c.head_dim, c.rope_theta) / ours
    assert set(ratio.round().tolist()) == {1.0, 16.0}


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
