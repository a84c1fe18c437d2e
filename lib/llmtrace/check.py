"""Checks at the edges of the library: arguments from a caller, numbers coming out of the model.

Each failure is one `LlmTraceError` line that says what was wrong and what to do instead. The
checks on every forward pass cost a few microseconds: the expensive one, which walks a trace to
find where numbers stopped being finite, runs only after the logits were found broken.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
import re

import torch

from .errors import LlmTraceError

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 0 .. 2**64 - 1 (and -2**63 .. -1)


# --- plain arguments ------------------------------------------------------------------------
def check_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer (not a bool, not 2.5, not "3") within [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise LlmTraceError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise LlmTraceError(f"{name} must be at least {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise LlmTraceError(f"{name} must be at most {maximum}, got {value}")
    return value


def check_real(name: str, value) -> float:
    """A finite real number (int or float, not a bool or a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise LlmTraceError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value):
        raise LlmTraceError(f"{name} must be a finite number, got {value}")
    return value


def check_seed(seed) -> int:
    """The rule: a seed is an integer from 0 to 2**64 - 1, the range torch.Generator accepts
    without folding negatives onto positives."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise LlmTraceError(f"seed must be an integer, got {seed!r} ({type(seed).__name__})")
    if not 0 <= seed <= SEED_MAX:
        raise LlmTraceError(f"seed must be from 0 to 2**64 - 1 ({SEED_MAX}), got {seed}: "
                            f"take it modulo 2**64 if any large number will do")
    return int(seed)


def check_ids(ids, vocab_size: int) -> torch.Tensor:
    """Token ids as one sequence [1, T]: a list of ints, a [T] or a [1, T] integer tensor, each id
    in 0 .. vocab_size - 1."""
    if isinstance(ids, (str, bytes)):
        raise LlmTraceError("token ids must be a list or tensor of integers "
                            "(pass text as a str prompt)")
    try:
        t = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as e:
        raise LlmTraceError(f"token ids must be a list or tensor of integers, got "
                            f"{type(ids).__name__} ({str(e).splitlines()[0][:80]})") from None
    if t.numel() == 0:
        raise LlmTraceError("no token ids: give at least one")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        dtype = str(t.dtype).removeprefix("torch.")
        raise LlmTraceError(f"token ids must be integers, got {dtype}: convert them with .long()")
    if t.dim() == 1:
        t = t[None]  # [T] -> [1, T]
    if t.dim() != 2 or t.shape[0] != 1:
        raise LlmTraceError(f"token ids must be one sequence, shape [T] or [1, T], got "
                            f"{list(t.shape)}: run the sequences one at a time")
    if t.device.type != "meta":
        low, high = int(t.min()), int(t.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise LlmTraceError(f"token id {bad} is outside the vocabulary (0 .. {vocab_size - 1}):"
                                f" encode the text with this model's tokenizer")
    return t.long()


def check_model_name(name):
    """load_model's argument: None, a name or a path (str or os.PathLike)."""
    if name is None:
        return None
    if isinstance(name, os.PathLike):
        return os.fspath(name)
    if not isinstance(name, str):
        raise LlmTraceError(f"load_model takes a model name or a path (str or pathlib.Path), "
                            f"got {type(name).__name__}")
    if not name.strip():
        raise LlmTraceError("the model name is empty: use auto, embedded, tinyllama, "
                            "a Hugging Face model directory or a .gguf file")
    return name


# --- trace look-ups -------------------------------------------------------------------------
def suggest(name, names: list[str]) -> str:
    """'; did you mean ...' for a name not in a trace: the closest names of the same layer."""
    if not isinstance(name, str):
        return (": look a record up by its name, e.g. trace['layers.0.attn.q'] "
                "(trace.records[i] is the i-th one)")
    m = re.match(r"layers\.(\d+)\.", name)
    pool = names
    if m:
        same = [n for n in names if n.startswith(m.group(0))]
        if not same:
            layers = sorted({int(n.split(".")[1]) for n in names if n.startswith("layers.")})
            span = f"layers 0..{layers[-1]}" if layers else "no layers"
            return f": this trace has {span}"
        pool = same
    close = difflib.get_close_matches(name, pool, n=3, cutoff=0.5)
    return f"; did you mean {', '.join(close)}?" if close else ""


# --- numbers out of the model ---------------------------------------------------------------
MAY_HOLD_MINUS_INF = ("causal_mask", "masked_scores")  # -inf there is the mask, by design


def not_finite(name: str, t: torch.Tensor) -> bool:
    if not t.is_floating_point():
        return False
    if name.rsplit(".", 1)[-1] in MAY_HOLD_MINUS_INF:
        return bool(torch.isnan(t).any() or torch.isposinf(t).any())
    return not bool(torch.isfinite(t).all())


def first_not_finite(trace) -> str | None:
    """The name of the first record (in the order the ops ran) whose tensor holds NaN or inf."""
    for r in trace.records:
        if r.tensor is not None and not_finite(r.name, r.tensor):
            return r.name
    return None


def check_finite(model, ids, logits: torch.Tensor, trace=None, patch=None) -> None:
    """Logits with NaN or inf must never be sampled from or printed. When they are, find the first
    operation whose output is not finite: from the trace if it kept every value, else from a
    fresh pass over the same ids that keeps them."""
    if logits.device.type == "meta" or math.isfinite(float(logits.sum())):
        return  # a sum is finite only if every term is (logits are far too small to overflow it)
    if bool(torch.isfinite(logits).all()):
        return
    from .trace import Trace

    traced = isinstance(trace, Trace) and trace.keep_values
    where = first_not_finite(trace) if traced else None
    if where is None:
        full = Trace(keep_values=True, label="finite check")
        with torch.inference_mode():
            model.forward(torch.as_tensor(ids).reshape(1, -1), full, patch=patch)  # [1, T]
        where = first_not_finite(full) or "lm_head"
    c = model.config
    raise LlmTraceError(f"{model.name}: the output of {where} is not finite (NaN or inf), so the "
                        f"logits are not either: check the weights that op reads and the config "
                        f"(rope_theta={c.rope_theta:g}, norm_eps={c.norm_eps:g})")


# --- memory of a trace that keeps every value ------------------------------------------------
BUDGET_FRACTION = 0.5  # of the memory available when the pass starts
BUDGET_VARIABLE = "LLMTRACE_TRACE_BUDGET"


def estimate_trace_bytes(config, T: int, S: int | None = None) -> int:
    """Bytes of a trace that keeps every value, for T new positions attending to S (default T),
    counted from the records a layer makes (fp32): what grows with T (projections, norms, the
    MLP's four [T, F] tensors), with S (the cache and its expanded K, V) and with T x S (scores,
    mask, masked scores, weights: the part that makes long prompts expensive). A test holds it
    within a few percent of `Trace.nbytes`."""
    S = T if S is None else S
    D, F, V = config.hidden_size, config.ffn_size, config.vocab_size
    q, kv, H = config.n_heads * config.head_dim, config.kv_size, config.n_heads
    per_layer = T * (6 * D + 5 * q + 5 * kv + 4 * F + 2) + S * 2 * (kv + q) + T * S * (3 * H + 1)
    outside = T * (2 * D + 1 + V) + 2 * T  # embed, final norm, lm_head; int64 token ids
    return 4 * (config.n_layers * per_layer + outside)


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise LlmTraceError(f"{BUDGET_VARIABLE}={text!r} is not a size: write e.g. 8G or 500M "
                            f"or 123456789")
    return int(float(m.group(1)) * 1024 ** "BKMGT".index((m.group(2) or "B").upper()))


def trace_budget() -> int | None:
    """$LLMTRACE_TRACE_BUDGET (bytes, or 8G, 500M), else half the memory available now."""
    text = os.environ.get(BUDGET_VARIABLE, "").strip()
    if text:
        return parse_bytes(text)
    avail = available_memory()
    return int(avail * BUDGET_FRACTION) if avail else None


def check_trace_budget(config, T: int, decode_steps: int = 0) -> None:
    """Refuse a value-keeping trace that would not fit, before running it."""
    explicit = os.environ.get(BUDGET_VARIABLE, "").strip()
    if not explicit and T * config.n_layers < 4096:  # fits anywhere: skip the estimate
        return
    budget = trace_budget()
    if budget is None:
        return
    need = estimate_trace_bytes(config, T) + sum(estimate_trace_bytes(config, 1, T + s)
                                                 for s in range(1, decode_steps + 1))
    if need > budget:
        raise LlmTraceError(f"a trace keeping every value of {T} positions would hold about "
                            f"{need / 2**30:.1f} GiB, over the budget of {budget / 2**30:.1f} GiB: "
                            f"keep only what you need with names=['layers.3.*'], or "
                            f"keep_values=False for shapes only (or raise ${BUDGET_VARIABLE})")
