"""Stage 1: the embedding lookup. A table lookup, not a computation: row `id` of the table."""

import torch
import torch.nn.functional as F

from .trace import NO_TRACE


def embed(ids: torch.Tensor, table: torch.Tensor, trace=NO_TRACE) -> torch.Tensor:
    ids = trace.record("tokens", "token ids", ids)  # [B, T]
    x = F.embedding(ids, table)  # [B, T, D]
    V, D = table.shape
    return trace.record("embed", f"row lookup in embed_tokens [{V}, {D}]", x)
