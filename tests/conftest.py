"""Fixtures built once per test run: the embedded model, its traced prompt, TinyLlama on the meta
device, HF's reference model, and the tiny random checkpoint (a directory, `tiny_dir`, and the
model loaded from it, `tiny`), and the Jupyter kernels the chapters run in on such checkpoints
(`kernels`)."""

import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

# the book's exercises live beside the chapters (notebooks/exercises): `from exercises import check`
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))

from helpers import PROMPT  # noqa: E402
from jupyter_client.manager import start_new_kernel  # noqa: E402
from llmtrace_book import load_model, meta_model  # noqa: E402

# One intra-op thread unless OMP_NUM_THREADS says otherwise. The tests run tensors of a few tokens,
# where a second thread saves nothing and, on a busy machine, spins while it waits for the other:
# measured on this 2-core machine under load, one embedded forward pass took 3.4 s of CPU with two
# threads and 0.2 s with one. `make test` runs two workers at once, the chapters' kernels on one
# thread each too (OMP_NUM_THREADS=1); `make test-variants` checks them on the default threads.
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def pytest_xdist_make_scheduler(config, log):
    """Under `pytest -n 2 --dist loadscope` (make test) a worker takes a whole scope: a test module,
    or a notebook, whose cells must share one kernel. The chapters' runs on the tiny Llama
    checkpoint make two scopes (even and odd chapters), so the two workers share them; the
    chapters of one scope run in one kernel (test_chapters_any_model.py). The runs of the
    chapters' visible cells alone (test_visible_cells.py) are split the same way."""
    from xdist.scheduler import LoadScopeScheduling

    class ChaptersApart(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            chapter = re.search(r"test_(?:chapters_any_model|visible_cells).py::(\w+)\[(\d\d)_",
                                nodeid)
            if chapter and ("random" in chapter[1] or "visible" in chapter[1]):
                return f"{chapter[1]}-{int(chapter[2]) % 2}"
            return super()._split_scope(nodeid)

    return ChaptersApart(config, log)


@pytest.fixture(scope="session")
def embedded():
    return load_model("embedded")


@pytest.fixture(scope="session")
def prompt_trace(embedded):
    """One traced prefill of the prompt on the embedded model: (logits, trace)."""
    return embedded.run(PROMPT)


@pytest.fixture(scope="session")
def tiny_meta():
    return meta_model("tinyllama-1.1b")


@pytest.fixture(scope="session")
def hf_reference(embedded):
    """HF transformers' LlamaForCausalLM, eager attention, on the same fp32 weights."""
    from bench.reference import hf_reference

    return hf_reference(embedded, "eager")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The tiny random Llama checkpoint in HF format (2 layers, hidden 64, GQA 4/2), made by
    HF once per run. Tests that break it take `ckpt`, a copy."""
    from tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """The model loaded from `tiny_dir` (by Path, as load_model's docstring promises)."""
    return load_model(Path(tiny_dir))


@pytest.fixture
def ckpt(tiny_dir, tmp_path):
    """A copy of the tiny checkpoint this test may break."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "ckpt"))


@pytest.fixture(scope="session")
def llama_tok():
    from llmtrace_book.weights.tokenizer_llama import llama_tokenizer

    return llama_tokenizer()


@pytest.fixture(scope="session")
def kernels():
    """One Jupyter kernel per checkpoint, in notebooks/, started on first use with LLMTRACE_MODEL
    set to it."""
    started = {}

    def kernel(checkpoint):
        if checkpoint not in started:
            env = {**os.environ, "LLMTRACE_MODEL": str(checkpoint)}
            started[checkpoint] = start_new_kernel(kernel_name="python3", env=env,
                                                   cwd=str(NOTEBOOKS))
        return started[checkpoint]

    yield kernel
    for km, kc in started.values():
        kc.stop_channels()
        km.shutdown_kernel(now=True)
