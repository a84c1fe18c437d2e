"""Chapter 4: RMSNorm."""

import torch

from .registry import Case, caller, exercise, stream_into, trace_of
from .verdicts import shape, tensor_compare


def rms_normalize(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm. x [B, T, D], gain [D] (the norm's weight), eps a float -> [B, T, D]: each token's
    vector divided by its root-mean-square (eps inside the square root), times the gain."""
    mean_sq = x.pow(2).mean(-1, keepdim=True)  # [B, T, 1]: one number per token
    return gain * x * torch.rsqrt(mean_sq + eps)  # [B, T, D]


def _rsqrt_ms(x, eps):
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@exercise(4, rms_normalize)
def _(model) -> Case:
    trace, c = trace_of(model), model.config
    x = stream_into(model, 0)
    w = model.weights.layers[0].attn_norm
    gain = 1 + w if c.norm_offset else w  # Gemma stores gain - 1: the check hands the gain
    want = trace["layers.0.attn_norm"]
    eps_hint = "eps goes INSIDE the square root: x / sqrt(mean(x^2) + eps)"

    def centred(x, g, eps):
        x = x - x.mean(-1, keepdim=True)
        return g * x * _rsqrt_ms(x, eps)
    return Case(caller(x, gain, c.norm_eps), want,
                f"layers.0.attn_norm {shape(want)}", tensor_compare(1e-5), [
                    (lambda x, g, eps: g * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps),
                     eps_hint),
                    (lambda x, g, eps: g * x / x.pow(2).mean(-1, keepdim=True).sqrt(),
                     eps_hint + " (it is missing)"),
                    (lambda x, g, eps: x * _rsqrt_ms(x, eps), "multiply by the gain at the end"),
                    (lambda x, g, eps: g * x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + eps),
                     "the mean is over the LAST axis: each token's own vector"),
                    (lambda x, g, eps: g * x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps),
                     "the MEAN of the squares, not their sum"),
                    (centred, "RMSNorm subtracts no mean (that is LayerNorm)")])
