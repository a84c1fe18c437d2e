"""The KV cache: K and V of every position seen so far, pre-allocated for the longest sequence.

Prefill writes positions 0..T-1 and reads them straight back; each decode step writes one new
position and reads all of them, so K and V of earlier tokens are never computed twice.
"""

import torch

from .errors import LlmTraceError


class KVCache:
    def __init__(self, n_layers: int, max_len: int, n_kv_heads: int, head_dim: int, batch: int = 1,
                 device="cpu", dtype=torch.float32):
        shape = (batch, max_len, n_kv_heads, head_dim)  # [B, max_len, KV, hd]  [1, 2048, 4, 64]
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.max_len = max_len
        self.length = 0  # positions filled, set by the model after each forward pass

    def update(self, layer: int, start: int, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v ([B, T, KV, head_dim]) at positions start..start+T-1; read back
        0..start+T-1."""
        end = start + k.shape[1]
        if end > self.max_len:
            raise LlmTraceError(f"the KV cache holds {self.max_len} positions, this step needs "
                                f"{end}: make it with model.new_cache({end}) or larger")
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v
        return (self.k[layer][:, :end],
                self.v[layer][:, :end])  # [B, end, KV, head_dim]  [1, 7, 4, 64] at decode 1

    def nbytes(self) -> int:
        """Memory the cache holds: K and V of every layer at full length (on the meta device,
        what it would hold)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
