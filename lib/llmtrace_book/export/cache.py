"""The cached export of the embedded model: made once, kept in `$LLMTRACE_CACHE/web/<key>/`.

The key (`cache_key`) changes with the weights, the library's code and the exporter's versions;
`web_dir` finds the export under it or makes it (`web.write_web`), and keeps the newest KEEP
(`_prune`). `place` puts a copy of the page's files (hard links where the disk allows) into a
directory outside the cache, `check_out` refusing one it cannot use before anything is made.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import LlmTraceError
from .manifest import FORMAT, MANIFEST, listed_files, verify
from .web import versions, write_web

KEEP = 2  # exports kept in the cache: the one in use and the one before it


def cache_key() -> str:
    """What the export depends on: the embedded model's file, every source file of the library
    (the graph is the library's own pass, so a change anywhere may change it), and the versions
    of the exporter and of onnxruntime (which measured the tolerance)."""
    from ..disk_cache import _digest
    from ..weights.gguf import embedded_gguf_path

    gguf = embedded_gguf_path()
    h = hashlib.sha256(f"format {FORMAT} {gguf.stat().st_size} {_digest(gguf)}".encode())
    h.update(json.dumps(versions(), sort_keys=True).encode())
    package = Path(__file__).resolve().parents[1]  # llmtrace_book/, this package among it
    for f in sorted(package.rglob("*.py")):
        h.update(f.relative_to(package).as_posix().encode() + b"\0" + f.read_bytes())
    return f"smollm2-135m-{h.hexdigest()[:16]}"


def web_dir(rebuild: bool = False) -> Path:
    """The embedded model's export in the cache, made if it is not there or not `usable`."""
    from ..disk_cache import (atomic_path, build_lock, cache_subdir, check_writable, collect_stale,
                             usable, write_manifest)

    root = cache_subdir("web")
    target = root / cache_key()
    collect_stale(root, target.name)
    if not rebuild and usable(target) is None:
        return target
    with build_lock(root, target.name):
        if rebuild or usable(target) is not None:
            from ..load import load_model
            from ..weights.gguf import EMBEDDED_FILE, embedded_gguf_path, read_blocks

            # at the peak: the fp32 data file and its chunks, the blocks' file and its chunks
            check_writable(root, 1400 * 2**20)
            model = load_model("embedded")
            with atomic_path(target, directory=True) as tmp:
                write_web(model, tmp, label=EMBEDDED_FILE.split(".")[0],
                          blocks=read_blocks(embedded_gguf_path(), model.config))
                write_manifest(tmp)  # last: the disk cache's rule, `usable`
            _prune(root, target)
    return target


def _prune(root: Path, target: Path) -> None:
    """Each change of the library makes a new export of 540 MB: keep the newest KEEP."""
    done = [d for d in root.glob("smollm2-135m-*") if (d / "manifest.json").is_file()]
    done.sort(key=lambda d: (d == target, (d / "manifest.json").stat().st_mtime), reverse=True)
    for old in done[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)
        (root / f".lock-{old.name}").unlink(missing_ok=True)


def manifests(d: Path) -> list[str]:
    """web.json, and the fp32 form's manifest when web.json names another form."""
    web = json.loads((d / MANIFEST).read_text())
    return [MANIFEST] + ([web["fp32"]] if "fp32" in web else [])


def check_out(out: Path, keep: Path) -> None:
    """Before the export is looked up (or made): `out` can take the page's files. Placing them
    replaces `out`, so it must lie apart from `keep` (the cache, which holds the export), and be
    empty or an earlier export; the nearest directory above it that exists must be writable."""
    o, k = out.resolve(), keep.resolve()
    if o == k or k in o.parents or o in k.parents:
        where = "holds" if o in k.parents else "is in"
        raise LlmTraceError(f"--out {out} {where} the cache {keep}, which keeps the export: "
                            f"choose a --out outside it")
    if out.exists() and not (out.is_dir() and (not any(out.iterdir())
                                                or (out / MANIFEST).is_file())):
        raise LlmTraceError(f"{out} exists and holds no export (no {MANIFEST}): "
                            f"choose another --out")
    above = _existing(o.parent)
    if not above.is_dir():
        raise LlmTraceError(f"{above} is a file, not a directory, so --out {out} cannot be "
                            f"made: choose another --out")
    if not os.access(above, os.W_OK | os.X_OK):
        raise LlmTraceError(f"cannot write in {above}, so --out {out} cannot be made: "
                            f"choose a --out in a directory you can write")


def _existing(path: Path) -> Path:
    """The path itself if it exists, else the nearest directory above it that does."""
    while not path.exists():
        path = path.parent
    return path


def place(d: Path, out: Path) -> None:
    """The page's files (not the cache's manifest) into `out`: hard links where the disk allows,
    else copies. They are gathered in a temporary beside `out`, renamed into place at the end, so
    a failure leaves nothing half-written. `out` is replaced if it holds an earlier export."""
    check_out(out, d)
    names = []
    for manifest in manifests(d):
        web = verify(d, manifest)
        files = listed_files(web)
        names += [f["file"] for f in files] + [manifest]
    final = out.resolve()
    above = _existing(final.parent)  # the directories made below it go again if placing fails
    tmp = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}.", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp's 0700: a static host must read it
        for name in dict.fromkeys(names):
            try:
                os.link(d / name, tmp / name)
            except OSError:  # another disk, or links not allowed
                shutil.copyfile(d / name, tmp / name)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for made in [final.parent, *final.parent.parents]:
            if made == above:
                break
            with contextlib.suppress(OSError):
                made.rmdir()
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise LlmTraceError(f"the disk holding {out} is full: free some space, "
                                f"or choose a --out on another disk") from None
        raise LlmTraceError(f"cannot write {out} ({e.strerror or e}): "
                            f"choose a --out in a directory you can write") from None
