"""Files the library generates once and reuses: the embedded model converted to fp32 safetensors,
TinyLlama's tokenizer.model. They live in $LLMTRACE_CACHE; without it, in the project's .cache/
when the library runs from the book's checkout (where `make` puts them), else ~/.cache/llmtrace.
Each is written to a temporary name and renamed into place, so an interrupted run leaves nothing
half-written.

A generated directory ends with `manifest.json`, written last: the size and a fingerprint of every
file in it. `usable(d)` is the one rule: an entry whose files do not match their manifest
(truncated, edited, half-deleted, never finished) is rebuilt, under a lock (one builder at a time)
after checking the disk has room; temporaries that a killed run left behind go with the next one.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from .errors import LlmTraceError

MANIFEST = "manifest.json"
FILE_MODE = 0o644  # generated files are data anyone on the machine may read
STALE_SECONDS = 24 * 3600  # a temporary whose pid says nothing (another machine's) goes after a day


def checkout() -> Path | None:
    """The book's checkout this library runs from, if any (lib/llmtrace_book/disk_cache.py -> the root)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "_toc.yml").is_file() and (root / "Makefile").is_file() else None


def command(make_target: str, module: str) -> str:
    """The command that builds something, as the user can type it where they are: `make` in the
    checkout, else the Python module the make target runs."""
    root = checkout()
    if root is not None and Path.cwd().resolve() == root:
        return f"make {make_target}"
    return f"{Path(sys.executable).name} -m {module}"


def cache_dir() -> Path:
    root = checkout()
    default = root / ".cache" if root is not None else Path.home() / ".cache" / "llmtrace"
    d = Path(os.environ.get("LLMTRACE_CACHE") or default).expanduser()
    if d.exists() and not d.is_dir():
        raise LlmTraceError(f"the cache {d} is a file, not a directory: move it away, "
                            f"or set LLMTRACE_CACHE to a directory")
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LlmTraceError(f"cannot create the cache directory {d} ({e.strerror or e}): "
                            f"set LLMTRACE_CACHE to a writable directory") from None
    return d


def cache_subdir(name: str) -> Path:
    """cache_dir() / name, made if missing. A file in its place, or a cache it cannot be made in
    (read-only), is refused in one line: mkdir's own error is a traceback."""
    d = cache_dir() / name
    if d.exists() and not d.is_dir():
        raise LlmTraceError(f"{d} is a file, not a directory: move it away, "
                            f"or set LLMTRACE_CACHE to another directory")
    if not d.is_dir():
        check_writable(d.parent)
        d.mkdir(exist_ok=True)
    return d


def check_writable(d: Path, need_bytes: int = 0) -> None:
    """Before a slow build: can files be written in `d`, and is there room for `need_bytes`?"""
    try:
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=d)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise LlmTraceError(f"cannot write in the cache {d} ({e.strerror or e}): make it writable, "
                            f"or set LLMTRACE_CACHE to a writable directory") from None
    free = shutil.disk_usage(d).free
    if free < need_bytes:
        raise LlmTraceError(f"the cache {d} has {free / 2**20:,.0f} MiB free, "
                            f"{need_bytes / 2**20:,.0f} MiB are needed: free some space, "
                            f"or set LLMTRACE_CACHE to another disk")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def collect_stale(parent: Path, name: str) -> list[Path]:
    """Remove temporaries of `name` left in `parent` by runs that died (killed, out of memory)."""
    removed = []
    for tmp in parent.glob(f".{name}.*"):
        parts = tmp.name[len(name) + 2:].split(".", 1)
        pid = int(parts[0]) if parts[0].isdigit() else None
        try:
            age = time.time() - tmp.lstat().st_mtime
        except OSError:
            continue
        if (pid is not None and pid != os.getpid() and not _pid_alive(pid)) or age > STALE_SECONDS:
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _disk_full(e: OSError, where: Path) -> LlmTraceError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return LlmTraceError(f"the disk holding {where} is full: free some space, "
                             f"or set LLMTRACE_CACHE to another disk")
    return LlmTraceError(f"cannot write {where} ({e.strerror or e}): "
                         f"check the cache directory's permissions")


@contextlib.contextmanager
def atomic_path(final: Path, directory: bool = False):
    """Yield a temporary path beside `final`; on success move it to `final`, on failure remove it.
    The temporary's name carries this process's id, so a later run can tell it was abandoned."""
    final.parent.mkdir(parents=True, exist_ok=True)
    collect_stale(final.parent, final.name)
    prefix = f".{final.name}.{os.getpid()}."
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
        tmp.chmod(0o755)
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, dir=final.parent)
        os.close(fd)
        tmp = Path(name)
    try:
        try:
            yield tmp
            for f in (tmp.iterdir() if directory else [tmp]):
                if f.is_file():
                    f.chmod(FILE_MODE)
            if directory and final.is_dir():
                shutil.rmtree(final)
            elif directory and final.exists():  # a file where the directory goes (damage)
                final.unlink()
            os.replace(tmp, final)
        except OSError as e:
            raise _disk_full(e, final) from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()


def _digest(f: Path) -> str:
    """A fingerprint of a file's first and last MiB: cheap, and it sees a file rewritten."""
    h = hashlib.blake2b(digest_size=16)
    with open(f, "rb") as fh:
        h.update(fh.read(2**20))
        fh.seek(max(0, f.stat().st_size - 2**20))
        h.update(fh.read(2**20))
    return h.hexdigest()


def write_manifest(d: Path) -> None:
    """Last file of a generated directory: every other file's size and fingerprint."""
    files = [f for f in sorted(d.iterdir()) if f.is_file() and f.name != MANIFEST]
    manifest = {"files": {f.name: f.stat().st_size for f in files},
                "digests": {f.name: _digest(f) for f in files}}
    (d / MANIFEST).write_text(json.dumps(manifest, indent=1))
    (d / MANIFEST).chmod(FILE_MODE)


def usable(d: Path) -> str | None:
    """The one validity rule of a generated directory: None when it can be used, else why not.
    Its manifest, written last, must list every file with the size and fingerprint it has now.
    A conversion killed half-way left no manifest (or only a temporary, which `collect_stale`
    removes); a file cut short, deleted or rewritten since differs from its line."""
    try:
        manifest = json.loads((d / MANIFEST).read_text())
        sizes, digests = manifest["files"], manifest["digests"]
        assert isinstance(sizes, dict) and isinstance(digests, dict) and set(sizes) == set(digests)
    except FileNotFoundError:
        return "it has no manifest (an interrupted build)"
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return "its manifest is unreadable"
    for name, size in sizes.items():
        f = d / name
        try:
            if f.stat().st_size != size:
                return f"{name} has {f.stat().st_size:,} bytes, not {size:,}"
            if _digest(f) != digests[name]:
                return f"{name} changed since it was written"
        except OSError:
            return f"{name} is missing or unreadable"
    return None


_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


@contextlib.contextmanager
def build_lock(d: Path, name: str):
    """One builder of `name` at a time: across threads (a lock) and processes (flock on a file)."""
    with _thread_locks_guard:
        lock = _thread_locks.setdefault(str(d / name), threading.Lock())
    with lock:
        try:
            import fcntl
        except ImportError:  # not POSIX: threads are still serialized
            yield
            return
        try:
            f = open(d / f".lock-{name}", "a")
        except OSError:  # a read-only cache: nothing can be built there anyway
            yield
            return
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
