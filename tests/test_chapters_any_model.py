"""Every chapter executes on any Llama checkpoint, not only the one its outputs were made with.

The book promises that `LLMTRACE_MODEL=<a Llama checkpoint> make book` rebuilds it from that
model's own values. Here every chapter runs, top to bottom, on a tiny random-weight checkpoint in
Hugging Face format with TinyLlama's tokenizer (tests/tiny_checkpoint.py, the session's
`tiny_dir`): claims that belong to one
model must be guarded by `book.runs`, and what holds for every model is still asserted.

The chapters that show the whole machine or attention run on a tiny Gemma 3 checkpoint too: the
family that differs from Llama the most (QK-norm, a norm after each sublayer, scaled embeddings,
GeGLU, local and global layers), so a chapter that expects Llama's names breaks here first.
"""

import json
import shutil
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
# the whole machine and attention: a chapter run costs 10-15 s, so a few only
FAMILY_CHAPTERS = [p for p in NOTEBOOKS if p.stem[:2] in ("01", "06", "13", "16")]


def run_chapter(path, checkpoint, monkeypatch) -> str:
    """Execute a chapter with LLMTRACE_MODEL=checkpoint; the banner's text."""
    monkeypatch.setenv("LLMTRACE_MODEL", str(checkpoint))  # the kernel inherits this environment
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, on any error
    return "".join(o.get("data", {}).get("text/markdown", "")
                   for o in nb.cells[1].get("outputs", []) if nb.cells[1].cell_type == "code")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_chapter_runs_on_a_tiny_random_checkpoint(path, tiny_dir, monkeypatch):
    banner = run_chapter(path, tiny_dir, monkeypatch)
    assert "tiny-llama" in banner, f"{path.name}: the first code cell must name the model that ran"


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory):
    """A tiny random Gemma 3 checkpoint (test_gemma3's: 4 layers, local and global, a window
    of 4) with TinyLlama's tokenizer beside it, as the Llama one has. Its scores are scaled by
    1/sqrt(head_dim), as Gemma-3-270M's are (query_pre_attn_scalar = head_dim): the chapters'
    exercises define attention's scale so."""
    from test_gemma3 import TINY_GEMMA3, make_gemma3_checkpoint

    from llmtrace.weights.tokenizer_llama import build

    d = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3"
    d.mkdir()
    make_gemma3_checkpoint(d, query_pre_attn_scalar=TINY_GEMMA3["head_dim"])
    shutil.copy(build(fetch=False), d / "tokenizer.model")
    (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    return d


@pytest.mark.parametrize("path", FAMILY_CHAPTERS, ids=[p.stem for p in FAMILY_CHAPTERS])
def test_chapter_runs_on_a_tiny_gemma3_checkpoint(path, tiny_gemma3_dir, monkeypatch):
    banner = run_chapter(path, tiny_gemma3_dir, monkeypatch)
    assert "tiny-gemma3" in banner, f"{path.name}: the banner must name the model that ran"


def test_the_family_chapters_exist():
    assert [p.stem[:2] for p in FAMILY_CHAPTERS] == ["01", "06", "13", "16"]
