"""Chapter 6: RoPE's angles and its rotation."""

from typing import Callable

import torch

from llmtrace_book.rope import apply_rope, llama3_scaled
from llmtrace_book.rope import rope_cos_sin as library_cos_sin

from .registry import Case, caller, exercise, trace_of
from .verdicts import shape, tensor_compare, tensor_diff, tuple_compare


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float,
                stretch: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's angles, as the library lays them out. positions [T] (int64), head_dim, theta, and
    stretch, what the model does to the frequencies before use (Llama 3 slows the slow ones;
    for most models it returns them as they are) -> (cos, sin), each [T, head_dim].
    Pair i turns at freq_i = stretch(theta^(-2i / head_dim)); the angle is position * freq_i.
    The library pairs dimension d with d + head_dim/2 (HF's rotate-half layout), so both halves
    of a row hold the same head_dim/2 angles."""
    i = torch.arange(0, head_dim, 2).float()  # [head_dim/2]: 2i
    freqs = stretch(1.0 / theta ** (i / head_dim))  # [head_dim/2]
    angles = positions.float()[:, None] * freqs[None, :]  # [T, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, head_dim]: d and d + head_dim/2 share one
    return angles.cos(), angles.sin()


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation. x [B, T, H, head_dim] (the queries, heads split), cos and sin
    [T, head_dim] -> [B, T, H, head_dim]. Each pair (x[d], x[d + head_dim/2]) turns by its angle:
    x[d] cos - x[d + head_dim/2] sin, and x[d + head_dim/2] cos + x[d] sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (a, b) -> (-b, a) per pair
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, head_dim]: the same for every head
    return x * cos + rotated * sin  # [B, T, H, head_dim]


def rope_inputs(model):
    """Layer 0's positions, head_dim, RoPE base and stretch (Gemma 3's local layers turn at a
    base of their own, unstretched)."""
    trace, c = trace_of(model), model.config
    T = trace.shape("layers.0.attn.q")[1]
    local = bool(c.rope_local_theta and c.layer_types and c.is_sliding(0))
    scaling = () if local else c.rope_scaling

    def stretch(freqs):
        return llama3_scaled(freqs, dict(scaling)) if scaling else freqs
    return torch.arange(T), c.head_dim, c.rope_local_theta if local else c.rope_theta, stretch


def rope_in(model) -> torch.Tensor:
    """What layer 0 rotates: q, or q_norm where the family normalizes it (Qwen3, Gemma 3)."""
    return trace_of(model)["layers.0.attn.q_norm" if model.config.qk_norm
                           else "layers.0.attn.q"]


@exercise(6, rope_angles)
def _(model) -> Case:
    trace = trace_of(model)
    positions, hd, theta, stretch = rope_inputs(model)
    want = rope_angles(positions, hd, theta, stretch)
    # the reference must turn the recorded q into the recorded rope_q, or the check is wrong
    problem = tensor_diff(apply_rope(rope_in(model), *want), trace["layers.0.attn.rope_q"], 1e-5)
    if problem:
        raise ValueError(f"the angles do not make this model's rope_q ({problem})")

    def interleaved(positions, hd, theta, stretch):
        freqs = stretch(1.0 / theta ** (torch.arange(0, hd, 2).float() / hd))
        angles = (positions.float()[:, None] * freqs).repeat_interleave(2, -1)
        return angles.cos(), angles.sin()

    def half_only(positions, hd, theta, stretch):
        freqs = stretch(1.0 / theta ** (torch.arange(0, hd, 2).float() / hd))
        angles = positions.float()[:, None] * freqs
        return angles.cos(), angles.sin()

    def exponent_i(positions, hd, theta, stretch):
        freqs = stretch(1.0 / theta ** (torch.arange(hd // 2).float() / hd))
        angles = positions.float()[:, None] * freqs
        return torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    return Case(caller(positions, hd, theta, stretch), want,
                f"the cos, sin {shape(want[0])} of rope_q",
                tuple_compare(("cos", "sin"), 1e-5), [
                    (interleaved, "that is the adjacent-pair layout (2i, 2i+1), repeat_interleave; "
                                  "here dimension d pairs with d + head_dim/2: "
                                  "torch.cat([angles, angles], -1)"),
                    (half_only, "one angle per pair, and each pair has two dimensions: "
                                "repeat the angles to head_dim with torch.cat([a, a], -1)"),
                    (exponent_i, "freq_i = theta^(-2i / head_dim): the exponent steps by 2"),
                    (lambda p, hd, theta, s: rope_angles(p + 1, hd, theta, s),
                     "positions count from 0: the first token is not rotated"),
                    (lambda p, hd, theta, s: library_cos_sin(p, hd, theta),
                     "apply stretch to the frequencies: this model changes them (Llama 3's "
                     "rope_scaling)")])


@exercise(6, rope_rotate)
def _(model) -> Case:
    trace = trace_of(model)
    positions, hd, theta, stretch = rope_inputs(model)
    cos, sin = rope_angles(positions, hd, theta, stretch)
    x, want = rope_in(model), trace["layers.0.attn.rope_q"]

    def adjacent(x, cos, sin):
        half = x.shape[-1] // 2
        c, s = cos[:, None, :half], sin[:, None, :half]
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def no_minus(x, cos, sin):
        half = x.shape[-1] // 2
        r = torch.cat([x[..., half:], x[..., :half]], dim=-1)
        return x * cos[:, None] + r * sin[:, None]

    return Case(caller(x, cos, sin), want, f"layers.0.attn.rope_q {shape(want)}",
                tensor_compare(1e-5), [
                    (adjacent, "that is the adjacent-pair convention (2i, 2i+1), Meta's; the "
                               "library pairs d with d + head_dim/2 (rotate-half)"),
                    (lambda x, cos, sin: x * cos[:, None] - rotate_half(x) * sin[:, None],
                     "the rotation turns the wrong way: x[d] cos - x[d+half] sin, "
                     "x[d+half] cos + x[d] sin"),
                    (no_minus, "rotate-half is (-x2, x1): the second half comes first, negated"),
                    (lambda x, cos, sin: x * cos + rotate_half(x) * sin,
                     "cos and sin are [T, head_dim]: give them a head axis, cos[:, None, :]")])
