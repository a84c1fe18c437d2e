"""The feed-forward network, SwiGLU: expand to F, gate with SiLU, project back to D.

Each position is transformed on its own: nothing here mixes tokens.
"""

import torch
import torch.nn.functional as F

from .trace import NO_TRACE


class MLP:
    """One layer's gated MLP: x [B, T, D] -> [B, T, D], reading `w.gate`, `w.up`, `w.down`."""
    act_name = "silu"  # what gates: SiLU (SwiGLU)

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
        # recomputed from gate when its record is read: the trace keeps one of the two
        return trace.record(f"{name}.act", "silu(gate) = gate * sigmoid(gate)",
                            F.silu(gate), recompute=(F.silu, f"{name}.gate"))  # [B, T, F]


def swiglu(x: torch.Tensor, w, trace=NO_TRACE, name: str = "mlp") -> torch.Tensor:
    """The gated MLP as one call: `MLP()(x, w, trace, name)`."""
    return MLP()(x, w, trace, name)
