"""Parameters from the config and multiply-adds from the trace."""

from llmtrace_book import Config
from llmtrace_book.cost import (macs_by_op, macs_per_layer, parameter_count, parameter_shares, parameter_table,
                           weight_macs_per_token_per_layer)
from llmtrace_book.model import trace_shapes


def test_tinyllama_parameters():
    c = Config.from_name("tinyllama-1.1b")
    rows = {r.component: r for r in parameter_table(c)}
    assert rows["embedding"].total == 32000 * 2048 == 65_536_000
    assert rows["q_proj"].shape == (2048, 2048) and rows["q_proj"].copies == 22
    assert rows["k_proj"].each == 524_288 and rows["v_proj"].each == 524_288
    assert rows["gate"].each == rows["up"].each == rows["down"].each == 11_534_336
    assert rows["lm_head"].total == 65_536_000  # untied: a table of its own
    assert parameter_count(c) == 1_100_048_384
    shares = parameter_shares(c)
    assert round(shares["per_layer_matrices"], 3) == 0.881  # the seed's 94% holds only for a tied head
    tied = c.replace(tied_lm_head=True)
    assert "lm_head" not in {r.component for r in parameter_table(tied)}
    assert round(parameter_shares(tied)["per_layer_matrices"], 3) == 0.937


def test_embedded_parameters(embedded):
    total = sum(t.numel() for name, t in _named(embedded))
    assert parameter_count(embedded.config) == total == 134_515_008


def _named(model):
    from llmtrace_book.model import state_dict_from_weights

    return state_dict_from_weights(model.config, model.weights).items()


def test_seven_b_macs_per_token_per_layer():
    c = Config.from_name("llama-2-7b")
    assert weight_macs_per_token_per_layer(c) == 202_375_168  # the seed's "about 202 million"
    _, decode = trace_shapes(c, prompt=5, decode_steps=1)
    per_layer = macs_by_op(decode, per_layer=True)
    projections = sum(v for k, v in per_layer.items() if k not in ("attn.scores", "attn.weighted_sum", "lm_head"))
    assert projections == 202_375_168
    assert per_layer["attn.scores"] == per_layer["attn.weighted_sum"] == 32 * 6 * 128  # one query, 6 keys


def test_macs_per_layer_and_totals():
    (prefill,) = trace_shapes("tinyllama-1.1b", 6, 0)
    layers = macs_per_layer(prefill)
    assert len(layers) == 22 and len(set(layers)) == 1
    c = Config.from_name("tinyllama-1.1b")
    attn = 2 * 32 * 6 * 6 * 64
    assert layers[0] == 6 * weight_macs_per_token_per_layer(c) + attn
    assert prefill.total_macs == 22 * layers[0] + 6 * 2048 * 32000
