"""The words of a verdict: how a result differs from the wanted one, and hints that need no list
of mistakes (swapped axes, a constant factor, NaN)."""

from __future__ import annotations

import math
import re

import torch


def shape(t) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def fmt(x: float) -> str:
    return f"{x:.4g}"


def first_line(exc: BaseException) -> str:
    """`KeyError: 'x'`: the exception's type and the first line of its message, even when its
    str() itself raises."""
    try:
        text = str(exc).strip().splitlines()
    except Exception:  # noqa: BLE001: a message that cannot be printed
        text = ["(its message could not be printed)"]
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def same_error(a: BaseException, b: BaseException) -> bool:
    """The same message, but for the index an out-of-bounds error names: with several threads,
    the indexing kernel reports whichever bad index a thread met first."""
    def norm(e):
        try:
            return re.sub(r"index -?\d+ is out of bounds", "index is out of bounds", str(e))
        except Exception:  # noqa: BLE001
            return None
    return type(a) is type(b) and norm(a) is not None and norm(a) == norm(b)


def tensor_diff(got, want: torch.Tensor, rtol: float) -> str | None:
    """None when got matches want to rtol of want's largest finite |value| (infinities must match
    exactly); else the first difference, in words."""
    if not isinstance(got, torch.Tensor):
        return f"wanted a tensor {shape(want)}, got {type(got).__name__}"
    if got.shape != want.shape:
        return f"shape: wanted {shape(want)}, got {shape(got)}"
    if got.dtype == torch.bool and want.dtype != torch.bool:
        return "wanted numbers, got True/False (a bool tensor)"
    if got.is_complex():
        return "wanted real numbers, got a complex tensor: take torch.view_as_real or .real"
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    finite = torch.isfinite(w)
    scale = float(w[finite].abs().max()) if finite.any() else 0.0
    tol = rtol * max(scale, 1e-6)
    # NaN in got is bad (never in a recorded output); NaN matching NaN lets a mistake be recognised
    bad = ~((g == w) | ((g - w).abs() <= tol) | (g.isnan() & w.isnan()))
    if not bad.any():
        return None
    first = int(bad.flatten().nonzero()[0])
    idx = [int(i) for i in torch.unravel_index(torch.tensor(first), w.shape)] if w.dim() else []
    gap = (g - w).abs().nan_to_num(nan=math.inf, posinf=math.inf)  # inf: an infinity differs
    err = float(gap[bad].max())
    where = f"at {idx}" if idx else "the value"
    return (f"{where} wanted {fmt(w.flatten()[first])}, got {fmt(g.flatten()[first])} "
            f"(max error {err:.2g}, tolerance {tol:.2g})")


def with_rtol(compare, rtol: float | None):
    compare.rtol = rtol  # for the pass line
    return compare


def tensor_compare(rtol: float):
    return with_rtol(lambda got, want: tensor_diff(got, want, rtol), rtol)


def tuple_compare(labels: tuple[str, ...], rtol: float):
    """A tuple (or list) of tensors, each with its label."""
    def compare(got, want):
        if not isinstance(got, (tuple, list)) or len(got) != len(labels):
            return f"wanted {len(labels)} results ({', '.join(labels)}), got {type(got).__name__}"
        for label, g, w in zip(labels, got, want):
            d = tensor_diff(g, w, rtol)
            if d:
                return f"{label}: {d}"
        return None
    return with_rtol(compare, rtol)


def generic_hint(got, want) -> str | None:
    """Hints that need no list of mistakes: NaN, swapped axes, a constant factor."""
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        return None
    if got.shape == want.shape and got.is_floating_point() and bool(got.isnan().any()):
        return "your result holds NaN: an inf minus an inf, or 0 times an inf, somewhere"
    if got.dim() >= 2 and got.shape != want.shape and \
            got.shape == want.shape[:-2] + want.shape[-1:] + want.shape[-2:-1]:
        return "the last two axes are swapped: a transposed matrix?"
    if got.shape == want.shape and got.is_floating_point():
        g, w = got.detach().double().flatten(), want.detach().double().flatten()
        ok = torch.isfinite(w) & torch.isfinite(g)
        if ok.sum() > 1 and float((w[ok] ** 2).sum()) > 0:
            c = float((g[ok] * w[ok]).sum() / (w[ok] ** 2).sum())
            if abs(c - 1) > 1e-3 and torch.allclose(g[ok], c * w[ok], rtol=1e-4,
                                                    atol=1e-6 * float(w[ok].abs().max())):
                return f"yours is the wanted result times {c:.3g}: a scale is wrong or missing"
    return None
