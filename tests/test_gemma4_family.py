"""Gemma 4 (text) as a family of the library: its config read and written back as HF's
Gemma4TextConfig reads it, its refusals by key, the cache it keeps (none for the layers that
read another's K, V) and its preset on the meta device against HF's class. Parity with HF's
model on a tiny checkpoint: tests/test_families.py (its row in tiny_checkpoint.ROWS)."""

import pytest
import torch
from transformers import Gemma4ForCausalLM, Gemma4TextConfig

from llmtrace_book import Config, LlmTraceError, load_model, meta_model
from llmtrace_book.cost import parameter_count
from llmtrace_book.mechanisms.gemma4 import (cache_shape, config_layer_shapes, kv_bytes_per_token,
                             layer_kv_values)
from llmtrace_book.model import trace_shapes
from tiny_checkpoint import hf_config, make_tiny_checkpoint


def tiny_json(**changes) -> dict:
    return {**hf_config("gemma4_text").to_dict(), **changes}


def test_config_is_read_as_hf_reads_it():
    c = Config.from_hf(tiny_json(), name="g4")
    assert (c.family, c.head_dim, c.global_head_dim, c.global_kv_heads) == (
        "gemma4_text", 16, 32, 1)
    assert (c.kv_shared_layers, c.ple_size, c.rope_partial, c.final_softcap) == (
        2, 8, 0.5, 3.0)
    assert c.k_eq_v and c.double_wide_mlp and c.v_norm and c.layer_scalar
    assert not c.norm_offset and c.attn_scale == 1.0
    back = Gemma4TextConfig(**{k: v for k, v in c.to_hf().items() if k != "architectures"})
    assert Config.from_hf(back.to_dict(), name="g4") == c


def test_preset_written_back_loads_in_hf():
    c = Config.from_name("gemma-4-e2b")
    hf = Gemma4TextConfig(**{k: v for k, v in c.to_hf().items() if k != "architectures"})
    assert hf.kv_sharing_modes[13:16] == ["store", "store", "reuse"]
    assert Config.from_hf(hf.to_dict(), name="gemma-4-e2b") == c


@pytest.mark.parametrize("change, match", [
    ({"model_type": "gemma4", "vision_config": {}},
     r"model_type 'gemma4' \(Gemma 4 with its towers: vision_config, audio_config\)"),
    ({"vision_config": {"hidden_size": 8}}, r"vision_config \(the vision tower"),
    ({"audio_config": {"hidden_size": 8}}, r"audio_config \(the audio tower"),
    ({"use_bidirectional_attention": "all"}, r"use_bidirectional_attention='all'"),
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2},
     r"enable_moe_block=true \(experts beside each layer's MLP\) is not implemented"),
    ({"layer_types": ["sliding_attention", "full_attention"] * 2 + ["full_attention",
                                                                   "sliding_attention"]},
     r"layer_types ends with 'sliding_attention'"),
    ({"per_layer_config": {"1": {"head_dim": 32}, "3": {"head_dim": 16},
                           "5": {"head_dim": 32}}}, r"per_layer_config gives the full layers"),
    ({"num_kv_shared_layers": 6}, r"kv_shared_layers.*=6 must be below"),
    ({"hidden_activation": "gelu"}, r"hidden_activation 'gelu' is not implemented"),
])
def test_refused_by_key(change, match):
    with pytest.raises(LlmTraceError, match=match):
        Config.from_hf(tiny_json(**change), name="g4")


def test_final_softcap_is_lifted_for_gemma4_only():
    gemma3 = {**hf_config("gemma3_text").to_dict(), "final_logit_softcapping": 30.0}
    with pytest.raises(LlmTraceError, match=r"final_logit_softcapping=30.0: scores squashed"):
        Config.from_hf(gemma3, name="g3")
    assert Config.from_hf(tiny_json(final_logit_softcapping=30.0)).final_softcap == 30.0


def test_shared_layers_hold_no_cache(tmp_path):
    """Layers 4 and 5 read layers 2 and 3's K, V: they have no cache, no k_proj on disk, and
    their trace says whose K they read."""
    model = load_model(make_tiny_checkpoint(tmp_path / "g4", family="gemma4_text"))
    cache = model.new_cache(12)
    assert [None if k is None else tuple(k.k.shape[2:]) for k in cache] == [
        (2, 16), (1, 32), (2, 16), (1, 32), None, None]
    assert model.weights.layers[4].k_proj is None and model.weights.layers[1].v_proj is None
    _, t = model.run(torch.arange(3, 14)[None], keep_values=False)
    assert t.get("layers.4.attn.kv_cache.k").op == "K cache: shared: layers.2's, read 0:11"
    assert t.get("layers.5.attn.kv_cache.k").op == "K cache: shared: layers.3's, read 0:11"
    assert "layers.4.attn.k_proj" not in t.names and "layers.3.attn.k_proj" in t.names


def hf_meta_count(c: Config) -> int:
    """Parameters of HF's class on meta, plus its stored layer scalars (buffers, on disk)."""
    with torch.device("meta"):
        hf = Gemma4ForCausalLM(Gemma4TextConfig(
            **{k: v for k, v in c.to_hf().items() if k != "architectures"}))
    scalars = sum(b.numel() for n, b in hf.named_buffers() if n.endswith("layer_scalar"))
    return sum(p.numel() for p in hf.parameters()) + scalars


def test_preset_on_meta_matches_hf():
    c = Config.from_name("gemma-4-e2b")
    assert parameter_count(c) == hf_meta_count(c) == 4_628_569_379
    w = meta_model(c).weights  # the meta model's tensors: the same count
    tensors = {id(t): t for t in vars(w).values() if isinstance(t, torch.Tensor)}
    for lw in w.layers:
        tensors.update({id(t): t for t in vars(lw).values() if t is not None})
    assert sum(t.numel() for t in tensors.values()) == parameter_count(c)
    # Google's "2B effective parameters": all but the per-layer table, which is looked up
    table = c.ple_vocab * c.n_layers * c.ple_size
    assert table == 2_348_810_240 and round((parameter_count(c) - table) / 1e9) == 2
    shapes = config_layer_shapes(c)
    assert [s.kv_source for s in shapes][13:] == [13, 14] + [
        14 if i % 5 == 4 else 13 for i in range(15, 35)]
    assert kv_bytes_per_token(shapes) == 18432  # bf16: 12 sliding x 256 + 3 full x 512, K, V
    prefill, decode = trace_shapes(c, 6, decode_steps=1)
    by = {r.name: r.shape for r in decode}
    assert by["layers.14.attn.q"] == (1, 1, 8, 512) and by["layers.13.attn.k"] == (1, 1, 1, 256)
    assert by["layers.34.attn.kv_cache.k"] == (1, 7, 1, 512)
    assert by["layers.15.mlp.gate"] == (1, 1, 12288) and by["ple"] == (1, 1, 35, 256)
    assert by["lm_head.softcap"] == (1, 1, 262144)
    assert sum(n.endswith(".attn.k_proj") for n in by) == 15
    cache = meta_model(c).new_cache(6)
    assert sum(k is not None for k in cache) == 15
    assert [cache_shape(c, i) for i in (0, 4, 15, 34)] == [(1, 256), (1, 512), None, None]
    assert [None if k is None else tuple(k.k.shape[2:]) for k in cache] == [
        cache_shape(c, i) for i in range(c.n_layers)]
    # what each layer must cache: one position, every layer: the bytes a token adds (bf16)
    assert 2 * sum(layer_kv_values(c, i, 1) for i in range(c.n_layers)) == 18432
    # a long context: the sliding layers keep their window, the shared ones nothing
    values = [layer_kv_values(c, i, 4096) for i in range(c.n_layers)]
    assert values[0] == 512 * 2 * 256 and values[4] == 4096 * 2 * 512 and values[15:] == [0] * 20
