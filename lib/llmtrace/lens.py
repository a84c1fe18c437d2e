"""The logit lens: what the model would predict if it stopped after layer N.

Apply the final norm and the LM head (the model's own functions and weights) to the residual
stream after each layer, at one position. The last layer's lens is the model's real output.
"""

import numbers
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .errors import LlmTraceError
from .norm import rms_norm


def check_position(position, T: int) -> None:
    if isinstance(position, bool) or not isinstance(position, numbers.Integral) \
            or not -T <= position < T:
        raise LlmTraceError(f"position must be an integer from {-T} to {T - 1} (the prompt's "
                            f"{T} positions), got {position!r}: -1 is the last")


def check_token(token, V: int) -> None:
    if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < V:
        raise LlmTraceError(f"token must be a token id from 0 to {V - 1}, got {token!r}: "
                            f"encode it with the model's tokenizer")


@torch.inference_mode()
def logit_lens(model, trace, position: int = -1) -> torch.Tensor:
    """Probabilities [n_layers, V] at `position`, from `layers.N.resid_out` of a trace
    with values."""
    w, c = model.weights, model.config
    check_position(position, trace.shape("tokens")[1])
    resid = torch.stack([trace[f"layers.{i}.resid_out"][0, position]
                         for i in range(c.n_layers)])  # [L, D]
    x = rms_norm(resid, w.final_norm, c.norm_eps,
                 offset=c.norm_offset)  # [L, D]
    logits = F.linear(x, w.lm_head)  # [L, V]
    return logits.softmax(-1)


class LensGrid(NamedTuple):
    top_ids: torch.Tensor  # [L, T]: the most likely token after layer l at position t
    top_probs: torch.Tensor  # [L, T]: its probability
    token_probs: torch.Tensor | None  # [L, T]: the probability of one chosen token, if asked


@torch.inference_mode()
def lens_grid(model, trace, token: int | None = None) -> LensGrid:
    """The logit lens at every layer and every position, from `layers.N.resid_out` of a trace
    with values. One layer at a time, so a long prompt never holds [L, T, V] probabilities."""
    w, c = model.weights, model.config
    if token is not None:
        check_token(token, c.vocab_size)
    top_ids, top_probs, token_probs = [], [], []
    for i in range(c.n_layers):
        resid = trace[f"layers.{i}.resid_out"][0]  # [T, D]
        x = rms_norm(resid, w.final_norm, c.norm_eps, offset=c.norm_offset)  # [T, D]
        probs = F.linear(x, w.lm_head).softmax(-1)  # [T, V]
        p, ids = probs.max(-1)  # [T] each
        top_ids.append(ids)
        top_probs.append(p)
        if token is not None:
            token_probs.append(probs[:, token])  # [T]
    return LensGrid(torch.stack(top_ids), torch.stack(top_probs),
                    torch.stack(token_probs) if token is not None else None)
