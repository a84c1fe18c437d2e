"""The model under bad input: token ids (through `run`, `generate` and `forward` alike), numbers
that stop being finite (named at the first operation, whatever the trace kept), and traces too
large for memory (refused before they run)."""

import time

import pytest
import torch

from helpers import PROMPT, nan_weight, one_line
from llmtrace_book import LlmTraceError, Tracing, generate, load_model
from llmtrace_book.model import estimate_trace_bytes, trace_bytes
from llmtrace_book.trace import Trace


@pytest.mark.parametrize("ids, says", [
    ([[1, 32000]], "token id 32000 is outside the vocabulary (0 .. 31999)"),
    ([[1, -5]], "token id -5 is outside the vocabulary"),
    ([[1.0, 2.0]], "token ids must be integers, got float32: convert them with .long()"),
    ([[1, 2], [3, 4]], "must be one sequence, shape [T] or [1, T], got [2, 2]"),
    ([[]], "no token ids: give at least one"),
    ("tokens", None),  # a str is a prompt: it is encoded, not refused
    (b"\x01\x02", "token ids must be a list or tensor of integers"),
    ([[1, "a"]], "token ids must be a list or tensor of integers"),
])
def test_token_ids(tiny, ids, says):
    if says is None:
        n = len(tiny.tokenizer.encode(ids))
        assert tiny.run(ids, keep_values=False)[0].shape[:2] == (1, n)
        return
    with pytest.raises(LlmTraceError) as err:
        tiny.run(ids)
    assert says in one_line(err)
    with pytest.raises(LlmTraceError, match="token"):
        generate(tiny, ids, 2)


def test_one_dimensional_ids_are_one_sequence(tiny):
    logits, trace = tiny.run(torch.tensor([1, 450, 7483]), keep_values=False)
    assert logits.shape == (1, 3, 32000) and trace.shape("tokens") == (1, 3)
    assert torch.equal(tiny.forward(torch.tensor([1, 450, 7483])), logits)  # forward too


def test_forward_checks_ids_as_run_does(tiny):
    with pytest.raises(LlmTraceError) as err:
        tiny.forward(torch.tensor([[1, 32000]]))
    assert "token id 32000 is outside the vocabulary (0 .. 31999)" in one_line(err)
    with pytest.raises(LlmTraceError, match="token ids must be integers, got float32"):
        tiny.forward(torch.tensor([[1.0, 2.0]]))
    two = torch.tensor([[1, 450], [1, 3444]])  # forward takes a batch of one length
    assert tiny.forward(two).shape == (2, 2, 32000)


def test_forward_past_the_context_or_without_a_cache(tiny):
    with pytest.raises(LlmTraceError) as err:
        tiny.forward(torch.ones(1, 257, dtype=torch.long))
    assert "257 positions exceed tiny-llama's context of 256: shorten the prompt" in one_line(err)
    with pytest.raises(LlmTraceError, match="reads the earlier ones from a KV cache: pass one"):
        tiny.forward(torch.ones(1, 1, dtype=torch.long), start=3)


# --- numbers that stop being finite ---------------------------------------------------------
def test_nan_weights_name_the_first_op(ckpt):
    nan_weight(ckpt, "model.layers.0.self_attn.v_proj.weight")
    m = load_model(ckpt)
    runs = [lambda: m.run(PROMPT), lambda: m.run(PROMPT, keep_values=False),
            lambda: m.run(PROMPT, names="layers.1.*"),  # the filter drops the first op's value
            lambda: generate(m, PROMPT, 3, trace=False),  # untraced: found by a traced re-run
            lambda: generate(m, PROMPT, 3,  # the CLI's --lens keeps only resid_out
                             trace=Tracing(names="layers.*.resid_out", steps=1))]
    for run in runs:
        with pytest.raises(LlmTraceError) as err:
            run()
        assert "the output of layers.0.attn.v_proj is not finite" in one_line(err)


def test_an_overflow_that_a_norm_hides_is_named(tiny):
    """x * 1e30 is finite, but its square is not: RMSNorm then divides by inf and every later
    logit is 0. That must not pass for a prediction of token 0."""
    patch = {"layers.0.resid_out": lambda t: t * 1e30}
    for run in (lambda: tiny.run(PROMPT, patch=patch),
                lambda: tiny.run(PROMPT, keep_values=False, patch=patch),
                lambda: generate(tiny, PROMPT, 2, trace=False, patch=patch)):
        with pytest.raises(LlmTraceError) as err:
            run()
        assert "the output of layers.1.attn_norm.mean_sq is not finite" in one_line(err)


# --- the memory budget ----------------------------------------------------------------------
def test_trace_size_budget(tiny, monkeypatch):
    monkeypatch.setenv("LLMTRACE_TRACE_BUDGET", "1M")
    ids = torch.ones(1, 100, dtype=torch.long)
    for names in (None, "*", ["*"], lambda name: True):  # every way to keep every value
        with pytest.raises(LlmTraceError) as err:
            tiny.run(ids, names=names)
        message = one_line(err)
        assert "over the budget of 0.0 GiB" in message
        assert "names=['layers.3.*']" in message and "keep_values=False" in message
    assert tiny.run(ids, keep_values=False)[0].shape == (1, 100, 32000)  # shapes only: no limit
    _, kept = tiny.run(ids, names="layers.0.attn.scores")  # a filter that fits
    assert kept["layers.0.attn.scores"].shape == (1, 4, 100, 100)
    with pytest.raises(LlmTraceError, match="over the budget"):
        generate(tiny, ids, 2)


@pytest.mark.parametrize("budget", ["lots", "1.2.3", ".", "8 G B", "1e9", "-5M", "nan"])
def test_budgets_that_are_not_sizes(tiny, monkeypatch, budget):
    monkeypatch.setenv("LLMTRACE_TRACE_BUDGET", budget)
    with pytest.raises(LlmTraceError) as err:
        tiny.run(PROMPT)
    assert f"LLMTRACE_TRACE_BUDGET={budget!r} is not a size: write e.g. 8G" in one_line(err)


def test_trace_size_count_matches_the_trace(tiny):
    _, trace = tiny.run(torch.ones(1, 40, dtype=torch.long))
    kept = sum(r.tensor.numel() * r.tensor.element_size() for r in trace if r.tensor is not None)
    assert trace_bytes(tiny.config, Trace(), 40) == estimate_trace_bytes(tiny.config, 40) == kept
    assert trace_bytes(tiny.config, Trace(names="*"), 40) == kept  # the meta count agrees
    every = Trace(names="*")
    assert trace_bytes(tiny.config, every, 40, 3) == trace_bytes(tiny.config, Trace(), 40, 3)
    only = Trace(names="layers.*.attn.weights")
    assert trace_bytes(tiny.config, only, 40) == 2 * 4 * 40 * 40 * 4  # 2 layers, 4 heads, fp32


def test_embedded_trace_of_2048_tokens_is_refused_first(embedded, monkeypatch):
    monkeypatch.setenv("LLMTRACE_TRACE_BUDGET", "8G")
    start = time.perf_counter()
    with pytest.raises(LlmTraceError, match="about 16.9 GiB, over the budget of 8.0 GiB"):
        embedded.run(torch.ones(1, 2048, dtype=torch.long))
    assert time.perf_counter() - start < 2
