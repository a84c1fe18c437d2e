"""Chapter 8: the block around its sublayers, then a whole block from its weights."""

import torch
import torch.nn.functional as F

from .ch05_attention import attention_from_weights, attention_variant, two_layers
from .ch07_ffn import activation
from .registry import Case, exercise, run, stream_into, trace_of
from .verdicts import shape, tensor_compare, tuple_compare


def residual_block(x, attn, mlp, norm1, norm2):
    """A pre-norm block. x [B, T, D]: the residual stream into the layer; attn, mlp, norm1, norm2:
    the layer's own attention, FFN and two RMSNorms, each a function [B, T, D] -> [B, T, D].
    -> the stream out of the layer, [B, T, D]."""
    h = x + attn(norm1(x))  # [B, T, D]
    return h + mlp(norm2(h))  # [B, T, D]


def block_from_weights(x, w, config, layer: int) -> torch.Tensor:
    """One block from its weights. x [B, T, D]: the stream entering layer `layer`, at positions
    0..T-1; w: its weights (attn_norm, mlp_norm [D]; the attention's; gate, up [F, D], down
    [D, F]); config: the model's Config -> the stream leaving the layer (`resid_out`): norm,
    attention (chapter 6's attention_from_weights), residual add, norm, the FFN, residual add.
    Today's families add: a gain stored as gain - 1 (config.norm_offset), GELU's tanh form in
    place of SiLU (config.mlp_act), a norm after each sublayer (config.sandwich_norm)."""
    c = config

    def norm(t, weight):  # RMSNorm over the last axis; Gemma stores gain - 1
        gain = weight + 1 if c.norm_offset else weight
        return gain * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.norm_eps)
    h = attention_from_weights(norm(x, w.attn_norm), w, c, layer)  # [B, T, D]
    if c.sandwich_norm:  # Gemma: the sublayer's output normalized before the add
        h = norm(h, w.post_attn_norm)
    x = x + h  # [B, T, D]: the first residual add
    h = norm(x, w.mlp_norm)  # [B, T, D]
    act = activation(c)  # SiLU (SwiGLU), or Gemma's GELU
    h = F.linear(act(F.linear(h, w.gate)) * F.linear(h, w.up), w.down)  # [B, T, D]
    if c.sandwich_norm:
        h = norm(h, w.post_mlp_norm)
    return x + h  # [B, T, D]: the second


def block_variant(x, w, c, layer, mistake: str):
    """block_from_weights with one typical mistake: the checks' wrong versions."""
    def norm(t, weight):
        gain = weight + 1 if c.norm_offset else weight
        return gain * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.norm_eps)

    def attn(t):
        h = attention_variant(t, w, c, layer)
        return norm(h, w.post_attn_norm) if c.sandwich_norm else h

    def mlp(t):
        act = activation(c)
        h = F.linear(act(F.linear(t, w.gate)) * F.linear(t, w.up), w.down)
        return norm(h, w.post_mlp_norm) if c.sandwich_norm else h
    n1, n2 = (lambda t: norm(t, w.attn_norm)), (lambda t: norm(t, w.mlp_norm))
    if mistake == "no_residual":
        return mlp(n2(attn(n1(x))))
    if mistake == "mlp_reads_x":
        return x + attn(n1(x)) + mlp(n2(x))
    if mistake == "post_norm":
        return n2((h := n1(x + attn(x))) + mlp(h))
    if mistake == "no_norm":
        return (h := x + attn(x)) + mlp(h)
    raise ValueError(mistake)


RESIDUAL_HINTS = {
    "post_norm": "pre-norm: the norms apply to each sublayer's INPUT, x + attn(norm1(x)); the "
                 "stream itself is never normalized",
    "no_residual": "the residual connections are missing: add each sublayer's output to the "
                   "stream",
    "mlp_reads_x": "the MLP reads h = x + attn(norm1(x)), the stream after attention, not x",
}


def sublayers(model, i: int):
    """Layer i's attention, MLP and norms as functions [B, T, D] -> [B, T, D], the library's
    own: the parts of its block, `model.blocks[i]` (no cache: the prompt's positions only).
    What each sublayer adds to the stream includes the norm after it where the block has one
    (`config.sandwich_norm`: the block applies it before the residual add)."""
    c, block, lw = model.config, model.blocks[i], model.weights.layers[i]

    def after(h, weight):  # [B, T, D]: the norm after a sublayer, where the block has one
        return block.norm(h, weight, block.eps) if c.sandwich_norm else h

    def attn(h):  # [B, T, D]
        pos = model.positions(0, h.shape[1])
        return after(block.attn(h, lw, pos), lw.post_attn_norm)

    def mlp(h):
        return after(block.mlp(h, lw), lw.post_mlp_norm)

    def norm1(h):
        return block.norm(h, lw.attn_norm, block.eps)

    def norm2(h):
        return block.norm(h, lw.mlp_norm, block.eps)
    return attn, mlp, norm1, norm2


@exercise(8, residual_block)
def _(model) -> Case:
    x, want = stream_into(model, 0), trace_of(model)["layers.0.resid_out"]
    fns = sublayers(model, 0)
    mistakes = [
        (lambda x, a, m, n1, n2: n2((h := n1(x + a(x))) + m(h)), RESIDUAL_HINTS["post_norm"]),
        (lambda x, a, m, n1, n2: m(n2(a(n1(x)))), RESIDUAL_HINTS["no_residual"]),
        (lambda x, a, m, n1, n2: x + a(n1(x)) + m(n2(x)), RESIDUAL_HINTS["mlp_reads_x"]),
        (lambda x, a, m, n1, n2: x + m(n2(x + a(n1(x)))),
         "add the attention output to the stream too: h = x + attn(norm1(x)); "
         "out = h + mlp(norm2(h))")]
    return Case(lambda fn: run(fn, x, *fns), want, f"layers.0.resid_out {shape(want)}",
                tensor_compare(1e-4), mistakes)


@exercise(8, block_from_weights)
def _(model) -> Case:
    trace, c = trace_of(model), model.config
    layers = two_layers(model)
    inputs = [(stream_into(model, i), model.weights.layers[i], c, i) for i in layers]
    want = [trace[f"layers.{i}.resid_out"] for i in layers]

    def variant(mistake):
        return lambda x, w, c, i: block_variant(x, w, c, i, mistake)
    labels = tuple(f"layers.{i}.resid_out" for i in layers)
    return Case(lambda fn: [run(fn, *args) for args in inputs], want,
                f"resid_out of layers {' and '.join(map(str, layers))}",
                tuple_compare(labels, 1e-4), [
                    (variant("post_norm"), RESIDUAL_HINTS["post_norm"]),
                    (variant("no_residual"), RESIDUAL_HINTS["no_residual"]),
                    (variant("mlp_reads_x"), RESIDUAL_HINTS["mlp_reads_x"]),
                    (variant("no_norm"), "each sublayer reads a NORMALIZED copy of the stream: "
                                         "attn_norm before attention, mlp_norm before the FFN")])
