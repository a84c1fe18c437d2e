"""Chapter 9: the final norm and the LM head."""

import torch

from .registry import Case, caller, exercise, trace_of
from .verdicts import shape, tensor_compare


def lm_head(x: torch.Tensor, gain: torch.Tensor, head: torch.Tensor, eps: float) -> torch.Tensor:
    """The end of the forward pass. x [B, T, D]: the stream out of the last layer; gain [D]: the
    final RMSNorm's weight; head [V, D]; eps -> logits [B, T, V]."""
    mean_sq = x.pow(2).mean(-1, keepdim=True)  # [B, T, 1]
    x = gain * x * torch.rsqrt(mean_sq + eps)  # [B, T, D]
    return x @ head.T  # [B, T, V]


def _norm(x, g, eps):
    return g * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@exercise(9, lm_head)
def _(model) -> Case:
    trace, c, w = trace_of(model), model.config, model.weights
    x, want = trace[f"layers.{c.n_layers - 1}.resid_out"], trace["lm_head"]
    gain = w.final_norm + 1 if c.norm_offset else w.final_norm  # Gemma stores gain - 1
    return Case(caller(x, gain, w.lm_head, c.norm_eps), want,
                f"lm_head, the logits, {shape(want)}", tensor_compare(1e-4), [
                    (lambda x, g, head, eps: x @ head.T,
                     "the final norm is missing: normalize x first, then the head"),
                    (lambda x, g, head, eps: _norm(x, torch.ones_like(g), eps) @ head.T,
                     "the final norm's gain is missing"),
                    (lambda x, g, head, eps: _norm(x, g, eps) @ head,
                     "a transposed matrix: head is [V, D]: x @ head.T")])
