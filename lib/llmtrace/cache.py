"""Files the library generates once and reuses: the embedded model converted to fp32 safetensors,
TinyLlama's tokenizer.model. They live in $LLMTRACE_CACHE; without it, in the project's .cache/
when the library runs from the book's checkout (where `make` puts them), else ~/.cache/llmtrace. Each is
written to a temporary name and renamed into place, so an interrupted run leaves nothing half-written."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    checkout = Path(__file__).resolve().parents[2]  # lib/llmtrace/cache.py -> the project root
    default = checkout / ".cache" if (checkout / "_toc.yml").is_file() else Path.home() / ".cache" / "llmtrace"
    d = Path(os.environ.get("LLMTRACE_CACHE") or default).expanduser()
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def atomic_path(final: Path, directory: bool = False):
    """Yield a temporary path beside `final`; on success move it to `final`, on failure remove it."""
    final.parent.mkdir(parents=True, exist_ok=True)
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        tmp.chmod(0o755)
    else:
        fd, name = tempfile.mkstemp(prefix=f".{final.name}.", dir=final.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        if directory and final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
