"""Every chapter executes on any Llama checkpoint, not only the one its outputs were made with.

The book promises that `LLMTRACE_MODEL=<a Llama checkpoint> make book` rebuilds it from that
model's own values. Here every chapter runs, top to bottom, on a tiny random-weight checkpoint in
Hugging Face format with TinyLlama's tokenizer (tests/tiny_checkpoint.py, the session's
`tiny_dir`): claims that belong to one
model must be guarded by `book.runs`, and what holds for every model is still asserted.

The chapters that show the whole machine or attention run on a tiny Gemma 3 checkpoint too: the
family that differs from Llama the most (QK-norm, a norm after each sublayer, scaled embeddings,
GeGLU, local and global layers), so a chapter that expects Llama's names breaks here first.

The chapters of one checkpoint share a kernel: before each, `%reset -f` empties its namespace, so a
chapter that uses a name it does not define itself still fails, while torch, matplotlib and the
meta device's first trace are paid once, not twenty times (about 7 s of a chapter's 9 to 17 on
this machine). What a chapter changes in the process itself (torch's global seed, matplotlib's
settings) does carry over to the next; nbval runs each chapter in a fresh kernel of its own.
"""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError
from nbformat.v4 import new_code_cell, new_notebook

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# the whole machine and attention, and the appendix on the families
FAMILY_CHAPTERS = [p for p in NOTEBOOKS if p.stem[:2] in ("01", "06", "13", "17")]


def execute(path, kernel):
    """Execute a notebook, from an empty namespace, in a kernel of `kernels`."""
    km, kc = kernel
    reply = kc.execute_interactive("%reset -f", timeout=60)
    assert reply["content"]["status"] == "ok", reply["content"]
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, km=km, timeout=300)
    client.kc = kc
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
    return nb


def run_chapter(path, kernel) -> str:
    """Execute a chapter; the banner's text."""
    nb = execute(path, kernel)
    return "".join(o.get("data", {}).get("text/markdown", "")
                   for o in nb.cells[1].get("outputs", []) if nb.cells[1].cell_type == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_chapter_runs_on_a_tiny_random_checkpoint(path, tiny_dir, kernels):
    banner = run_chapter(path, kernels(tiny_dir))
    assert "tiny-llama" in banner, f"{path.name}: the first code cell must name the model that ran"


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory):
    """A tiny random Gemma 3 checkpoint (test_gemma3's: 4 layers, local and global, a window
    of 4) with TinyLlama's tokenizer beside it, as the Llama one has. Its scores are scaled by
    1/sqrt(head_dim), as Gemma-3-270M's are (query_pre_attn_scalar = head_dim): the chapters'
    exercises define attention's scale so."""
    from tiny_checkpoint import ROWS, make_tiny_checkpoint

    head_dim = ROWS["gemma3_text"].config["head_dim"]
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3") / "tiny-gemma3",
                                family="gemma3_text", query_pre_attn_scalar=head_dim)


@pytest.mark.parametrize("path", FAMILY_CHAPTERS, ids=[p.stem for p in FAMILY_CHAPTERS])
def test_chapter_runs_on_a_tiny_gemma3_checkpoint(path, tiny_gemma3_dir, kernels):
    banner = run_chapter(path, kernels(tiny_gemma3_dir))
    assert "tiny-gemma3" in banner, f"{path.name}: the banner must name the model that ran"


def test_the_family_chapters_exist():
    assert [p.stem[:2] for p in FAMILY_CHAPTERS] == ["01", "06", "13", "17"]


def test_a_chapter_starts_from_an_empty_namespace(tmp_path, tiny_gemma3_dir, kernels):
    """The shared kernel lends a chapter nothing: what an earlier one imported or defined is
    gone before the next begins."""
    first, second, third = (tmp_path / f"{n}.ipynb" for n in ("first", "second", "third"))
    nbformat.write(new_notebook(cells=[new_code_cell("import torch\nleft = torch.ones(1)")]), first)
    nbformat.write(new_notebook(cells=[new_code_cell("torch.ones(1)")]), second)
    nbformat.write(new_notebook(cells=[new_code_cell("left")]), third)
    kernel = kernels(tiny_gemma3_dir)
    execute(first, kernel)
    with pytest.raises(CellExecutionError, match="name 'torch' is not defined"):
        execute(second, kernel)
    execute(first, kernel)
    with pytest.raises(CellExecutionError, match="name 'left' is not defined"):
        execute(third, kernel)
