"""The trace of the prompt: every operation of every layer, with the right shape."""

import pytest
import torch

from llmtrace_book import LlmTraceError, Trace
from helpers import PROMPT

LAYER_OPS = [
    "attn_norm.mean_sq", "attn_norm", "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.q", "attn.k", "attn.v",
    "attn.rope_q", "attn.rope_k", "attn.kv_cache.k", "attn.kv_cache.v", "attn.k_expanded", "attn.v_expanded",
    "attn.scores", "attn.causal_mask", "attn.masked_scores", "attn.weights", "attn.weighted_sum", "attn.merged",
    "attn.out", "resid_mid", "mlp_norm.mean_sq", "mlp_norm", "mlp.gate", "mlp.up", "mlp.act", "mlp.gated",
    "mlp.down", "resid_out",
]


def expected_layer_shapes(c, T, S):
    D, H, KV, hd, F = c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_size
    return {
        "attn_norm.mean_sq": (1, T, 1), "attn_norm": (1, T, D),
        "attn.q_proj": (1, T, H * hd), "attn.k_proj": (1, T, KV * hd), "attn.v_proj": (1, T, KV * hd),
        "attn.q": (1, T, H, hd), "attn.k": (1, T, KV, hd), "attn.v": (1, T, KV, hd),
        "attn.rope_q": (1, T, H, hd), "attn.rope_k": (1, T, KV, hd),
        "attn.kv_cache.k": (1, S, KV, hd), "attn.kv_cache.v": (1, S, KV, hd),
        "attn.k_expanded": (1, H, S, hd), "attn.v_expanded": (1, H, S, hd),
        "attn.scores": (1, H, T, S), "attn.causal_mask": (T, S), "attn.masked_scores": (1, H, T, S),
        "attn.weights": (1, H, T, S), "attn.weighted_sum": (1, H, T, hd), "attn.merged": (1, T, H * hd),
        "attn.out": (1, T, D), "resid_mid": (1, T, D), "mlp_norm.mean_sq": (1, T, 1), "mlp_norm": (1, T, D),
        "mlp.gate": (1, T, F), "mlp.up": (1, T, F), "mlp.act": (1, T, F), "mlp.gated": (1, T, F),
        "mlp.down": (1, T, D), "resid_out": (1, T, D),
    }


def test_every_layer_records_every_op_in_order(embedded, prompt_trace):
    _, trace = prompt_trace
    c = embedded.config
    T = 5  # the embedded tokenizer adds no BOS
    assert trace.names[:2] == ["tokens", "embed"]
    assert trace.names[-3:] == ["final_norm.mean_sq", "final_norm", "lm_head"]
    expected = expected_layer_shapes(c, T, T)
    for i in range(c.n_layers):
        records = trace.layer(i)
        assert [r.name for r in records] == [f"layers.{i}.{op}" for op in LAYER_OPS]
        for r in records:
            assert r.shape == expected[r.name.split(".", 2)[2]], r.name
            assert r.tensor is not None and tuple(r.tensor.shape) == r.shape
    assert trace.shape("lm_head") == (1, T, c.vocab_size)
    assert len(trace) == 2 + c.n_layers * len(LAYER_OPS) + 3


def test_recorded_values_are_the_computation(embedded, prompt_trace):
    logits, trace = prompt_trace
    assert torch.equal(trace["lm_head"], logits)
    w = trace["layers.3.attn.weights"]
    assert torch.allclose(w.sum(-1), torch.ones(w.shape[:-1]), atol=1e-5)  # rows sum to 1
    assert torch.all(torch.triu(w[0, 0], diagonal=1) == 0)  # nothing attends to the future
    x, h = trace["layers.2.resid_out"], trace["layers.3.attn.out"]
    assert torch.allclose(trace["layers.3.resid_mid"], x + h)
    g = trace["layers.3.mlp.gate"]
    assert torch.allclose(trace["layers.3.mlp.act"], g * torch.sigmoid(g), atol=1e-6)


def test_macs_match_the_matmul_shapes(embedded, prompt_trace):
    _, trace = prompt_trace
    c = embedded.config
    T, D, hd = 5, c.hidden_size, c.head_dim
    assert trace.get("layers.0.attn.q_proj").macs == T * D * c.n_heads * hd
    assert trace.get("layers.0.attn.k_proj").macs == T * D * c.n_kv_heads * hd
    assert trace.get("layers.0.attn.scores").macs == c.n_heads * T * T * hd
    assert trace.get("layers.0.mlp.down").macs == T * c.ffn_size * D
    assert trace.get("lm_head").macs == T * D * c.vocab_size
    assert trace.get("layers.0.attn.weights").macs == 0


def test_shapes_only_and_name_filters(embedded):
    ids = embedded.encode(PROMPT)
    _, shapes = embedded.run(ids, keep_values=False)
    assert all(r.tensor is None for r in shapes) and shapes.nbytes() == 0
    _, filtered = embedded.run(ids, names="layers.*.attn.weights")
    kept = [r.name for r in filtered if r.tensor is not None]
    assert kept == [f"layers.{i}.attn.weights" for i in range(embedded.config.n_layers)]
    assert len(filtered) == len(shapes)  # every op is still recorded
    _, by_callable = embedded.run(ids, names=lambda n: n == "lm_head")
    assert [r.name for r in by_callable if r.tensor is not None] == ["lm_head"]
    with pytest.raises(LlmTraceError, match="holds no tensor"):
        filtered["embed"]
    with pytest.raises(LlmTraceError, match="no record named 'layers.0.attn.nope'"):
        filtered["layers.0.attn.nope"]


def test_table_and_compare(embedded):
    from llmtrace_book import Tracing, generate

    g = generate(embedded, PROMPT, max_new_tokens=2,
                 trace=Tracing(keep_values=False))
    prefill, decode = g.steps
    table = prefill.table(layers=1)
    assert "layers.0.attn.scores" in table and "[1, 9, 5, 5]" in table
    assert "layers.1..29" in table and "layers.1.attn" not in table
    cmp = prefill.compare(decode, "layers.0.attn.*")
    row = next(line for line in cmp.splitlines() if line.startswith("layers.0.attn.scores "))
    assert "[1, 9, 5, 5]" in row and "[1, 9, 1, 6]" in row and row.rstrip().endswith("*")


def test_trace_find_glob():
    t = Trace()
    t.record("layers.0.attn.scores", "x", torch.zeros(2))
    t.record("layers.1.attn.scores", "x", torch.zeros(3))
    t.record("layers.1.mlp.up", "x", torch.zeros(4))
    assert [r.shape for r in t.find("layers.*.attn.scores")] == [(2,), (3,)]
    assert "layers.1.mlp.up" in t and len(t.layer(1)) == 2


def test_logit_lens_last_layer_is_the_output(embedded, prompt_trace):
    from llmtrace_book.lens import logit_lens

    logits, trace = prompt_trace
    probs = logit_lens(embedded, trace)
    assert probs.shape == (embedded.config.n_layers, embedded.config.vocab_size)
    assert torch.allclose(probs[-1], logits[0, -1].softmax(-1), atol=1e-6)
    assert probs[-1].argmax().item() == 7042  # " Paris"
