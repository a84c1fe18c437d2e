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
def available_memory(device=None) -> int | None:
    """Bytes this process may still take: on a GPU, what its driver says is free; on the CPU,
    the least of the machine's available memory, the room left under this process's limits
    (RLIMIT_DATA on its data and mapped files, RLIMIT_AS on its address space) and under its
    cgroup's memory.max. None: unknown."""
    if device is not None and torch_device_type(device) == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    rooms = [machine_available(), *limits_room(), cgroup_room()]
    rooms = [r for r in rooms if r is not None]
    return max(0, min(rooms)) if rooms else None


def torch_device_type(device) -> str:
    return device.type if hasattr(device, "type") else str(device).split(":")[0]


def machine_available() -> int | None:
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


def limits_room() -> list[int]:
    """The room under RLIMIT_DATA (counted against VmData) and RLIMIT_AS (against VmSize)."""
    try:
        import resource

        status = open("/proc/self/status").read()
    except (ImportError, OSError):
        return []
    used = {k: int(v) * 1024 for k, v in re.findall(r"^(VmData|VmSize):\s+(\d+) kB", status,
                                                     re.MULTILINE)}
    rooms = []
    for limit, field in ((resource.RLIMIT_DATA, "VmData"), (resource.RLIMIT_AS, "VmSize")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY and field in used:
            rooms.append(soft - used[field])
    return rooms


def cgroup_room() -> int | None:
    """memory.max less memory.current of this process's cgroup (v2), if it sets a limit."""
    try:
        path = open("/proc/self/cgroup").read().strip().split("::")[-1]
        base = f"/sys/fs/cgroup{path.rstrip('/')}"
        limit = open(f"{base}/memory.max").read().strip()
        if limit == "max":
            return None
        return int(limit) - int(open(f"{base}/memory.current").read())
    except (OSError, ValueError):
        return None


RESERVE = 256 * 2**20  # kept free beside the weights: a pass's activations, the libraries


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n < 10 * 2**30 else f"{n / 2**30:.0f} GiB"


def choose_streaming(what: str, whole: int, streamed: int, stream: bool | None,
                     halved: str | None, device=None) -> bool:
    """Whether to stream the layers of a model whose weights take `whole` bytes in memory,
    or `streamed` a layer at a time: as asked (stream True or False), or, asked nothing, only
    when the whole does not fit. Refused in one line, before anything is read, when the mode
    asked for (or, asked nothing, every mode) does not fit what is available; the line names
    the modes that would. halved: the name of a dtype half as wide, if there is one."""
    room = available_memory(device)
    if room is None:
        return bool(stream)
    room -= RESERVE
    fits_whole, fits_streamed = whole <= room, streamed <= room
    if stream is None and (fits_whole or fits_streamed):
        return not fits_whole
    if stream is not None and (fits_streamed if stream else fits_whole):
        return bool(stream)
    ways = []
    if fits_streamed and not stream:
        ways.append("stream the layers from disk (stream=True, --stream)")
    if halved and (whole // 2 <= room or (stream is not False and streamed // 2 <= room)):
        ways.append(f"load it in {halved} (dtype={halved!r}, --dtype {halved})")
    how = ("; ".join(ways) if ways else "not even a layer at a time fits: free memory, or use a "
           "machine with more")
    asked = ("streamed" if stream else "whole") if stream is not None else "whole or streamed"
    raise LlmTraceError(f"{what} will not fit in memory ({asked}): its weights take "
                        f"{gib(whole)} whole, {gib(streamed)} streamed (the tables and two "
                        f"layers), and this process has {gib(max(room + RESERVE, 0))} "
                        f"available, {gib(RESERVE)} of it kept for the pass: {how}")


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
