"""The difference of two traces names what a family adds to the Llama-2 walk, and nothing else."""

import pytest

from helpers import one_line

from llmtrace_book import Config, LlmTraceError, trace_shapes
from llmtrace_book.diff import layer_ops, same_op, trace_diff


def walk(name, **changes):
    """A preset's prefill of 4 tokens on the meta device, cut to 2 layers (the diff reads
    layer 0 and what lies outside the layers)."""
    c = Config.from_name(name).replace(n_layers=2, **changes)
    return trace_shapes(c, 4, 0)[0]


@pytest.fixture(scope="module")
def llama2():
    return walk("tinyllama-1.1b")


def names(records):
    return [r.name.split(".", 2)[-1] if r.name.startswith("layers.") else r.name
            for r in records]


def test_a_trace_has_no_difference_with_itself(llama2):
    d = trace_diff(llama2, llama2)
    assert (d.added, d.removed, d.recomputed, d.reshaped) == ([], [], [], [])
    assert d.lines() == []


def test_layers_compare_without_their_prefix(llama2):
    d = trace_diff(llama2, llama2, layer_a=0, layer_b=1)
    assert d.lines() == []
    assert "attn.q_norm" not in layer_ops(llama2, 1) and "attn.q_proj" in layer_ops(llama2, 1)
    assert "lm_head" in layer_ops(llama2, 1)  # what lies outside the layers comes along


def test_qwen3_adds_the_norms_of_q_and_k(llama2):
    d = trace_diff(llama2, walk("qwen3-0.6b"))
    assert names(d.added) == ["attn.q_norm.mean_sq", "attn.q_norm",
                              "attn.k_norm.mean_sq", "attn.k_norm"]
    assert d.removed == []
    # head_dim 128 over 16 heads: q_proj keeps TinyLlama's width, 2048, the stream halves
    reshaped = {b.name: b.shape for _, b in d.reshaped}
    assert "layers.0.attn.q_proj" not in reshaped and reshaped["embed"] == (1, 4, 1024)
    assert [b.name for _, b in d.recomputed] == ["lm_head"]  # the tied head


def test_mistral_adds_the_window_and_llama3_turns_rope_another_way(llama2):
    d = trace_diff(llama2, walk("mistral-7b"))
    assert names(d.added) == ["attn.window_mask"] and d.removed == []
    assert names(b for _, b in d.recomputed) == ["attn.masked_scores"]
    d = trace_diff(llama2, walk("llama-3.2-1b"))
    assert d.added == d.removed == []
    assert names(b for _, b in d.recomputed) == ["attn.rope_q", "attn.rope_k", "lm_head"]
    assert "llama3-scaled" in d.recomputed[0][1].op


def test_operations_compare_numbers_aside():
    assert same_op("split into 32 heads", "split into 8 heads")
    assert same_op("x / sqrt(mean_sq + 1e-05) * weight", "x / sqrt(mean_sq + 1e-06) * weight")
    assert not same_op("position * freq", "position * llama3-scaled freq")


def test_lines_fit_the_width_and_group_shapes(llama2):
    d = trace_diff(llama2, walk("qwen3-0.6b"))
    lines = d.lines()
    assert max(map(len, lines)) <= 80
    assert lines[0].startswith("+ attn.q_norm.mean_sq")
    # every changed shape once, each operation under it once
    assert sum(line.count("->") for line in d.shape_lines()) == len(
        {(a.shape, b.shape) for a, b in d.reshaped})
    assert "".join(d.shape_lines()).count("attn.k_proj") == 1


def test_a_layer_the_trace_lacks_is_named(llama2):
    with pytest.raises(LlmTraceError, match="has no layer 5: pick a layer"):
        layer_ops(llama2, 5)


@pytest.mark.parametrize("other, says", [
    ("tinyllama", "trace_diff compares two traces, got a str: pass model.run(prompt)[1] or "
                  "trace_shapes(config)[0]"),
    (None, "got a NoneType: pass model.run(prompt)[1]"),
    ([], "got a list: trace_shapes returns [prefill, decode 1, ...]: pass one, e.g. its [0]"),
    ((None, None), "got a tuple: model.run returns (logits, trace): pass its [1]"),
])
def test_what_is_not_a_trace_is_one_line(llama2, other, says):
    for a, b in ((llama2, other), (other, llama2)):
        with pytest.raises(LlmTraceError) as err:
            trace_diff(a, b)
        assert says in one_line(err)


def test_a_generation_and_a_bad_layer_or_width_are_one_line(llama2, embedded):
    from llmtrace_book import generate

    g = generate(embedded, "Hi", max_new_tokens=1)
    with pytest.raises(LlmTraceError, match=r"got a Generation: generate keeps one trace per "
                                            r"step: pass one, e.g. g.steps\[0\]"):
        trace_diff(llama2, g)
    with pytest.raises(LlmTraceError, match="layer must be an integer, got '0'"):
        trace_diff(llama2, llama2, layer_a="0")
    with pytest.raises(LlmTraceError, match="layer must be at least 0, got -1"):
        trace_diff(llama2, llama2, layer_b=-1)
    d = trace_diff(llama2, walk("qwen3-0.6b"))
    for width in (0, -5, 2.5):
        with pytest.raises(LlmTraceError, match="width must be"):
            d.lines(width=width)
        with pytest.raises(LlmTraceError, match="width must be"):
            d.shape_lines(width=width)
