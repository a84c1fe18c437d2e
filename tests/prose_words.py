"""The words a reader meets unfolded in chapters 1-13: the markdown cells' and the markdown
outputs' (the prose `say` prints), without the boxes folded behind a click (`:::{admonition}`
with `:class: dropdown`) or display math. The core path's length, measured the same way at any
commit.

    python tests/prose_words.py [REV]   # the working tree, or the chapters as commit REV has them
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDED = re.compile(r":::\{admonition\}.*?\n:::", re.S)
MATH = re.compile(r"\$\$.*?\$\$", re.S)
WORD = re.compile(r"[A-Za-z][A-Za-z'’-]*")


def words(notebook: dict) -> int:
    texts = []
    for cell in notebook["cells"]:
        if cell["cell_type"] == "markdown":
            texts.append("".join(cell["source"]))
        for out in cell.get("outputs", []):
            texts.append("".join(out.get("data", {}).get("text/markdown", "")))
    return sum(len(WORD.findall(MATH.sub("", FOLDED.sub("", t)))) for t in texts)


def chapter_words(rev: str | None = None) -> dict[str, int]:
    if rev is None:
        names = [p.name for p in (ROOT / "notebooks").glob("*.ipynb")]
    else:  # the chapters as that commit names them (they have been renumbered)
        names = [Path(n).name for n in subprocess.check_output(
            ["git", "ls-tree", "--name-only", rev, "notebooks/"], cwd=ROOT, text=True).split()]
    out = {}
    for name in sorted(n for n in names if re.match(r"[01][0-9]_.*\.ipynb$", n))[:13]:
        text = (ROOT / "notebooks" / name).read_text() if rev is None else subprocess.check_output(
            ["git", "show", f"{rev}:notebooks/{name}"], cwd=ROOT, text=True)
        out[name.removesuffix(".ipynb")] = words(json.loads(text))
    return out


if __name__ == "__main__":
    counts = chapter_words(sys.argv[1] if len(sys.argv) > 1 else None)
    for name, n in counts.items():
        print(f"{name:28} {n:>6,}")
    print(f"{'chapters 1-13':28} {sum(counts.values()):>6,}")
