"""The KV cache: K and V of every position seen so far, one `KVCache` per layer, pre-allocated for
the longest sequence (gpt-fast's layout).

Prefill writes positions 0..T-1 and reads them straight back; each decode step writes one new
position and reads all of them, so K and V of earlier tokens are never computed twice. The caller
says where each step's tokens go (`input_pos`): the cache keeps no position of its own.
"""

import torch

from .errors import LlmTraceError


class KVCache:
    """One layer's K and V: [B, max_len, KV, head_dim] each."""

    def __init__(self, max_len: int, n_kv_heads: int, head_dim: int, batch: int = 1,
                 device="cpu", dtype=torch.float32):
        shape = (batch, max_len, n_kv_heads, head_dim)  # [B, max_len, KV, hd]
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def update(self, input_pos: int, k: torch.Tensor,
               v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v ([B, T, KV, head_dim]) at positions input_pos..input_pos+T-1;
        read back 0..input_pos+T-1."""
        end = input_pos + k.shape[1]
        if end > self.k.shape[1]:
            raise LlmTraceError(f"the KV cache holds {self.k.shape[1]} positions, "
                                f"this step needs {end}: make it with "
                                f"model.new_cache({end}) or larger")
        self.k[:, input_pos:end] = k
        self.v[:, input_pos:end] = v
        # [B, end, KV, hd] each, end = input_pos + T
        return self.k[:, :end], self.v[:, :end]

    def nbytes(self) -> int:
        """Memory this layer's cache holds at full length (on the meta device, what it would)."""
        return self.k.numel() * self.k.element_size() * 2


def bytes_per_token(n_kv_heads: int, head_dim: int, batch: int = 1,
                    bytes_per_value: int = 4) -> int:
    """Bytes one layer's cache grows by with each position: K and V of every KV head. A
    DeltaNet layer's state does not grow (`deltanet.state_bytes`)."""
    return batch * 2 * n_kv_heads * head_dim * bytes_per_value
