"""`python -m llmtrace_book.export [--out DIR]`: makes the page's files (or finds them made in the
cache) and prints where they are; with --out, also places them there. Errors are one line, exit
status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import LlmTraceError
from .cache import check_out, place, web_dir
from .manifest import MANIFEST

# the --help's description: the package's first line
DESCRIPTION = ("The forward pass exported to ONNX, for the page that runs it in the reader's "
               "browser.")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage and exits; here: one line, exit status 2
        raise LlmTraceError(f"{message}: see python -m llmtrace_book.export --help")


def main(argv=None) -> int:
    from ..disk_cache import cache_dir

    p = _Parser(prog="python -m llmtrace_book.export", description=DESCRIPTION)
    p.add_argument("--out", default=None,
                   help="also put the page's files into this directory (hard links if possible; "
                        "outside the cache; an earlier export there is replaced)")
    p.add_argument("--rebuild", action="store_true", help="export again even if cached")
    try:
        args = p.parse_args(argv)
        if args.out is not None:
            if not args.out.strip():  # Path("") would be the current directory
                raise LlmTraceError("--out is empty: name a directory, e.g. --out site/web")
            args.out = Path(args.out)
            check_out(args.out, cache_dir())  # before a minute's export, not after it
        d = web_dir(rebuild=args.rebuild)
        if args.out is not None:
            place(d, args.out)
    except LlmTraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    web = json.loads((d / MANIFEST).read_text())
    size = web["graph"]["size"] + sum(c["size"] for c in web["chunks"])
    print(f"{d}: {web['model']} ({web['weights']}), {len(web['records'])} records, "
          f"{len(web['chunks'])} chunks, {size / 1e6:,.0f} MB"
          + (f"; placed in {args.out}" if args.out is not None else ""))
    return 0
