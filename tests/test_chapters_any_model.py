"""Every chapter executes on any Llama checkpoint, not only the one its outputs were made with.

The book promises that `LLMTRACE_MODEL=<a Llama checkpoint> make book` rebuilds it from that
model's own values. Here every chapter runs, top to bottom, on a tiny random-weight checkpoint in
Hugging Face format with TinyLlama's tokenizer (tests/tiny_checkpoint.py, the session's
`tiny_dir`): claims that belong to one
model must be guarded by `book.runs`, and what holds for every model is still asserted.
"""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_chapter_runs_on_a_tiny_random_checkpoint(path, tiny_dir, monkeypatch):
    monkeypatch.setenv("LLMTRACE_MODEL", str(tiny_dir))  # the kernel inherits this environment
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
    banner = "".join(o.get("data", {}).get("text/markdown", "") for o in nb.cells[1].get("outputs", [])
                     if nb.cells[1].cell_type == "code")
    assert "tiny-llama" in banner, f"{path.name}: the first code cell must name the model that ran"
