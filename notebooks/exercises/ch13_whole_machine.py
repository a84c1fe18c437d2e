"""Chapter 13: the whole forward pass, from the weights."""

import torch
import torch.nn.functional as F

from .ch05_attention import attention_from_weights
from .ch07_ffn import activation
from .ch08_stack import block_from_weights, block_variant
from .registry import Case, exercise, run, trace_of
from .verdicts import shape, tensor_compare


def forward_from_weights(ids: torch.Tensor, weights, config) -> torch.Tensor:
    """The whole forward pass from the weights. ids [B, T] (int64); weights: the model's (embed
    [V, D], layers: each layer's weights, final_norm [D], lm_head [V, D]); config: its Config
    -> logits [B, T, V]: the embedding rows, every block (chapter 8: norm, attention, add, norm,
    FFN, add), the final norm, the LM head. Today's families add: embedding rows scaled by
    sqrt(D) (config.embed_scale) and what chapters 6 and 8 list."""
    c, wt = config, weights

    def norm(t, weight):  # RMSNorm over the last axis; Gemma stores gain - 1
        gain = weight + 1 if c.norm_offset else weight
        return gain * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.norm_eps)
    x = wt.embed[ids]  # [B, T, D]: one row per token
    if c.embed_scale:  # Gemma: rows times sqrt(D), in the table's dtype
        x = x * torch.tensor(c.hidden_size ** 0.5, dtype=x.dtype)
    act = activation(c)  # SiLU (SwiGLU), or Gemma's GELU
    for i, w in enumerate(wt.layers):  # every block, pre-norm, in order
        h = attention_from_weights(norm(x, w.attn_norm), w, c, i)  # [B, T, D]
        x = x + (norm(h, w.post_attn_norm) if c.sandwich_norm else h)
        h = norm(x, w.mlp_norm)  # [B, T, D]
        h = F.linear(act(F.linear(h, w.gate)) * F.linear(h, w.up), w.down)  # [B, T, D]
        x = x + (norm(h, w.post_mlp_norm) if c.sandwich_norm else h)
    x = norm(x, wt.final_norm)  # [B, T, D]
    return F.linear(x, wt.lm_head)  # [B, T, V]


def _forward_variant(mistake: str):
    def forward(ids, wt, c):
        def norm(t, weight):
            gain = weight + 1 if c.norm_offset else weight
            return gain * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.norm_eps)
        x = wt.embed[ids]
        if c.embed_scale and mistake != "no_scale":
            x = x * torch.tensor(c.hidden_size ** 0.5, dtype=x.dtype)
        for i, w in enumerate(wt.layers):
            x = block_variant(x, w, c, i, mistake) if mistake == "no_residual" \
                else block_from_weights(x, w, c, i)
        if mistake != "no_final_norm":
            x = norm(x, wt.final_norm)
        return F.linear(x, wt.lm_head)
    return forward


@exercise(13, forward_from_weights)
def _(model) -> Case:
    trace = trace_of(model)
    ids, want = trace["tokens"], trace["lm_head"]
    return Case(lambda fn: run(fn, ids, model.weights, model.config,
                               names=["ids", "weights", "config"]), want,
                f"lm_head, the logits, {shape(want)}", tensor_compare(1e-4), [
                    (_forward_variant("no_final_norm"),
                     "the final norm is missing: normalize the last stream before the head"),
                    (_forward_variant("no_residual"),
                     "the residual connections are missing: each block ADDS its sublayers' "
                     "outputs to the stream")])
