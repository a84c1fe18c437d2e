"""RoPE: encode position by rotating pairs of dimensions of Q and K by an angle position * freq.

Dimension pairs follow Hugging Face's half-split convention: dimension d turns with d + head_dim/2.
Meta's original code pairs adjacent dimensions (2i, 2i+1) instead; the two agree once the rows of
W_q and W_k are permuted (`adjacent_to_half_split`), which is what HF's converter does and what
llama.cpp's converter undoes, so a GGUF file stores its Q and K rows in the adjacent layout.
"""

import math

import torch

from .trace import NO_TRACE


def rope_frequencies(head_dim: int, theta: float, device=None,
                     scaling: tuple = ()) -> torch.Tensor:
    """freq_i = theta^(-2i / head_dim) for each of the head_dim/2 pairs: 1.0 first,
    slowest last. scaling: Llama 3's stretch for long contexts (`llama3_scaled`)."""
    pairs = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device)  # [hd/2]
    exponents = pairs.float() / head_dim
    freqs = 1.0 / theta**exponents  # [head_dim/2]
    return llama3_scaled(freqs, dict(scaling)) if scaling else freqs


def llama3_scaled(freqs: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1's stretch for long contexts: pairs that turn slower than once per
    original_max / low_freq_factor positions turn `factor` times slower still; pairs that
    turn faster than once per original_max / high_freq_factor are left alone; in between,
    a blend of the two. The same float32 steps as HF's `_compute_llama3_parameters`."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs  # [hd/2]: positions per full turn
    scaled = torch.where(wavelen > old / low, freqs / factor, freqs)
    smooth = (old / wavelen - low) / (high - low)  # 0 at old/low, 1 at old/high
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = ~(wavelen < old / high) * ~(wavelen > old / low)
    return torch.where(middle, blended, scaled)  # [hd/2]


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 scaling: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = rope_frequencies(head_dim, theta, positions.device,
                             scaling)  # [head_dim/2]
    angles = positions.float()[:, None] * freqs[None, :]  # [T, head_dim/2]
    # each pair (d, d + head_dim/2) shares an angle
    angles = torch.cat([angles, angles], dim=-1)  # [T, head_dim]
    return angles.cos(), angles.sin()  # [T, head_dim] each


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    # (a, b) -> (-b, a) for every pair
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, trace=NO_TRACE,
               name: str = "rope", freq: str = "freq") -> torch.Tensor:
    """x: [B, T, n_heads, head_dim]. Rotates each pair (x[d], x[d+half]) by its angle:
    x[d]      -> x[d] cos - x[d+half] sin
    x[d+half] -> x[d+half] cos + x[d] sin"""
    # [T, 1, head_dim] each: the same angle for every head
    cos, sin = cos[:, None, :], sin[:, None, :]
    out = x * cos + rotate_half(x) * sin  # [B, T, n_heads, head_dim]
    what = f"rotate pairs (d, d+head_dim/2) by position * {freq}"
    return trace.record(name, what, out)


def apply_rope_adjacent(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Meta's convention, for comparison: pairs (2i, 2i+1) rotated as complex numbers."""
    head_dim = x.shape[-1]
    freqs = rope_frequencies(head_dim, theta)  # [head_dim/2]
    angles = positions.float()[:, None] * freqs[None, :]  # [T, head_dim/2]
    rot = torch.polar(torch.ones_like(angles), angles)[:, None, :]  # [T, 1, head_dim/2] complex
    pairs = x.float().reshape(*x.shape[:-1], head_dim // 2, 2)  # [B, T, H, head_dim/2, 2]
    pairs = torch.view_as_complex(pairs)  # [B, T, H, head_dim/2]
    return torch.view_as_real(pairs * rot).flatten(-2)  # [B, T, H, head_dim]


def adjacent_to_half_split(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder the rows of W_q or W_k ([n_heads*head_dim, in]) from the adjacent-pair layout to the
    half-split one: within each head, rows (0, 2, 4, ...) come first, then (1, 3, 5, ...).
    Use n_heads = query heads for W_q and KV heads for W_k."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def half_split_to_adjacent(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The inverse: the permutation HF-to-GGUF converters apply."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)
