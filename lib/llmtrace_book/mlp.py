"""The feed-forward network, SwiGLU: expand to F, gate with SiLU, project back to D.

Each position is transformed on its own: nothing here mixes tokens.
"""

import torch
import torch.nn.functional as F

from .parts import Part
from .trace import NO_TRACE


class MLP(Part):
    """One layer's gated MLP: x [B, T, D] -> [B, T, D], reading `w.gate`, `w.up`, `w.down`,
    F = width wide."""
    act_name = "silu"  # what gates: SiLU (SwiGLU)

    def __init__(self, hidden: int, width: int):
        self.hidden, self.width = hidden, width

    def tensors(self):
        """Its weights: field -> (Hugging Face name after "model.layers.N.", shape)."""
        D, Fsz = self.hidden, self.width
        return {"gate": ("mlp.gate_proj.weight", (Fsz, D)),
                "up": ("mlp.up_proj.weight", (Fsz, D)),
                "down": ("mlp.down_proj.weight", (D, Fsz))}

    def __call__(self, x: torch.Tensor, w, trace=NO_TRACE, name: str = "mlp") -> torch.Tensor:
        B, T, D = x.shape
        Fsz = w.gate.shape[0]
        gate = trace.record(f"{name}.gate", "x @ W_gate^T",
                            F.linear(x, w.gate), B * T * D * Fsz)  # [B, T, F]
        up = trace.record(f"{name}.up", "x @ W_up^T",
                          F.linear(x, w.up), B * T * D * Fsz)  # [B, T, F]
        a = self.act(gate, trace, name)  # [B, T, F]
        gated = trace.record(f"{name}.gated", f"{self.act_name}(gate) * up",
                             a * up)  # [B, T, F]
        down = F.linear(gated, w.down)  # [B, T, D]
        return trace.record(f"{name}.down", "gated @ W_down^T", down, B * T * Fsz * D)

    def act(self, gate: torch.Tensor, trace=NO_TRACE, name: str = "mlp") -> torch.Tensor:
        # the trace need not hold both: it computes this again from `gate` when it is read
        return trace.record(f"{name}.act", "silu(gate) = gate * sigmoid(gate)",
                            F.silu(gate), recompute=(F.silu, f"{name}.gate"))  # [B, T, F]


def swiglu(x: torch.Tensor, w, trace=NO_TRACE, name: str = "mlp") -> torch.Tensor:
    """The gated MLP as one call, its sizes read off its weights (w.gate is [F, D])."""
    width, hidden = w.gate.shape
    return MLP(hidden, width)(x, w, trace, name)
