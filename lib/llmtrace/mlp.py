"""The feed-forward network, SwiGLU: expand to F, gate with SiLU, project back to D.
Gemma gates with the tanh approximation of GELU instead (GeGLU): the same three matrices.

Each position is transformed on its own: nothing here mixes tokens.
"""

import torch
import torch.nn.functional as F

from .trace import NO_TRACE


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def swiglu(x: torch.Tensor, w, trace=NO_TRACE, name: str = "mlp",
           act: str = "silu") -> torch.Tensor:
    B, T, D = x.shape
    Fsz = w.gate.shape[0]
    gate = trace.record(f"{name}.gate", "x @ W_gate^T",
                        F.linear(x, w.gate), B * T * D * Fsz)  # [B, T, F]
    up = trace.record(f"{name}.up", "x @ W_up^T",
                      F.linear(x, w.up), B * T * D * Fsz)  # [B, T, F]
    # the activation is recomputed from gate when its record is read
    if act == "gelu_tanh":  # GeGLU (Gemma): GELU in its tanh approximation
        a = trace.record(f"{name}.act", "gelu_tanh(gate): GELU, tanh form",
                         gelu_tanh(gate), recompute=(gelu_tanh, f"{name}.gate"))
    else:
        a = trace.record(f"{name}.act", "silu(gate) = gate * sigmoid(gate)",
                         F.silu(gate),  # [B, T, F]
                         recompute=(F.silu, f"{name}.gate"))
    gated = trace.record(f"{name}.gated", f"{act}(gate) * up",
                         a * up)  # [B, T, F]
    down = F.linear(gated, w.down)  # [B, T, D]
    return trace.record(f"{name}.down", "gated @ W_down^T", down, B * T * Fsz * D)
