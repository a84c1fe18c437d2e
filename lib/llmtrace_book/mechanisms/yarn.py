"""YaRN: RoPE stretched for long contexts (DeepSeek-V3, DeepSeek-V2, gpt-oss), as HF's
`_compute_yarn_parameters` computes it. Its tables stand in for `rope.rope_cos_sin`'s: the
frequencies of fast pairs kept, slow pairs turned `factor` times slower, a ramp between, and
cos and sin both scaled by an attention factor (so every score by its square)."""

import math

import torch

from ..config_checks import yarn_checked

def yarn_frequencies(head_dim: int, theta: float, s: dict, device=None) -> torch.Tensor:
    """YaRN (gpt-oss): pairs that turn more than beta_fast times over the original context
    keep their frequency (extrapolated), pairs that turn fewer than beta_slow times turn
    `factor` times slower (interpolated), and a linear ramp over the pairs in between blends
    the two. The same float32 steps as HF's `_compute_yarn_parameters`."""
    s = yarn_checked(s, theta)
    factor, old = s["factor"], s["original_max_position_embeddings"]
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1  # HF's defaults

    def pair_of(turns):  # the (fractional) pair index that turns `turns` times in `old`
        return head_dim * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair_of(fast), pair_of(slow)
    if s.get("truncate", True):  # HF's default: whole pairs
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # no zero-width ramp
    pairs = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device)  # [hd/2]
    wavelen = theta ** (pairs.float() / head_dim)  # [hd/2]: 1 / freq
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)
    keep = 1 - ramp.clamp(0, 1)  # [hd/2]: 1 extrapolated (fast pairs) .. 0 interpolated
    return 1.0 / (factor * wavelen) * (1 - keep) + 1.0 / wavelen * keep  # [hd/2]


def rope_attention_factor(s: dict) -> float:
    """The factor YaRN multiplies cos and sin by (so every score by its square): its
    `attention_factor` if given, else 0.1 ln(factor) + 1, or the ratio of two such terms
    weighted by `mscale` and `mscale_all_dim` when both are set (DeepSeek's form), as HF
    computes it. 1 for any other rope_type (Llama 3)."""
    if s.get("rope_type") != "yarn":
        return 1.0
    s, given = yarn_checked(s), s.get("attention_factor")
    if given is not None:
        return given

    def gain(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = s.get("mscale"), s.get("mscale_all_dim")
    if m and m_all:
        return float(gain(s["factor"], m) / gain(s["factor"], m_all))
    return gain(s["factor"])


def yarn_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 scaling: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, head_dim] of YaRN's frequencies, each times its attention factor: for
    `attention.Positions.of` (its `rope`) in place of `rope.rope_cos_sin`."""
    s = dict(scaling)
    freqs = yarn_frequencies(head_dim, theta, s, positions.device)  # [hd/2]
    angles = positions.float()[:, None] * freqs[None, :]  # [T, hd/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, hd]
    gain = rope_attention_factor(s)
    return angles.cos() * gain, angles.sin() * gain  # [T, hd] each
