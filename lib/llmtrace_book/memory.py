"""Memory for traces that keep every value: the budget a trace must fit, and (opt-in) glibc
keeping the memory a dropped trace frees.

The budget. A trace that keeps every value holds one tensor per operation, less the views and
the records recomputed when read: about 500 MiB for a 256-token prompt on the embedded model,
about 12 GiB for 2048 tokens. Before a pass, the model counts what its trace could keep
(`Model.trace_bytes`, an upper bound) and refuses one over the budget: $LLMTRACE_TRACE_BUDGET
(bytes, or 8G, 500M), else half the memory available when the pass starts.

Freed memory. glibc's malloc hands large freed blocks straight back to the operating system, so
memory allocated afresh in every traced pass must be mapped and zero-filled by the kernel again,
page by page: on the benchmark machine about 2.3 GB/s, against about 14 GB/s for writing memory
the process kept, which made a traced pass 1.2-1.4x slower than HF's plain forward at 256 tokens.
The library's own answer is the trace's pool (`trace.TracePool`): a dropped trace returns its
buffers, and the next trace writes into them; nothing changes for the rest of the process.
`keep_freed_memory()` is the process-wide alternative, opt-in: it asks glibc to keep what any
code frees for reuse: blocks up to 32 MiB (glibc's largest mmap threshold) come from the heap,
and the heap is not trimmed below 1 GiB of free space. It is the effect PyTorch's CPU performance
guide gets by preloading jemalloc or tcmalloc. The cost: the whole process keeps its peak memory,
so the library never does it by itself: call it once, or set LLMTRACE_KEEP_FREED_MEMORY=1.
Elsewhere than glibc (macOS, musl) it does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re

from .errors import LlmTraceError

BUDGET_FRACTION = 0.5  # of the memory available when the pass starts
BUDGET_VARIABLE = "LLMTRACE_TRACE_BUDGET"
KEEP_VARIABLE = "LLMTRACE_KEEP_FREED_MEMORY"
SMALL = 4096  # positions x layers below which any trace fits: no estimate is made

M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 2**30


# --- the budget ----------------------------------------------------------------------------
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


SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(i?B)?\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    m = SIZE.fullmatch(text)
    if not m:
        raise LlmTraceError(f"{BUDGET_VARIABLE}={text!r} is not a size: write e.g. 8G or 500M "
                            f"or 123456789")
    return int(float(m.group(1)) * 1024 ** "BKMGT".index((m.group(2) or "B").upper()))


def explicit_budget() -> int | None:
    text = os.environ.get(BUDGET_VARIABLE, "").strip()
    return parse_bytes(text) if text else None


def trace_budget() -> int | None:
    """$LLMTRACE_TRACE_BUDGET, else half the memory available now (None: unknown)."""
    explicit = explicit_budget()
    if explicit is not None:
        return explicit
    avail = available_memory()
    return int(avail * BUDGET_FRACTION) if avail else None


def needs_estimate(positions: int, n_layers: int) -> bool:
    """A small trace fits anywhere: count its bytes only when it is large or a budget is set."""
    return explicit_budget() is not None or positions * n_layers >= SMALL


def check_budget(need: int, positions: int) -> None:
    """Refuse a value-keeping trace of `need` bytes that would not fit, before running it."""
    budget = trace_budget()
    if budget is not None and need > budget:
        raise LlmTraceError(f"a trace keeping these values of {positions} positions would hold "
                            f"about {need / 2**30:.1f} GiB, over the budget of "
                            f"{budget / 2**30:.1f} GiB: keep only what you need with "
                            f"names=['layers.3.*'], or keep_values=False for shapes only "
                            f"(or raise ${BUDGET_VARIABLE})")


# --- freed memory, opt-in --------------------------------------------------------------------
@functools.cache
def keep_freed_memory() -> bool:
    """Once per process: True if glibc now keeps freed memory for reuse."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    return (bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
            and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)))


def keep_freed_memory_if_asked() -> bool:
    """keep_freed_memory() when $LLMTRACE_KEEP_FREED_MEMORY is 1 (the opt-in), else nothing."""
    value = os.environ.get(KEEP_VARIABLE, "").strip()
    if value not in ("", "0", "1"):
        raise LlmTraceError(f"{KEEP_VARIABLE}={value!r}: set it to 1 (keep freed memory for "
                            f"the next trace) or 0, or unset it")
    return value == "1" and keep_freed_memory()
