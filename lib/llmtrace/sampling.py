"""From the last position's logits to one token id: temperature, top-k, top-p, a seeded draw.

Every step is recorded under `sample.*`, so a reader can follow the cumulative-sum walk of top-p
with the real probabilities.
"""

from __future__ import annotations

import math

import torch

from .errors import LlmTraceError
from .trace import NO_TRACE


def check_sampling(temperature: float, top_k: int | None, top_p: float | None,
                   seed: int = 0) -> None:
    from .check import check_int, check_real, check_seed

    if temperature is None or check_real("temperature", temperature) < 0:
        raise LlmTraceError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and check_int("top_k", top_k) < 1:
        raise LlmTraceError(f"top_k must be at least 1 (or None for no top-k), got {top_k}")
    if top_p is not None and not 0 < check_real("top_p", top_p) <= 1:
        raise LlmTraceError(f"top_p must be in (0, 1] (1 keeps everything), got {top_p}")
    check_seed(seed)


def scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / temperature, for any positive temperature. Below about 1e-36 the division
    overflows float32 to inf, and softmax of inf is NaN; softmax does not change when every logit
    is shifted by the same amount, so then shift the largest to 0 first and divide in float64:
    every other logit goes to a large negative number or -inf, whose probability is 0."""
    top = float(logits.abs().max())
    if math.isinf(top):  # -inf marks masked tokens: the largest finite logit is what overflows
        top = float(logits[torch.isfinite(logits)].abs().max())
    if top < temperature * 1e36:
        return logits / temperature  # [V]
    shifted = (logits.double() - logits.max().double()) / temperature  # [V], at most 0
    return shifted.float()


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
           top_p: float | None = None, generator: torch.Generator | None = None,
           trace=NO_TRACE) -> int:
    """logits: [V] for the last position. temperature 0 is greedy (the argmax)."""
    check_sampling(temperature, top_k, top_p)
    if logits.dim() != 1 or not logits.is_floating_point():
        raise LlmTraceError(f"sample takes the logits of one position, a float tensor [V], "
                            f"got {str(logits.dtype).removeprefix('torch.')} {list(logits.shape)}")
    if not math.isfinite(float(logits.sum())) and (  # one cheap pass; the exact look if needed
            torch.isnan(logits).any() or torch.isposinf(logits).any()
            or torch.isneginf(logits).all()):
        raise LlmTraceError("the logits hold NaN or +inf (or are all -inf): there is nothing to "
                            "sample from; check the model's output first")
    logits = trace.record("sample.logits", "logits at the last position",
                          logits.float())  # [V]  [32000]
    if temperature == 0:
        trace.record("sample.probs", "softmax(logits), for display: greedy takes the argmax",
                     torch.softmax(logits, -1))  # [V]
        return int(trace.record("sample.token", "argmax", logits.argmax()).item())

    scaled = trace.record("sample.scaled", f"logits / {temperature:g}",
                          scale(logits, temperature))  # [V]
    probs = trace.record("sample.probs", "softmax(scaled)",
                         torch.softmax(scaled, -1))  # [V], sums to 1
    sorted_probs, sorted_ids = probs.sort(descending=True)  # [V] each, most likely first
    trace.record("sample.sorted_ids", "token ids by probability, descending", sorted_ids)
    trace.record("sample.sorted_probs", "probabilities, descending", sorted_probs)
    cumsum = trace.record("sample.cumsum", "cumulative sum of sorted probabilities",
                          sorted_probs.cumsum(-1))  # [V]
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)  # [V]
    if top_k is not None:
        keep[top_k:] = False
    if top_p is not None:
        # keep the smallest prefix whose mass reaches top_p:
        # drop a token once the mass before it is past p
        keep &= (cumsum - sorted_probs) <= top_p
    trace.record("sample.kept", f"kept: top_k={top_k}, top_p={top_p}", keep)
    kept_probs = sorted_probs * keep
    kept_probs = trace.record("sample.filtered_probs", "kept probabilities, renormalized",
                              kept_probs / kept_probs.sum())  # [V], zero past the kept prefix
    choice = torch.multinomial(kept_probs, 1,
                               generator=generator)  # [1]: a position in the sorted order
    return int(trace.record("sample.token", "seeded multinomial draw",
                            sorted_ids[choice][0]).item())
