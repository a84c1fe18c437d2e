"""What the chapters share, kept beside them and out of the library: the model that produced their
values (one line under each title), TinyLlama-1.1B's exact shapes for the same prompt in one fixed
card (traced on the meta device), prose whose numbers come from code (`say`), the guard for claims
that belong to one model (`runs`), and a function's source on the page (`show_source`).

One model per paragraph, table and plot: the chapters' narrative follows the model that runs;
TinyLlama's shapes appear only in the card that `start_chapter` shows under the banner, the same
card in every chapter (or not at all when TinyLlama itself runs)."""

from __future__ import annotations

import functools
import html
import inspect
from pathlib import Path

import llmtrace
from llmtrace import Trace, load_model, trace_shapes
from llmtrace.model import Model
from llmtrace.load import resolve

PROMPT = "The capital of France is"
EMBEDDED = "smollm2-135m"  # the embedded model's config name
TINYLLAMA = "tinyllama-1.1b"
FULL_NAMES = {EMBEDDED: "SmolLM2-135M-Instruct", TINYLLAMA: "TinyLlama-1.1B"}


@functools.lru_cache(maxsize=1)
def tinyllama_walk(prompt: str = PROMPT) -> tuple[Trace, Trace]:
    """TinyLlama-1.1B on the meta device: (prefill, first decode step), with its real token ids."""
    import torch

    from llmtrace.weights.tokenizer_llama import llama_tokenizer

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
    return (f"Values and shapes on this page: **{model_label(model)}**, "
            f"{model.config.n_layers} layers · "
            f"<a href=\"../book/which_model.html\">which model runs</a>")


def say(text: str) -> None:
    """Prose whose numbers come from the code above it, rendered as Markdown (cells tagged
    `remove-input`, so the book shows only the sentence; nbval checks its text)."""
    from IPython.display import Markdown, display

    display(Markdown(text))


def show_source(*objects) -> None:
    """The library's own source of each function, read from its file when the cell runs, so the
    page shows the very code that produced the tensors beside it (and cannot drift from it)."""
    root = Path(llmtrace.__file__).resolve().parent
    for obj in objects:
        obj = inspect.unwrap(obj)  # past decorators such as torch.inference_mode
        where = Path(inspect.getsourcefile(obj)).resolve().relative_to(root)
        code = inspect.getsource(obj)
        say(f"From `llmtrace/{where}`:\n\n```python\n{code}```")


def tinyllama_card_html(stage: str | list[str], tiny: Trace) -> str:
    """The card: TinyLlama-1.1B's records at this chapter's stage (layer 0 for the layers'
    operations), name, op and exact shape, from the meta-device trace. HTML, so it reads the
    same in the book and in JupyterLab; `<details>`, so it stays out of the way until opened."""
    from llmtrace.trace import _fmt_shape

    globs = [stage] if isinstance(stage, str) else list(stage)
    recs = [r for r in tiny.records
            if any(_glob(r.name, g) for g in globs) and _first_layer(r.name)]
    rows = "".join(f"<tr><td><code>{html.escape(r.name)}</code></td>"
                   f"<td><code>{html.escape(_fmt_shape(r.shape))}</code></td></tr>"
                   for r in recs)
    n = tiny.shape("tokens")[1]
    return (f'<details class="tinyllama-card"><summary>TinyLlama-1.1B at this stage: exact '
            f"shapes for the same prompt ({n} tokens with BOS), traced on the meta device, "
            f"{len(recs)} operations</summary>"
            f'<table><thead><tr><th>name</th><th>shape</th></tr></thead>'
            f"<tbody>{rows}</tbody></table></details>")


def _glob(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "layers.*." + pattern)


def _first_layer(name: str) -> bool:
    return not name.startswith("layers.") or name.startswith("layers.0.")


def start_chapter(stage: str | list[str] | None = None, name: str | None = None
                  ) -> tuple[Model, Trace]:
    """Load the model in force (LLMTRACE_MODEL, default auto), show the one-line banner and, when
    `stage` names this chapter's operations (globs such as "attn.*" or "embed"), the TinyLlama
    card beneath it, unless TinyLlama itself runs. Returns (model, TinyLlama's prefill shape
    trace)."""
    from IPython.display import HTML, display

    model = load_model(resolve(name))
    say(banner_text(model))
    if stage is not None and not runs(model, TINYLLAMA):
        display(HTML(tinyllama_card_html(stage, tinyllama_walk()[0])))
    return model, tinyllama_walk()[0]
