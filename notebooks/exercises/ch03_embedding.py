"""Chapter 3: the embedding lookup."""

import torch

from .registry import Case, caller, exercise, trace_of
from .verdicts import shape, tensor_compare


def embed_tokens(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The embedding lookup. ids [B, T] (int64), table [V, D] -> [B, T, D]: row `id` of the
    table for each token."""
    return table[ids]  # [B, T, D]


@exercise(3, embed_tokens)
def _(model) -> Case:
    trace = trace_of(model)
    ids, table = trace["tokens"], model.weights.embed
    return Case(caller(ids, table), trace["embed"], f"embed {shape(trace['embed'])}",
                tensor_compare(1e-6), [
                    (lambda ids, table: table.T[ids], "the table is [V, D], one ROW per token: "
                                                      "table[ids]"),
                    (lambda ids, table: table[ids - 1], "token ids count from 0: row `id` "
                                                        "is table[id]")])
