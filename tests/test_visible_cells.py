"""A chapter's visible cells are a program of their own: a reader who copies them, in order, into
a fresh kernel gets the same run. The book's machinery (the banner, the TinyLlama card, prose from
code, the map, the plots) sits in cells whose code the page hides or folds (tags `remove-input`,
`hide-input`, `remove-cell`, `hide-cell`); what such a cell defines is out of the reader's reach,
so a visible cell must not use it.

Each chapter's visible code cells run here alone, in order, on the tiny random Llama checkpoint
(`tiny_dir`), in the kernel that `test_chapters_any_model` uses for it, its namespace emptied
first."""

from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_notebook

from test_chapters_any_model import NOTEBOOKS, execute

HIDDEN = {"remove-input", "hide-input", "remove-cell", "hide-cell"}


def visible_cells(path: Path) -> list:
    """The code cells of a chapter whose code a reader sees, in order."""
    nb = nbformat.read(path, as_version=4)
    return [c for c in nb.cells
            if c.cell_type == "code" and not HIDDEN & set(c.metadata.get("tags", []))]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_visible_cells_run_alone_in_order(path, tiny_dir, kernels, tmp_path):
    cells = visible_cells(path)
    assert cells, f"{path.name} shows no code"
    alone = tmp_path / path.name
    nbformat.write(new_notebook(cells=cells, metadata={"kernelspec": {
        "name": "python3", "display_name": "Python 3", "language": "python"}}), alone)
    execute(alone, kernels(tiny_dir))  # a NameError names the cell and the missing name
