"""generate and sample under bad input: arguments checked once, before the first step, each
failure one line that says what to do; what looks odd but is valid (a numpy seed, a temperature of
1e-45, -inf logits) gives the right result."""

import sys

import numpy as np
import pytest
import torch

from helpers import PROMPT, one_line
from llmtrace_book import LlmTraceError, Tracing, generate, meta_model, sample


@pytest.mark.parametrize("kwargs, says", [
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer, got 2.5 (float)"),
    (dict(temperature="0.5"), "temperature must be a number, got '0.5' (str)"),
    (dict(top_k=1.5), "top_k must be an integer"),
    (dict(top_p="all"), "top_p must be a number"),
    (dict(seed=2**64), "seed must be from 0 to 2**64 - 1"),
    (dict(seed=-1), "seed must be from 0"),
    (dict(seed="7"), "seed must be an integer"),
])
def test_generate_arguments(tiny, kwargs, says):
    with pytest.raises(LlmTraceError) as err:
        generate(tiny, PROMPT, **{"max_new_tokens": 2, **kwargs})
    assert says in one_line(err)


@pytest.mark.parametrize("temperature", [1e-30, 1e-39, 1e-45, 5e-324])
def test_any_positive_temperature(tiny, temperature):
    greedy = generate(tiny, PROMPT, 4, trace=False).new_ids
    cold = generate(tiny, PROMPT, 4, temperature=temperature, seed=3, trace=False)
    assert cold.new_ids == greedy


def test_sample_refuses_nan_logits():
    with pytest.raises(LlmTraceError, match="the logits hold NaN or \\+inf"):
        sample(torch.tensor([0.0, float("nan")]), 1.0)
    masked = torch.tensor([float("-inf"), 2.0, float("-inf")])  # -inf is a mask, not an error
    assert sample(masked, 0.7, generator=torch.Generator().manual_seed(0)) == 1


@pytest.mark.parametrize("seed", [np.int64(7), np.uint64(7), np.int32(7)])
def test_numpy_integer_seeds(tiny, seed):
    want = generate(tiny, PROMPT, 3, temperature=1.0, seed=7, trace=False).new_ids
    assert generate(tiny, PROMPT, 3, temperature=1.0, seed=seed, trace=False).new_ids == want


def test_generate_on_the_meta_device_has_nothing_to_sample():
    with pytest.raises(LlmTraceError) as err:
        generate(meta_model("tinyllama-1.1b"), [1, 450], 2)
    assert "is on the meta device (shapes, no values): there is nothing to sample from" in \
        one_line(err)


@pytest.mark.parametrize("logits, says", [
    (torch.tensor([]), "the logits are empty: there is no token to sample"),
    (torch.zeros(3, device="meta"), "the logits are on the meta device"),
    (torch.zeros(2, 3), "a float tensor [V], got float32 [2, 3]"),
    (torch.tensor([1, 2]), "a float tensor [V], got int64 [2]"),
    ([0.1, 0.9], "a float tensor [V], got list"),
])
def test_sample_refuses_what_is_not_one_positions_logits(logits, says):
    with pytest.raises(LlmTraceError) as err:
        sample(logits, 1.0)
    assert says in one_line(err)


def test_trace_policy_must_be_a_bool_or_a_tracing(tiny):
    with pytest.raises(LlmTraceError, match="trace must be True, False or a Tracing"):
        generate(tiny, PROMPT, 2, trace="all")
    with pytest.raises(LlmTraceError, match="keep_values must be True or False"):
        generate(tiny, PROMPT, 2, trace=Tracing(keep_values="no"))


def test_sampling_arguments_are_checked_once(tiny, monkeypatch):
    gen = sys.modules["llmtrace_book.generate"]  # the module; llmtrace_book.generate is the function
    calls = []
    real = gen.check_sampling
    monkeypatch.setattr(gen, "check_sampling", lambda *a: calls.append(a) or real(*a))
    generate(tiny, PROMPT, 5, temperature=0.7, top_k=5, seed=1, stop_at_eos=False, trace=False)
    assert len(calls) == 1
