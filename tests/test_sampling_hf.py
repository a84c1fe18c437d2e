"""`sample` keeps what HF transformers' logits warpers keep, with the same distribution:
temperature, then top-k, then top-p over the renormalized top-k (llama.cpp's sampler chain keeps
the same order). Compared on random logits, on the book's logits, and on the edges: ties at the
k-th logit, p exactly on a cumulative sum, ties at the top-p boundary, min_tokens_to_keep = 1."""

import itertools

import pytest
import torch
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from helpers import PROMPT
from llmtrace_book import Trace, sample
from llmtrace_book.sampling import warp


def hf(logits, temperature, top_k=None, top_p=None):
    """HF's warped distribution [V] and kept set, the warpers applied in generate's order."""
    scores = logits[None].float()  # [1, V]
    for warper in [TemperatureLogitsWarper(temperature),
                   TopKLogitsWarper(top_k) if top_k is not None else None,
                   TopPLogitsWarper(top_p) if top_p is not None else None]:
        if warper is not None:
            scores = warper(None, scores)
    probs = scores.softmax(-1)[0]  # [V]
    return probs, set(torch.isfinite(scores[0]).nonzero().flatten().tolist())


def ours(logits, temperature, top_k=None, top_p=None):
    t = Trace()
    probs = warp(logits, temperature, top_k, top_p, t)  # [V]
    kept = set(t["sample.sorted_ids"][t["sample.kept"]].tolist())
    return probs, kept


def same(logits, temperature, top_k=None, top_p=None):
    (p_hf, k_hf), (p_us, k_us) = (hf(logits, temperature, top_k, top_p),
                                  ours(logits, temperature, top_k, top_p))
    assert k_us == k_hf, (temperature, top_k, top_p)
    assert torch.allclose(p_us, p_hf, atol=1e-7, rtol=0), (temperature, top_k, top_p)
    return k_us


@pytest.mark.parametrize("seed", range(6))
def test_random_logits_every_combination(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(500, generator=g) * (1 + seed)  # flat to peaked
    for T, k, p in itertools.product([0.3, 1.0, 1.7], [None, 1, 7, 60, 500, 900],
                                     [None, 0.05, 0.5, 0.9, 0.99, 1.0]):
        same(logits, T, k, p)


def test_the_books_logits(prompt_trace):
    logits, _ = prompt_trace
    last = logits[0, -1]  # [V]
    kept = same(last, 1.0, 10, 0.9)
    # top-p walks the top ten renormalized: fewer survive than from the whole distribution
    probs = last.softmax(-1)
    mass_before = probs.sort(descending=True).values.cumsum(0)[:10] - probs.topk(10).values
    assert len(kept) < int((mass_before <= 0.9).sum())
    for T, k, p in itertools.product([0.5, 1.0, 2.0], [None, 5, 50], [None, 0.5, 0.95]):
        same(last, T, k, p)


def test_ties_with_the_kth_logit_are_kept():
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0, 0.0])
    assert same(logits, 1.0, top_k=2) == {0, 1, 2, 3}


def test_p_exactly_on_a_cumulative_sum():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))  # exact binary fractions
    assert same(logits, 1.0, top_p=0.75) == {0, 1}
    assert same(logits, 1.0, top_p=0.5) == {0}
    assert len(same(logits, 1.0, top_p=0.875)) == 3  # one of the tied 0.125s, as HF picks


def test_tied_probabilities_at_the_top_p_boundary():
    same(torch.zeros(8), 1.0, top_p=0.5)
    same(torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 1.0]), 1.0, top_p=0.6)
    same(torch.tensor([2.0, 1.0, 1.0, 1.0]), 1.0, top_k=3, top_p=0.7)


def test_the_most_likely_token_always_stays():
    logits = torch.tensor([0.0, 0.1, 0.2])
    assert same(logits, 1.0, top_p=1e-9) == {2}
    assert same(logits, 1.0, top_k=1, top_p=1e-9) == {2}


def test_draws_come_from_the_kept_set(prompt_trace):
    last = prompt_trace[0][0, -1]
    _, kept = hf(last, 1.0, 10, 0.9)
    draws = {sample(last, 1.0, 10, 0.9, torch.Generator().manual_seed(s)) for s in range(40)}
    assert draws <= kept and len(draws) == len(kept) == 2  # both kept tokens drawn by 40 seeds
