"""RMSNorm: scale each token's vector so its root-mean-square is 1, then by a learned weight.

Unlike LayerNorm no mean is subtracted: the vector is only rescaled, never shifted.
"""

import torch

from .trace import NO_TRACE


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, trace=NO_TRACE,
             name: str = "norm") -> torch.Tensor:
    dtype = x.dtype
    x = x.float()  # in fp32 whatever the weights' dtype (fp16's x^2 overflows past 256); fp32: x
    mean_sq = trace.record(f"{name}.mean_sq", "mean(x^2) over the last dim",
                           x.pow(2).mean(-1, keepdim=True))  # [B, T, 1]
    x_hat = x * torch.rsqrt(mean_sq + eps)  # [B, T, D]: each row now has RMS 1
    return trace.record(name, f"x / sqrt(mean_sq + {eps:g}) * weight",
                        weight * x_hat.to(dtype))  # [B, T, D]
