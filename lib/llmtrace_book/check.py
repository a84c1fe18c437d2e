"""Checks of a caller's arguments at the edges of the library: integers, numbers, seeds, token
ids, model names, dtypes and devices. Each failure is one `LlmTraceError` line that says what was wrong and what to do
instead. (The trace checks its own arguments; the model checks the numbers it makes.)
"""

from __future__ import annotations

import math
import numbers
import os

import torch

from .errors import LlmTraceError, first_line

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


def check_ids(ids, vocab_size: int, batch: bool = False) -> torch.Tensor:
    """Token ids as one sequence [1, T]: a list of ints, a [T] or a [1, T] integer tensor, each id
    in 0 .. vocab_size - 1. batch=True also takes several sequences of one length, [B, T]."""
    if isinstance(ids, (str, bytes)):
        raise LlmTraceError("token ids must be a list or tensor of integers "
                            "(pass text as a str prompt)")
    try:
        t = torch.as_tensor(ids)
    except (TypeError, ValueError, RuntimeError) as e:
        raise LlmTraceError(f"token ids must be a list or tensor of integers, got "
                            f"{type(ids).__name__} ({first_line(e)[:80]})") from None
    if t.numel() == 0:
        raise LlmTraceError("no token ids: give at least one")
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        dtype = str(t.dtype).removeprefix("torch.")
        raise LlmTraceError(f"token ids must be integers, got {dtype}: convert them with .long()")
    if t.dim() == 1:
        t = t[None]  # [T] -> [1, T]
    if t.dim() != 2 or (t.shape[0] != 1 and not batch):
        raise LlmTraceError(f"token ids must be one sequence, shape [T] or [1, T], got "
                            f"{list(t.shape)}: run the sequences one at a time")
    # values are checked where they exist: not on the meta device, nor while torch.export
    # traces the pass (its ids are symbolic: the graph cannot branch on them)
    if t.device.type != "meta" and not torch.compiler.is_exporting():
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


# --- how a model runs: its dtype, its device -------------------------------------------------
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
DEVICES = ("cpu", "cuda", "mps")


def check_dtype(dtype) -> torch.dtype | None:
    """The dtype asked for: None (or "auto") for the checkpoint's own; a name ("bfloat16",
    "bf16", "float16", "fp16", "half", "float32", "fp32") or a torch dtype of those three."""
    if dtype is None or dtype == "auto":
        return None
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.strip().lower() in DTYPES:
        return DTYPES[dtype.strip().lower()]
    raise LlmTraceError(f"dtype {dtype!r} is not one llmtrace runs: use float32, bfloat16 or "
                        f"float16 (or leave it out for the checkpoint's own)")


def best_device() -> str:
    if torch.cuda.is_available():
        return "cuda"
    mps = getattr(torch.backends, "mps", None)
    return "mps" if mps is not None and mps.is_available() else "cpu"


def check_device(device) -> torch.device:
    """The device asked for (None: `best_device`), refused by name if it is not cpu, cuda[:N]
    or mps, or if this machine has no such device."""
    if device is None:
        return torch.device(best_device())
    try:
        d = torch.device(device.strip() if isinstance(device, str) else device)
    except (RuntimeError, TypeError, ValueError):
        d = None
    if d is None or d.type not in DEVICES:
        hint = " (the meta device has shapes only: use meta_model)" if d is not None \
            and d.type == "meta" else ""
        raise LlmTraceError(f"device {device!r} is not one llmtrace runs on: use cpu, cuda, "
                            f"cuda:N or mps{hint}")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise LlmTraceError(f"device {device!r}: this machine has no CUDA GPU that PyTorch "
                            f"can use (torch.cuda.is_available() is False): use device='cpu'")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise LlmTraceError(f"device {device!r}: this machine has {torch.cuda.device_count()} "
                            f"CUDA GPU(s), numbered from 0")
    if d.type == "mps" and not (getattr(torch.backends, "mps", None)
                                and torch.backends.mps.is_available()):
        raise LlmTraceError(f"device {device!r}: Apple's MPS is not available here: use "
                            f"device='cpu'")
    return d
