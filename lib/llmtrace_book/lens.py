"""The logit lens: what the model would predict if it stopped after layer N.

Apply the model's own head (the final norm, the LM head and whatever follows it, `Model.head`)
to the residual stream as each layer hands it on, at one position. The last layer's lens is the
model's real output.
"""

import numbers
from typing import NamedTuple

import torch

from .errors import LlmTraceError


def check_position(position, T: int) -> None:
    if isinstance(position, bool) or not isinstance(position, numbers.Integral) \
            or not -T <= position < T:
        raise LlmTraceError(f"position must be an integer from {-T} to {T - 1} (the prompt's "
                            f"{T} positions), got {position!r}: -1 is the last")


def check_token(token, V: int) -> None:
    if isinstance(token, bool) or not isinstance(token, numbers.Integral) or not 0 <= token < V:
        raise LlmTraceError(f"token must be a token id from 0 to {V - 1}, got {token!r}: "
                            f"encode it with the model's tokenizer")


def stream_out(trace, i: int) -> str:
    """The name of the record that holds the residual stream as layer i hands it on: the
    layer's last record (`resid_out`, unless the layer adds to the stream after its MLP)."""
    return trace.find(f"layers.{i}.*")[-1].name


def keeps_stream(name: str) -> bool:
    """A trace filter (`names=`) that keeps what the lens reads, and only that."""
    return name.startswith("layers.") and name.rsplit(".", 1)[1] in STREAM_OUT


# the records a layer's stream can leave it by: after the MLP's add, Gemma 4's per-layer input
# and layer scalar
STREAM_OUT = ("resid_out", "resid_ple", "layer_scaled")


@torch.inference_mode()
def logit_lens(model, trace, position: int = -1) -> torch.Tensor:
    """Probabilities [n_layers, V] at `position`, from the stream leaving each layer
    (`layers.N.resid_out`) in a trace with values."""
    check_position(position, trace.shape("tokens")[1])
    # stream_out: the layer's last record, layers.{i}.resid_out in a Llama
    resid = torch.stack([trace[stream_out(trace, i)][0, position]
                         for i in range(model.config.n_layers)])  # [L, D]
    return model.head(resid).softmax(-1)  # [L, V]


class LensGrid(NamedTuple):
    top_ids: torch.Tensor  # [L, T]: the most likely token after layer l at position t
    top_probs: torch.Tensor  # [L, T]: its probability
    token_probs: torch.Tensor | None  # [L, T]: the probability of one chosen token, if asked


@torch.inference_mode()
def lens_grid(model, trace, token: int | None = None) -> LensGrid:
    """The logit lens at every layer and every position, from the stream leaving each layer in
    a trace with values."""
    streams = [trace[stream_out(trace, i)][0] for i in range(model.config.n_layers)]  # [T, D]
    return grid_of(model.head, streams, model.config.vocab_size, token)


def grid_of(head, streams, vocab_size: int, token: int | None = None) -> LensGrid:
    """`lens_grid` of the streams [T, D] leaving each layer, through `head` ([T, D] ->
    [T, V]). One layer at a time, so a long prompt never holds [L, T, V] probabilities."""
    if token is not None:
        check_token(token, vocab_size)
    top_ids, top_probs, token_probs = [], [], []
    for stream in streams:
        probs = head(stream).softmax(-1)  # [T, V]
        p, ids = probs.max(-1)  # [T] each
        top_ids.append(ids)
        top_probs.append(p)
        if token is not None:
            token_probs.append(probs[:, token])  # [T]
    return LensGrid(torch.stack(top_ids), torch.stack(top_probs),
                    torch.stack(token_probs) if token is not None else None)
