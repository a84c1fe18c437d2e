"""Chapter 7: the gated FFN."""

import functools

import torch
import torch.nn.functional as F

from .registry import Case, caller, exercise, trace_of
from .verdicts import shape, tensor_compare


def gated_ffn(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
              act) -> torch.Tensor:
    """The FFN. x [B, T, D]; gate and up [F, D], down [D, F], stored (out, in) as F.linear takes
    them; act: the gate's activation (F.silu in Llama: SwiGLU) -> [B, T, D]:
    down(act(gate(x)) * up(x))."""
    g = F.linear(x, gate)  # [B, T, F]
    u = F.linear(x, up)  # [B, T, F]
    return F.linear(act(g) * u, down)  # [B, T, D]


def activation(config):
    """The gate's activation of a config: SiLU, or GELU's tanh form (Gemma's GeGLU)."""
    return F.silu if config.mlp_act == "silu" else functools.partial(F.gelu, approximate="tanh")


@exercise(7, gated_ffn)
def _(model) -> Case:
    trace = trace_of(model)
    lw = model.weights.layers[0]
    x, want = trace["layers.0.mlp_norm"], trace["layers.0.mlp.down"]
    return Case(caller(x, lw.gate, lw.up, lw.down, activation(model.config)), want,
                f"layers.0.mlp.down {shape(want)}", tensor_compare(1e-5), [
                    (lambda x, g, u, d, a: F.linear(a(F.linear(x, u)) * F.linear(x, g), d),
                     "the activation goes on the GATE's output, not on up's"),
                    (lambda x, g, u, d, a: F.linear(F.linear(x, g) * F.linear(x, u), d),
                     "the activation is missing: act(gate(x)) * up(x)"),
                    (lambda x, g, u, d, a: F.linear(a(F.linear(x, g) * F.linear(x, u)), d),
                     "the activation goes on the gate alone, before the product with up"),
                    (lambda x, g, u, d, a: F.linear(torch.sigmoid(F.linear(x, g))
                                                    * F.linear(x, u), d),
                     "silu(g) = g * sigmoid(g): the sigmoid alone is missing the factor g"),
                    (lambda x, g, u, d, a: (a(x @ g) * (x @ u)) @ d,
                     "a transposed matrix: the weights are stored (out, in); use x @ W.T or "
                     "F.linear(x, W)")])
