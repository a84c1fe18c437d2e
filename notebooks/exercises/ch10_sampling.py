"""Chapter 10: top-k, then the whole chain of HF's warpers."""

import torch

from .registry import Case, caller, exercise, trace_of
from .verdicts import shape, tensor_compare


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k filtering. logits [V] (one position), k -> [V]: the k largest logits as they are,
    every other one set to -inf (its probability becomes 0)."""
    kth = logits.topk(k).values[-1]  # the k-th largest logit
    return logits.masked_fill(logits < kth, float("-inf"))  # [V]


def top_p(logits: torch.Tensor, temperature: float, k: int, p: float) -> torch.Tensor:
    """The distribution a sampler draws from, in HF transformers' order. logits [V], temperature,
    k, p -> probabilities [V] in vocabulary order, zero for removed tokens, summing to 1:
    1. divide the logits by the temperature; 2. keep the top k (`top_k`); 3. softmax;
    4. top-p: in order of probability, remove a token once the mass of the tokens before it
    reaches p (the most likely token always stays); 5. renormalize what is kept."""
    probs = top_k(logits / temperature, k).softmax(-1)  # [V]: zero outside the top k
    sorted_probs, order = probs.sort(descending=True)  # [V] each
    before = sorted_probs.cumsum(-1) - sorted_probs  # [V]: the mass ahead of each token
    sorted_probs = sorted_probs.masked_fill(before >= p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)  # [V], vocabulary order
    return kept / kept.sum()


def sampling_inputs(model):
    """The last position's logits, and top-p's parameters: k = 10, temperature 1.5, and p near 0.9
    but halfway between two cumulative sums, so that no CPU's rounding moves the boundary."""
    logits = trace_of(model)["lm_head"][0, -1].detach().clone()  # [V]
    temperature, k = 1.5, 10
    probs = top_k(logits / temperature, k).softmax(-1).sort(descending=True).values
    cum = probs.cumsum(-1)[:k].tolist()
    j = next((i for i, x in enumerate(cum) if x >= 0.9), k - 1)
    p = round((cum[j] + (cum[j - 1] if j else 0.0)) / 2, 4)
    return logits, temperature, k, p


@exercise(10, top_k)
def _(model) -> Case:
    logits, _, k, _ = sampling_inputs(model)
    want = top_k(logits, k)
    inf = float("-inf")
    return Case(caller(logits, k), want, f"the top-{k} of the last logits {shape(want)}",
                tensor_compare(1e-6), [
                    (lambda l, k: l.masked_fill(l > l.topk(k, largest=False).values[-1], inf),
                     "keep the k LARGEST logits"),
                    (lambda l, k: l.masked_fill(l < l.topk(k + 1).values[-1], inf),
                     "off by one: keep exactly k tokens"),
                    (lambda l, k: l.masked_fill(l < l.topk(k - 1).values[-1], inf),
                     "off by one: keep exactly k tokens"),
                    (lambda l, k: l.masked_fill(l < l.topk(k).values[-1], 0.0),
                     "set the others to float('-inf'), not 0 (a logit of 0 is a likely token)"),
                    (lambda l, k: top_k(l, k).softmax(-1),
                     "return the filtered LOGITS; the softmax comes later")])


def _nucleus(probs, p, rule):
    sp, order = probs.sort(descending=True)
    keep = rule(sp.cumsum(-1), sp, p)
    keep[0] = True
    return torch.zeros_like(probs).scatter(-1, order, sp * keep)


def _before_reaches(cum, sp, p):
    return (cum - sp) < p


@exercise(10, top_p)
def _(model) -> Case:
    logits, temperature, k, p = sampling_inputs(model)
    want = top_p(logits, temperature, k, p)

    def p_then_k(l, t, k, p):
        kept = _nucleus((l / t).softmax(-1), p, _before_reaches)
        kept = kept.masked_fill(l < l.topk(k).values[-1], 0.0)
        return kept / kept.sum()

    def cum_le_p(l, t, k, p):
        kept = _nucleus(top_k(l / t, k).softmax(-1), p, lambda cum, sp, p: cum <= p)
        return kept / kept.sum()

    def not_renormalized(l, t, k, p):
        return _nucleus(top_k(l / t, k).softmax(-1), p, _before_reaches)

    return Case(caller(logits, temperature, k, p), want,
                f"what HF's warpers keep {shape(want)}", tensor_compare(1e-5), [
                    (p_then_k, "top-p was cut before top-k: HF's order is temperature, top-k, "
                               "then top-p on the RENORMALIZED top-k probabilities"),
                    (cum_le_p, "keep the token that crosses p: remove a token once the mass "
                               "BEFORE it reaches p"),
                    (not_renormalized, "renormalize: the kept probabilities must sum to 1"),
                    (lambda l, t, k, p: top_p(l * t * t, t, k, p),
                     "DIVIDE the logits by the temperature")])
