"""What the chapters share: the model that produced their values (one line under each title),
TinyLlama's exact shapes for the same prompt (traced on the meta device), prose whose numbers come
from code (`say`), and the guard for claims that belong to one model (`runs`)."""

from __future__ import annotations

import functools

from .model import Model, trace_shapes
from .models import load_model, resolve
from .trace import Trace

PROMPT = "The capital of France is"
EMBEDDED = "smollm2-135m"  # the embedded model's config name
TINYLLAMA = "tinyllama-1.1b"
FULL_NAMES = {EMBEDDED: "SmolLM2-135M-Instruct", TINYLLAMA: "TinyLlama-1.1B"}


@functools.lru_cache(maxsize=1)
def tinyllama_walk(prompt: str = PROMPT) -> tuple[Trace, Trace]:
    """TinyLlama-1.1B on the meta device: (prefill, first decode step), with its real token ids."""
    import torch

    from .weights.tokenizer_llama import llama_tokenizer

    ids = torch.tensor([llama_tokenizer().encode(prompt)])  # [1, 6]: BOS + 5
    prefill, decode = trace_shapes(TINYLLAMA, ids, decode_steps=1, label="TinyLlama-1.1B")
    return prefill, decode


def describe(model: Model) -> str:
    c = model.config
    head = "tied to the embedding" if c.tied_lm_head else "untied"
    return (f"{c.name}: {c.n_layers} layers, hidden {c.hidden_size}, {c.n_heads} query / "
            f"{c.n_kv_heads} KV heads of {c.head_dim}, FFN {c.ffn_size}, "
            f"vocabulary {c.vocab_size:,}, LM head {head}")


def model_label(model: Model) -> str:
    """The name a reader knows the running model by: "SmolLM2-135M-Instruct (embedded)"."""
    name = model.config.name
    if name == EMBEDDED:
        return f"{FULL_NAMES[EMBEDDED]} (embedded)"
    return FULL_NAMES.get(name, name)


def runs(model: Model, name: str = EMBEDDED) -> bool:
    """True when the running model is `name`: claims measured on one model are asserted only
    then."""
    return model.config.name == name


def banner_text(model: Model) -> str:
    return (f"Values: **{model_label(model)}**, {model.config.n_layers} layers · "
            f"shapes: **TinyLlama-1.1B**, traced on the meta device · "
            f"<a href=\"../book/which_model.html\">which model runs</a>")


def say(text: str) -> None:
    """Prose whose numbers come from the code above it, rendered as Markdown (cells tagged
    `remove-input`, so the book shows only the sentence; nbval checks its text)."""
    from IPython.display import Markdown, display

    display(Markdown(text))


def show_source(*objects) -> None:
    """The library's own source of each function, read from its file when the cell runs, so the
    page shows the very code that produced the tensors beside it (and cannot drift from it)."""
    import inspect
    from pathlib import Path

    root = Path(__file__).resolve().parent
    for obj in objects:
        obj = inspect.unwrap(obj)  # past decorators such as torch.inference_mode
        where = Path(inspect.getsourcefile(obj)).resolve().relative_to(root)
        code = inspect.getsource(obj)
        say(f"From `llmtrace/{where}`:\n\n```python\n{code}```")


def start_chapter(name: str | None = None) -> tuple[Model, Trace]:
    """Load the model in force (LLMTRACE_MODEL, default auto), show the one-line banner, return
    (model, TinyLlama's prefill shape trace)."""
    model = load_model(resolve(name))
    say(banner_text(model))
    return model, tinyllama_walk()[0]
