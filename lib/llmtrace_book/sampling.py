"""From the last position's logits to one token id, in the order HF transformers' logits warpers
and llama.cpp's sampler chain apply them: temperature, then top-k, then top-p on what top-k left
(renormalized), then a seeded draw.

Every step is recorded under `sample.*`, most likely token first, so a reader can follow the
top-p walk with the real probabilities.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .check import check_int, check_real, check_seed
from .errors import LlmTraceError
from .trace import NO_TRACE


def check_sampling(temperature: float, top_k: int | None, top_p: float | None,
                   seed: int = 0) -> None:
    if temperature is None or check_real("temperature", temperature) < 0:
        raise LlmTraceError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if top_k is not None and check_int("top_k", top_k) < 1:
        raise LlmTraceError(f"top_k must be at least 1 (or None for no top-k), got {top_k}")
    if top_p is not None and not 0 < check_real("top_p", top_p) <= 1:
        raise LlmTraceError(f"top_p must be in (0, 1] (1 keeps everything), got {top_p}")
    check_seed(seed)


def check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 1 \
            or not logits.is_floating_point():
        got = (f"{str(logits.dtype).removeprefix('torch.')} {list(logits.shape)}"
               if isinstance(logits, torch.Tensor) else type(logits).__name__)
        raise LlmTraceError(f"sample takes the logits of one position, a float tensor [V], "
                            f"got {got}")
    if logits.numel() == 0:
        raise LlmTraceError("the logits are empty: there is no token to sample; pass the "
                            "logits of one position, [V] with V the vocabulary size")
    if logits.device.type == "meta":
        raise LlmTraceError("the logits are on the meta device (shapes, no values): there is "
                            "nothing to sample from; load a model with weights")
    if not math.isfinite(float(logits.sum())) and (  # one cheap pass; the exact look if needed
            torch.isnan(logits).any() or torch.isposinf(logits).any()
            or torch.isneginf(logits).all()):
        raise LlmTraceError("the logits hold NaN or +inf (or are all -inf): there is nothing to "
                            "sample from; check the model's output first")


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
    """logits [V] of the last position -> one token id. temperature 0 is greedy (the
    argmax); else temperature, top-k and top-p shape the distribution (`warp`), and a
    seeded draw picks from it."""
    check_sampling(temperature, top_k, top_p)
    check_logits(logits)
    probs = warp(logits, temperature, top_k, top_p, trace)  # [V], 0 where not kept
    return draw(probs, generator, trace)


def warp(logits: torch.Tensor, temperature: float, top_k: int | None = None,
         top_p: float | None = None, trace=NO_TRACE) -> torch.Tensor:
    """logits [V] -> the distribution a token is drawn from, [V], as HF's warpers make
    it: divide by the temperature; keep the top k logits; keep the most likely of those
    until they hold top_p of their own (renormalized) mass; renormalize what is kept."""
    logits = trace.record("sample.logits", "logits at the last position",
                          logits.float())  # [V]
    if temperature == 0:
        trace.record("sample.probs", "softmax(logits), shown: greedy takes the argmax",
                     torch.softmax(logits, -1))  # [V]
        return F.one_hot(logits.argmax(), len(logits)).float()  # [V]: all on the argmax
    scaled = trace.record("sample.scaled", f"logits / {temperature:g}",
                          scale(logits, temperature))  # [V]
    probs = trace.record("sample.probs", "softmax(scaled)",
                         torch.softmax(scaled, -1))  # [V], sums to 1
    up = scaled.sort(stable=True)  # [V] each, least likely first, as HF's top-p walks
    sorted_ids = trace.record("sample.sorted_ids", "token ids, most likely first",
                              up.indices.flip(0))  # [V]
    trace.record("sample.sorted_probs", "probabilities, descending", probs[sorted_ids])

    keep = torch.ones_like(up.values, dtype=torch.bool)  # [V], least likely first
    if top_k is not None:  # 1. top-k: the k largest logits, and any tied with the k-th
        keep = up.values >= up.values[-min(top_k, len(up.values))]
    # 2. top-p walks what top-k kept, renormalized
    renorm = up.values.masked_fill(~keep, -math.inf).softmax(-1)  # [V], least first
    trace.record("sample.cumsum", "cumulative sum of what top-k kept, renormalized",
                 renorm.flip(0).cumsum(-1))  # [V], most likely first
    if top_p is not None:
        # drop the least likely tokens while they, with all below, hold <= 1 - top_p
        below = renorm.cumsum(-1)  # [V]: the mass of a token and every less likely one
        keep &= below > 1 - top_p
        keep[-1] = True  # the most likely token always stays (min_tokens_to_keep = 1)
    keep = trace.record("sample.kept", f"kept: top_k={top_k}, top_p={top_p}",
                        keep.flip(0))  # [V], most likely first
    drop = torch.ones_like(keep).scatter(0, sorted_ids, ~keep)  # [V], vocabulary order
    out = torch.softmax(scaled.masked_fill(drop, -math.inf), -1)  # [V], renormalized
    trace.record("sample.filtered_probs", "kept probabilities, renormalized",
                 out[sorted_ids])  # [V], most likely first, 0 past the kept ones
    return out


def draw(probs: torch.Tensor, generator: torch.Generator | None = None,
         trace=NO_TRACE) -> int:
    """One token id from probs [V]: a seeded draw (the argmax if one holds it all)."""
    if float(probs.max()) == 1.0:  # greedy, or one token kept: nothing to draw
        return int(trace.record("sample.token", "argmax", probs.argmax()).item())
    choice = torch.multinomial(probs, 1, generator=generator)  # [1]: a token id
    token = trace.record("sample.token", "seeded multinomial draw", choice[0])
    return int(token.item())
