"""Stage 1: the embedding lookup. A table lookup, not a computation: row `id` of the table."""

import torch
import torch.nn.functional as F

from .trace import NO_TRACE


def embed(ids: torch.Tensor, table: torch.Tensor, trace=NO_TRACE,
          scale: bool = False) -> torch.Tensor:
    ids = trace.record("tokens", "token ids", ids)  # [B, T]
    x = F.embedding(ids, table)  # [B, T, D]
    V, D = table.shape
    x = trace.record("embed", f"row lookup in embed_tokens [{V}, {D}]", x)
    if scale:  # Gemma stores small rows; sqrt(D) in the table's dtype, as HF
        s = torch.tensor(D**0.5, dtype=table.dtype).item()
        x = trace.record("embed.scaled", f"x * sqrt({D}) = x * {s:.6g}",
                         x * s)  # [B, T, D]
    return x
