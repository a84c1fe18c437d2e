"""TinyLlama-1.1B's exact shape walk, with no weights, on PyTorch's meta device."""

import pytest
import torch

from llmtrace_book import Config, meta_model
from llmtrace_book.model import trace_shapes


@pytest.fixture(scope="module")
def walk():
    return trace_shapes("tinyllama-1.1b", prompt=6, decode_steps=1)


def test_prefill_walk_is_the_seeds(walk):
    t = walk[0]
    assert t.shape("tokens") == (1, 6)
    assert t.shape("embed") == (1, 6, 2048)
    for i in range(22):
        p = f"layers.{i}.attn."
        assert t.shape(p + "q_proj") == (1, 6, 2048) and t.shape(p + "q") == (1, 6, 32, 64)
        assert t.shape(p + "k_proj") == (1, 6, 256) and t.shape(p + "k") == (1, 6, 4, 64)
        assert t.shape(p + "v_proj") == (1, 6, 256) and t.shape(p + "v") == (1, 6, 4, 64)
        assert t.shape(p + "k_expanded") == (1, 32, 6, 64) and t.shape(p + "v_expanded") == (1, 32, 6, 64)
        assert t.shape(p + "scores") == (1, 32, 6, 6)
        assert t.shape(p + "out") == (1, 6, 2048)
        assert t.shape(f"layers.{i}.mlp.gate") == (1, 6, 5632) and t.shape(f"layers.{i}.mlp.up") == (1, 6, 5632)
        assert t.shape(f"layers.{i}.mlp.down") == (1, 6, 2048)
    assert not t.find("layers.22.*")
    assert t.shape("lm_head") == (1, 6, 32000)
    assert all(r.tensor is None for r in t)


def test_first_decode_step_reads_seven_positions(walk):
    d = walk[1]
    assert d.shape("tokens") == (1, 1)
    for i in range(22):
        p = f"layers.{i}.attn."
        assert d.shape(p + "q") == (1, 1, 32, 64)
        assert d.shape(p + "kv_cache.k") == (1, 7, 4, 64) and d.shape(p + "kv_cache.v") == (1, 7, 4, 64)
        assert d.shape(p + "scores") == (1, 32, 1, 7)
    assert d.shape("lm_head") == (1, 1, 32000)


def test_meta_and_real_walks_agree(embedded, prompt_trace):
    """The same forward pass on meta and on real weights records the same names and shapes."""
    _, real = prompt_trace
    (meta,) = trace_shapes(embedded.config, prompt=5, decode_steps=0)
    assert [(r.name, r.shape, r.macs) for r in meta] == [(r.name, r.shape, r.macs) for r in real]


@pytest.mark.parametrize("name, layers, scores", [("llama-2-7b", 32, (1, 32, 6, 6)),
                                                  ("llama-2-70b", 80, (1, 64, 6, 6))])
def test_bigger_configs(name, layers, scores):
    prefill, decode = trace_shapes(name, 6, 1)
    c = Config.from_name(name)
    assert prefill.shape(f"layers.{layers - 1}.attn.scores") == scores
    assert decode.shape("layers.0.attn.kv_cache.k") == (1, 7, c.n_kv_heads, c.head_dim)
    assert prefill.shape("layers.0.mlp.gate") == (1, 6, c.ffn_size)


def test_meta_model_holds_no_memory():
    m = meta_model("llama-2-70b")
    assert m.is_meta and m.weights.embed.device.type == "meta"
    logits = m.forward(torch.zeros(1, 3, dtype=torch.long))
    assert logits.shape == (1, 3, 32000) and logits.device.type == "meta"


def test_kv_cache_memory_at_full_context():
    """TinyLlama's cache at 2,048 positions: 22 layers x K and V x 2048 x 4 KV heads x 64, in fp16."""
    import torch

    from llmtrace_book.kv_cache import KVCache

    c = Config.from_name("tinyllama-1.1b")
    one = KVCache(c.max_positions, c.n_kv_heads, c.head_dim, device="meta", dtype=torch.float16)
    assert c.n_layers * one.nbytes() == 2 * 22 * 2 * 2048 * 256 == 46_137_344
    cache = meta_model(c).new_cache(c.max_positions)  # one KVCache per layer
    assert len(cache) == 22 and cache[0].k.shape == (1, 2048, 4, 64)
