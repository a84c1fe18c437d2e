"""The block: one layer of the stack, pre-norm. Attention mixes the positions, the MLP transforms
each one; each adds what it computes to the residual stream x, read through a norm."""

from .norm import rms_norm
from .parts import Norm, Part
from .trace import NO_TRACE


class Block(Part):
    """One layer: h = x + attention(norm(x)), then h + mlp(norm(h)). Its parts: `attn` (Llama's
    `attention.Attention`), `mlp` (`mlp.MLP`) and the norm (`norm.rms_norm`); w holds the
    layer's weights."""

    def __init__(self, attn, mlp, config, norm=rms_norm):
        self.attn, self.mlp, self.norm = attn, mlp, norm
        self.eps, self.hidden = config.norm_eps, config.hidden_size

    def parts(self):
        """Its parts in model order, each norm's weight a part of its own."""
        D = self.hidden
        return (Norm("attn_norm", "input_layernorm.weight", D), self.attn,
                Norm("mlp_norm", "post_attention_layernorm.weight", D), self.mlp)

    def __call__(self, x, w, pos, cache=None, trace=NO_TRACE, name: str = "layers.0"):
        h = self.norm(x, w.attn_norm, self.eps, trace, f"{name}.attn_norm")  # [B, T, D]
        h = self.attn(h, w, pos, cache, trace, f"{name}.attn")  # [B, T, D]
        x = trace.record(f"{name}.resid_mid", "x + attn(attn_norm(x))",
                         x + h)  # [B, T, D]
        h = self.norm(x, w.mlp_norm, self.eps, trace, f"{name}.mlp_norm")  # [B, T, D]
        h = self.mlp(h, w, trace, f"{name}.mlp")  # [B, T, D]
        return trace.record(f"{name}.resid_out", "h + mlp(mlp_norm(h))",
                            x + h)  # [B, T, D]
