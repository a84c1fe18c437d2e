"""Gemma's differences from Llama's parts, which Gemma 3, Gemma 4 and OLMo 2 (its norms after
the sublayers) and Qwen3-Next (its norms around 1) share:

- `offset_rms_norm`: the weight is stored as gain - 1, so the norm multiplies by (1 + weight);
- `GeGLU`: the MLP gated by GELU in its tanh form, with the same three matrices as SwiGLU;
- `scaled_embed`: the embedding's rows times sqrt(D), since Gemma stores small rows;
- `SandwichBlock`: a norm after each sublayer too, before its residual add; `PostNormBlock`
  (OLMo 2) keeps only those.
"""

import torch
import torch.nn.functional as F

from ..block import Block
from ..embed import embed
from ..mlp import MLP
from ..parts import Norm
from ..trace import NO_TRACE
from .attention_steps import HeadNormed


def rounded_last_rms_norm(x: torch.Tensor, gain: torch.Tensor, eps: float, trace=NO_TRACE,
                          name: str = "norm", gain_name: str = "weight") -> torch.Tensor:
    """RMSNorm in fp32 throughout, the gain too, rounded to x's dtype last: Gemma's and OLMo's
    order (Llama's rounds x_hat before its weight, `norm.rms_norm`). In fp32, the same numbers."""
    dtype = x.dtype
    x = x.float()
    mean_sq = trace.record(f"{name}.mean_sq", "mean(x^2) over the last dim",
                           x.pow(2).mean(-1, keepdim=True))  # [B, T, 1]
    x_hat = x * torch.rsqrt(mean_sq + eps)  # [B, T, D]
    return trace.record(name, f"x / sqrt(mean_sq + {eps:g}) * {gain_name}",
                        (gain.float() * x_hat).to(dtype))  # [B, T, D]


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, trace=NO_TRACE,
                    name: str = "norm") -> torch.Tensor:
    """RMSNorm times (1 + weight): a weight of 0 keeps the normalized x. In fp32, the gain
    too, then rounded to x's dtype, as HF's Gemma."""
    return rounded_last_rms_norm(x, 1 + weight.float(), eps, trace, name, "(1 + weight)")


class OffsetNorm(HeadNormed):
    """Q and K's norms multiply by (1 + weight), as the model's others (Gemma 3, Qwen3-Next)."""
    norm = staticmethod(offset_rms_norm)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class GeGLU(MLP):
    """Gemma: the gate's activation is GELU in its tanh approximation."""
    act_name = "gelu_tanh"

    def act(self, gate, trace=NO_TRACE, name="mlp"):
        return trace.record(f"{name}.act", "gelu_tanh(gate): GELU, tanh form",
                            gelu_tanh(gate), recompute=(gelu_tanh, f"{name}.gate"))


def scaled_embed(ids: torch.Tensor, table: torch.Tensor, trace=NO_TRACE) -> torch.Tensor:
    """The embedding's rows times sqrt(D), in the table's dtype, as HF."""
    x = embed(ids, table, trace)  # [B, T, D]
    D = table.shape[1]
    s = torch.tensor(D**0.5, dtype=table.dtype).item()
    return trace.record("embed.scaled", f"x * sqrt({D}) = x * {s:.6g}", x * s)  # [B, T, D]


class SandwichBlock(Block):
    """Gemma: each sublayer's output normalized once more before its add,
    h = x + post_norm(attention(norm(x))); `pre` False (OLMo 2): only that norm,
    h = x + post_norm(attention(x))."""

    def __init__(self, attn, mlp, config, norm, pre: bool = True):
        super().__init__(attn, mlp, config, norm)
        self.pre = pre

    def parts(self):
        """Its parts in model order: HF calls the norm after attention post_attention_layernorm,
        and the one before the MLP pre_feedforward_layernorm."""
        D, pre = self.hidden, self.pre
        return (*[Norm("attn_norm", "input_layernorm.weight", D)][:pre], self.attn,
                Norm("post_attn_norm", "post_attention_layernorm.weight", D),
                *[Norm("mlp_norm", "pre_feedforward_layernorm.weight", D)][:pre], self.mlp,
                Norm("post_mlp_norm", "post_feedforward_layernorm.weight", D))

    def __call__(self, x, w, pos, cache=None, trace=NO_TRACE, name="layers.0"):
        x = self.attention_half(x, w, pos, cache, trace, name)  # [B, T, D]
        return self.mlp_half(x, w, trace, name)  # [B, T, D]

    def attention_half(self, x, w, pos, cache, trace, name):
        h = self.norm(x, w.attn_norm, self.eps, trace,
                      f"{name}.attn_norm") if self.pre else x  # [B, T, D]
        h = self.attn(h, w, pos, cache, trace, f"{name}.attn")  # [B, T, D]
        h = self.norm(h, w.post_attn_norm, self.eps, trace,
                      f"{name}.attn_post_norm")  # [B, T, D]
        return trace.record(f"{name}.resid_mid", "x + attn(attn_norm(x))",
                            x + h)  # [B, T, D]

    def mlp_half(self, x, w, trace, name):
        h = self.norm(x, w.mlp_norm, self.eps, trace,
                      f"{name}.mlp_norm") if self.pre else x  # [B, T, D]
        h = self.mlp(h, w, trace, f"{name}.mlp")  # [B, T, D]
        h = self.norm(h, w.post_mlp_norm, self.eps, trace,
                      f"{name}.mlp_post_norm")  # [B, T, D]
        return trace.record(f"{name}.resid_out", "h + mlp(mlp_norm(h))",
                            x + h)  # [B, T, D]
