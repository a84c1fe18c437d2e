"""Memory for traces that keep every value.

A trace that keeps every value holds one fresh tensor per operation: about 650 MiB for a 256-token
prompt on the embedded model. glibc's malloc hands large freed blocks straight back to the
operating system, so every traced pass after the first must have the kernel map and zero-fill all
that memory again, page by page. On the benchmark machine that runs at about 2.3 GB/s, against
about 14 GB/s for writing memory that malloc kept, and it made a traced pass 1.2-1.4x slower than
HF's plain forward at 256 tokens instead of about 1.05x (`make bench` prints both figures).

`keep_freed_memory()` asks glibc to keep what it frees for reuse: blocks up to 32 MiB (glibc's
largest mmap threshold) come from the heap, and the heap is not trimmed below 1 GiB of free space.
It is the effect PyTorch's CPU performance guide gets by preloading jemalloc or tcmalloc. The cost:
the process keeps its peak memory after a trace is dropped. So it is a choice, made explicitly:
`Model.run` makes it when its trace keeps values (`keep_freed_memory=True`, the default), and
code that builds value-keeping `Trace`s itself calls this function. Elsewhere than glibc (macOS,
musl) it does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import functools
import platform

M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 2**30

@functools.cache
def keep_freed_memory() -> bool:
    """Once per process: True if glibc now keeps freed memory for reuse."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    return (bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
            and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
