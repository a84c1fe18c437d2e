"""What the chapters share, kept beside them and out of the library: the model that produced their
values (one line under each title), TinyLlama-1.1B's exact shapes for the same prompt in one fixed
card (traced on the meta device), prose whose numbers come from code (`say`), the guard for claims
that belong to one model (`runs`), the comparison of a chapter's plain Llama code with the trace
of a model of another family (`check_plain`), a function's source on the page (`show_source`), and
the book's rule for figures (`check_figure`, `readable`).

A chapter's visible cells use only torch and the public library; what is here runs in cells whose
code the page hides (tests/test_visible_cells.py runs the visible cells alone).

One model per paragraph, table and plot: the chapters' narrative follows the model that runs;
TinyLlama's shapes appear only in the card that `start_chapter` shows under the banner, the same
card in every chapter (or not at all when TinyLlama itself runs)."""

from __future__ import annotations

import functools
import html
import inspect
from pathlib import Path

import llmtrace_book
from llmtrace_book import Trace, load_model, trace_shapes
from llmtrace_book.families import SWITCHES as FAMILY_SWITCHES
from llmtrace_book.model import Model
from llmtrace_book.load import resolve

PROMPT = "The capital of France is"
EMBEDDED = "smollm2-135m-instruct"  # the embedded model's config name
TINYLLAMA = "tinyllama-1.1b"
FULL_NAMES = {EMBEDDED: "SmolLM2-135M-Instruct", TINYLLAMA: "TinyLlama-1.1B"}


@functools.lru_cache(maxsize=1)
def tinyllama_walk(prompt: str = PROMPT) -> tuple[Trace, Trace]:
    """TinyLlama-1.1B on the meta device: (prefill, first decode step), with its real token ids."""
    import torch

    from llmtrace_book.weights.tokenizer_llama import llama_tokenizer

    ids = torch.tensor([llama_tokenizer().encode(prompt)])  # [1, 6]: BOS + 5
    prefill, decode = trace_shapes(TINYLLAMA, ids, decode_steps=1, label="TinyLlama-1.1B")
    return prefill, decode


def describe(model: Model) -> str:
    return describe_config(model.config)


def describe_config(c) -> str:
    head = "tied to the embedding" if c.tied_lm_head else "untied"
    return (f"{c.name}: {c.n_layers} layers, hidden {c.hidden_size}, {c.n_heads} query / "
            f"{c.n_kv_heads} KV heads of {c.head_dim}, FFN {c.ffn_size}, "
            f"vocabulary {c.vocab_size:,}, LM head {head}")


def model_label(model: Model, short: bool = False) -> str:
    """The name a reader knows the running model by, for the banner: the embedded model's name
    alone (that its Q4_1 weights run in fp32 is said once, in chapter 1 and on the page "Which
    model runs"), another checkpoint's with the dtype of its weights; `short=True` gives the
    name alone ("SmolLM2-135M-Instruct"), which fits in a sentence."""
    name = model.config.name
    if short:
        return model.label
    if name == EMBEDDED:
        return FULL_NAMES[EMBEDDED]
    return f"{FULL_NAMES.get(name, name)}, weights in {str(model.dtype).removeprefix('torch.')}"


def readable_piece(tokenizer, i: int) -> str:
    """`display_piece`, except for a byte-level piece that is only part of a character (decoded
    alone, it gives the replacement character "\ufffd"): its incomplete bytes are written as
    SentencePiece writes its byte pieces, " <0xD0>" for the first byte of a Cyrillic letter."""
    import codecs

    from llmtrace_book.tokenize import display_piece

    text = display_piece(tokenizer, i)
    if "\ufffd" not in text or tokenizer.kind == "sentencepiece":
        return text
    from exercises.ch02_tokenization import bytes_to_unicode  # GPT-2's byte <-> character

    to_byte = {ch: b for b, ch in bytes_to_unicode().items()}
    raw = bytes(to_byte[ch] for ch in tokenizer.id_to_piece(i))
    codecs.register_error("llmtrace-bytes", lambda e: (
        "".join(f"<0x{b:02X}>" for b in e.object[e.start:e.end]), e.end))
    return raw.decode("utf-8", errors="llmtrace-bytes")


def runs(model: Model, name: str = EMBEDDED) -> bool:
    """True when the running model is `name`: claims measured on one model are asserted only
    then."""
    return model.config.name == name


# Config fields by which another family's stage differs from Llama 2's (chapter 17 shows each):
# the families' switches, and Llama 3's RoPE scaling
SWITCHES = (*FAMILY_SWITCHES, "rope_scaling")


def switches(model: Model, only=SWITCHES) -> list[str]:
    """The switches of `only` that the running model sets: [] for a plain Llama."""
    import dataclasses

    defaults = {f.name: f.default for f in dataclasses.fields(model.config)}
    return [s for s in only if getattr(model.config, s) != defaults[s]]


def plain_llama(model: Model, only=SWITCHES) -> bool:
    """Does the running model compute a stage as the walk's plain PyTorch does? True for a Llama
    2 shaped model; `only` names the switches that change the stage in question."""
    return not switches(model, only)


def check_plain(model: Model, equal: bool, what: str, only=SWITCHES) -> None:
    """The comparison of a chapter's plain Llama code with the running model's trace: asserted
    when the model sets none of the switches `only` names; else one sentence says that this
    stage differs here, and where the book shows how."""
    if plain_llama(model, only):
        assert equal, f"{what}: the plain Llama code does not reproduce {model.label}'s trace"
        return
    names = switches(model, only)
    verb = "changes" if len(names) == 1 else "change"
    say(f"{model.label} is not a plain Llama: {', '.join(f'`{n}`' for n in names)} {verb} "
        f"{what}, so the plain code above does not reproduce its trace here; "
        "[chapter 17](17_todays_models.ipynb) shows each change.")


def measured_on() -> str:
    """The machine and the day a timing on the page was measured: "AMD EPYC (2 CPUs),
    2026-12-01"."""
    import os
    import platform
    import time

    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.is_file() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines
                if line.startswith("model name")), platform.processor() or "a CPU")
    return f"{cpu} ({os.cpu_count()} CPUs), {time.strftime('%Y-%m-%d')}"


def banner_text(model: Model) -> str:
    return (f"Values and shapes on this page: **{model_label(model)}**, "
            f"{model.config.n_layers} layers · "
            f"<a href=\"../book/which_model.html\">which model runs</a>")


def say(text: str) -> None:
    """Prose whose numbers come from the code above it, rendered as Markdown (cells tagged
    `remove-input`, so the book shows only the sentence; nbval checks its text)."""
    from IPython.display import Markdown, display

    display(Markdown(text))


def aside(title: str, text: str) -> None:
    """Like `say`, folded: a side path's prose, computed like the rest, in a dropdown box that
    the walk can skip."""
    say(f":::{{admonition}} {title}\n:class: dropdown\n{text}\n:::")


def folded_source(title: str, note: str, *objects) -> None:
    """The library's source of each object, whole, in a box that opens on a click, under a
    note on what to read in it."""
    import textwrap

    blocks = "".join(f"\n```python\n{textwrap.dedent(inspect.getsource(o))}```\n"
                     for o in objects)
    say(f":::{{admonition}} {title}\n:class: dropdown\n{note}\n{blocks}:::")


def show_source(*objects) -> None:
    """The library's own source of each function or class, read from its file when the cell
    runs, so the page shows the very code that produced the tensors beside it (and cannot drift
    from it), whole."""
    root = Path(llmtrace_book.__file__).resolve().parent
    for obj in objects:
        obj = inspect.unwrap(obj)  # past decorators such as torch.inference_mode
        where = Path(inspect.getsourcefile(obj)).resolve().relative_to(root)
        say(f"From `llmtrace_book/{where}`:\n\n```python\n{inspect.getsource(obj)}```")


def tinyllama_card_html(stage: str | list[str], tiny: Trace, decode: Trace | None = None,
                        decode_stage: str | list[str] | None = None,
                        running: Model | None = None) -> str:
    """The card: TinyLlama-1.1B's records at this chapter's stage (layer 0 for the layers'
    operations), name, operation and exact shape, from the meta-device trace, under a line of
    TinyLlama's config; with `decode`, the records of `decode_stage` in its first decode step
    too. `running`, the model of the page, whose prompt may lack TinyLlama's BOS: the card says
    why the two counts of tokens differ. HTML, so it reads the same in the book and in
    JupyterLab; `<details>`, so it stays one line high until opened."""
    from llmtrace_book import Config

    recs = _card_records(tiny, stage)
    rows = _card_rows(recs)
    c = Config.from_name(TINYLLAMA)
    n = tiny.shape("tokens")[1]
    shape = describe_config(c).split(": ", 1)[1]  # "22 layers, hidden 2048, ..."
    where = (f" Layer 0 shown: its {c.n_layers} layers have the same shapes."
             if any(r.name.startswith("layers.") for r in recs) else "")
    ops = f"operation{'s' * (len(recs) != 1)}{' in the prefill' * (decode_stage is not None)}"
    mine = ""
    if running is not None:
        t_run = running.encode(PROMPT).shape[1]
        if t_run != n:
            mine = f" ({html.escape(running.label)}'s, here, has {t_run}: no BOS)"
    head = ('<table><thead><tr><th>name</th><th>operation</th><th class="shape">shape</th>'
            "</tr></thead><tbody>")
    step = ""
    if decode is not None and decode_stage is not None:
        drecs = _card_records(decode, decode_stage)
        step = (f'<p class="tl-note">Its first decode step: one new position, the cache '
                f"holding {n + 1} (the {n} of the prompt and the new one).</p>"
                f"{head}{_card_rows(drecs)}</tbody></table>")
    return (f'<details class="tinyllama-card"><summary><span class="tl-model">TinyLlama-1.1B'
            f'</span> at this stage: {len(recs)} {ops}, exact shapes</summary>'
            f'<p class="tl-note">From its shape-only trace of the same prompt: {n} tokens, BOS '
            f"first{mine}. {html.escape(shape[0].upper() + shape[1:])}.{where}</p>"
            f"{head}{rows}</tbody></table>{step}</details>")


def _card_records(trace: Trace, stage: str | list[str]) -> list:
    globs = [stage] if isinstance(stage, str) else list(stage)
    return [r for r in trace.records
            if any(_glob(r.name, g) for g in globs) and _first_layer(r.name)]


def _card_rows(recs) -> str:
    from llmtrace_book.trace import _fmt_shape

    return "".join(f"<tr><td><code>{html.escape(r.name)}</code></td>"
                   f"<td>{html.escape(r.op)}</td>"
                   f'<td class="shape"><code>{html.escape(_fmt_shape(r.shape))}</code></td></tr>'
                   for r in recs)


def _glob(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "layers.*." + pattern)


def _first_layer(name: str) -> bool:
    return not name.startswith("layers.") or name.startswith("layers.0.")


# A figure this wide, at matplotlib's 100 dpi, fills the book's column at a 1280 px window with no
# scaling; a wider one is shrunk to fit, and its text with it (12 in wide: to 69%, 10 pt text to
# under 10 px).
COLUMN_INCHES = 8.2
BOOK_STYLE = {
    "figure.dpi": 100,
    "savefig.dpi": 100,
    "font.size": 11,
    "axes.titlesize": 12,
    "axes.labelsize": 11,
    "xtick.labelsize": 10,
    "ytick.labelsize": 10,
    "legend.fontsize": 10,
    "figure.titlesize": 12,
}


SMALLEST_POINTS = 9  # the smallest text a figure may hold


def figure_problems(fig) -> list[str]:
    """What keeps a matplotlib figure from reading well in the book's column, one phrase each:
    wider than `COLUMN_INCHES`; text under `SMALLEST_POINTS`; an axis with tick labels and no
    title; colour that carries a value (an image through a colour map, a mesh, colour-mapped
    points) with no colour bar. [] for a figure that follows the rule."""
    from matplotlib.collections import PathCollection, QuadMesh
    from matplotlib.colors import ListedColormap
    from matplotlib.text import Text

    problems = []
    width = fig.get_size_inches()[0]
    if width > COLUMN_INCHES + 1e-9:
        problems.append(f"{width:.1f} in wide (the column is {COLUMN_INCHES})")
    fig.draw_without_rendering()  # lays out the tick labels, so that they can be read
    small = sorted({f"{t.get_fontsize():.0f} pt {t.get_text()!r}"
                    for t in fig.findobj(Text)
                    if t.get_visible() and t.get_text().strip()
                    and t.get_fontsize() < SMALLEST_POINTS})
    if small:
        problems.append(f"text under {SMALLEST_POINTS} pt: {', '.join(small[:3])}"
                        + (f" and {len(small) - 3} more" if len(small) > 3 else ""))
    bars = [ax for ax in fig.axes if hasattr(ax, "_colorbar")]
    for ax in fig.axes:
        if ax in bars or not ax.axison:
            continue
        name = repr(ax.get_title() or fig.get_suptitle() or "a plot")
        for axis, label in (("x", ax.get_xlabel()), ("y", ax.get_ylabel())):
            if not getattr(ax, f"{axis}axis").get_visible():  # a twin's shared axis
                continue
            ticks = getattr(ax, f"get_{axis}ticklabels")()
            shown = [t for t in ticks if t.get_visible() and t.get_text().strip()]
            if shown and not label.strip():
                problems.append(f"the {axis} axis of {name} has no title")
        # an RGB image shows its colours as they are; a colour map turns values into colours
        # (so does one of a few listed colours, each named in the title or a legend)
        coloured = [im for im in ax.images if im.get_array().ndim == 2
                    and not (isinstance(im.get_cmap(), ListedColormap)
                             and im.get_cmap().N <= 8)]
        coloured += [c for c in ax.collections if isinstance(c, (QuadMesh, PathCollection))
                     and c.get_array() is not None]
        if coloured and not bars:
            problems.append(f"{name} carries values in colour and has no colour bar")
    return problems


def check_figure(fig) -> None:
    """Raise when a figure breaks the book's rule (`figure_problems`)."""
    problems = figure_problems(fig)
    if problems:
        raise llmtrace_book.LlmTraceError("a figure does not fit the book: " + "; ".join(problems)
                                     + ": see BOOK_STYLE and COLUMN_INCHES in notebooks/book.py")


def _checked_show(show):
    """pyplot.show, after `check_figure` on every open figure."""
    import matplotlib.pyplot as plt

    def checked(*args, **kwargs):
        for number in plt.get_fignums():
            check_figure(plt.figure(number))
        return show(*args, **kwargs)

    checked.checks_figures = True
    return checked


def use_book_style() -> None:
    """Matplotlib defaults that stay legible in the book: 100 dpi and no text under 10 pt
    (matplotlib's default figure, 6.4 in wide, fits the column). `start_chapter` applies them; a
    figure that sets its own `figsize` must stay within `COLUMN_INCHES` wide, and its own
    `fontsize` at `SMALLEST_POINTS` or more: `plt.show()` and `show_figure` check every figure
    (`check_figure`) and stop the chapter on one that breaks the rule."""
    import matplotlib as mpl
    import matplotlib.pyplot as plt

    mpl.rcParams.update(BOOK_STYLE)
    if not getattr(plt.show, "checks_figures", False):
        plt.show = _checked_show(plt.show)


def start_chapter(stage: str | list[str] | None = None, name: str | None = None,
                  decode_stage: str | list[str] | None = None) -> tuple[Model, Trace]:
    """Load the model in force (LLMTRACE_MODEL, default auto) and show the one-line banner.
    `stage` names this chapter's operations (globs such as "attn.*" or "embed"), for the
    TinyLlama card that `tinyllama_card` shows where the chapter places it; `decode_stage` adds
    the records of its first decode step. Returns (model, TinyLlama's prefill shape trace)."""
    use_book_style()
    # fp32 on the CPU whatever the checkpoint stores: the chapters' checks are fp32's, and their
    # printed digits must not depend on the machine
    model = load_model(resolve(name), dtype="float32", device="cpu")
    say(banner_text(model))
    prefill, decode = tinyllama_walk()
    _chapter.update(stage=stage, decode_stage=decode_stage, model=model, prefill=prefill,
                    decode=decode)
    return model, prefill


_chapter: dict = {}  # what start_chapter was given and made, for the card


def tinyllama_card() -> None:
    """The TinyLlama card of the stage `start_chapter` was given: one folded line, where the
    chapter puts it (beside its real tensor, or before its summary). Nothing when TinyLlama
    itself runs: the chapter's own records are then TinyLlama's."""
    from IPython.display import HTML, display

    c = _chapter
    if c.get("stage") is None:
        raise ValueError("tinyllama_card: call start_chapter(stage=...) first")
    if not runs(c["model"], TINYLLAMA):
        display(HTML(tinyllama_card_html(c["stage"], c["prefill"], c["decode"],
                                         c["decode_stage"], c["model"])))


# --- interactive figures -------------------------------------------------------------------------

PLOTLY_MIME = "application/vnd.plotly.v1+json"
FIGURE_START, FIGURE_END = "<!-- llmtrace-figure -->", "<!-- /llmtrace-figure -->"
_figures_shown = [0]  # figures shown in this kernel: gives each its own, repeatable, element id


def show_figure(fig, summary: str, static=None) -> None:
    """Show a plotly figure that a reader can explore: hover over it for exact values, move its
    slider or pick from its dropdown.

    - In the HTML book it is drawn by the plotly.js that `make book` copies into `book/_static/`
      (loaded by the page's first figure; nothing is loaded from the network); in JupyterLab by
      plotly's own renderer (the `application/vnd.plotly.v1+json` output).
    - `summary` is one line of plain text that says what the figure shows, with numbers only to
      the digits that survive a change of CPU (it is the figure's caption and alt text in the book,
      and the one part of the output that nbval compares: the figure's JSON is not compared, see
      `notebooks/conftest.py`, and its HTML is sanitized, see `notebooks/sanitize.cfg`).
    - `static` is the picture for print and for viewers that run no JavaScript: a matplotlib
      Figure (drawn to PNG and closed), or None to draw the figure's first state simply with
      matplotlib: one heatmap, lines or bars on one pair of axes. For anything else (subplots,
      other trace types) pass your own: the book's browser check wants every figure to have one.

    Hover: put the tokens in the hover text, e.g. for a [T, T] grid of attention weights `w`:

        import plotly.graph_objects as go
        toks = ["The", " capital", " of", " France", " is"]
        fig = go.Figure(go.Heatmap(
            z=w, x=toks, y=toks, colorscale="Blues", zmin=0, zmax=1,
            hovertemplate="query %{y}<br>key %{x}<br>weight %{z:.4f}<extra></extra>"))
        fig.update_layout(title="Layer 0, head 0: attention weights", height=420,
                          xaxis_title="key (attended to)", yaxis_title="query",
                          yaxis_autorange="reversed")
        show_figure(fig, f"Attention weights of layer 0, head 0 over {len(toks)} tokens.")

    A token can appear twice in a prompt, and plotly merges equal category labels: make the
    labels unique (`[f"{i}:{t}" for i, t in enumerate(toks)]`), or plot positions and put the
    tokens in `customdata` for the hover text (`%{customdata}`).

    A control (a slider over layers or heads): give each step the data it shows and let the step
    `restyle` the trace (no frames needed; works the same in the book and in JupyterLab):

        steps = [dict(label=str(l), method="restyle",
                      args=[{"z": [weights[l][0].tolist()]}, [0]])  # trace 0's z, layer l
                 for l in range(n_layers)]
        fig.update_layout(sliders=[dict(steps=steps, active=0,
                                        currentvalue=dict(prefix="layer "))])

    A dropdown (e.g. over heads) is the same list of steps under
    `updatemenus=[dict(buttons=[dict(label=..., method="restyle", args=[...]), ...])]`; use
    `method="update"` with a second dict to change the title too, and `visible` lists to switch
    between several traces. Keep a figure's data small (at most some tens of thousands of
    numbers): it is stored in the notebook twice (HTML and JSON)."""
    import base64
    import hashlib
    import json

    from IPython.display import display

    readable(fig)
    _figures_shown[0] += 1
    key = f"{_figures_shown[0]}:{summary}".encode()
    div = "llmtrace-fig-" + hashlib.sha1(key).hexdigest()[:12]
    # {"data", "layout", "frames"} through plotly's JSON encoder (numpy arrays as base64)
    spec_json = json.loads(fig.to_json())
    config = {"responsive": True, "displaylogo": False,
              "modeBarButtonsToRemove": ["lasso2d", "select2d"]}
    png = _static_png(fig if static is None else static)
    alt = html.escape(summary, quote=True)
    img = (f'<img class="llmtrace-static" alt="{alt}" '
           f'src="data:image/png;base64,{base64.b64encode(png).decode()}">' if png else "")
    # `<` escaped: the JSON sits in a <script>, where "</script>" or "<!--" would end or hide it
    payload = json.dumps({**spec_json, "config": config}).replace("<", "\\u003c")
    script = (
        "(function () {\n"
        f"  var fig = {payload};\n"
        f"  var id = '{div}';\n"
        "  function draw() {\n"
        "    var el = document.getElementById(id);\n"
        "    window.Plotly.newPlot(el, fig).then(function () {\n"
        "      el.parentNode.classList.add('llmtrace-live');\n"
        "    });\n"
        "  }\n"
        "  if (window.Plotly) { draw(); return; }\n"
        "  /* the book's own copy of plotly.js, loaded once by the page's first figure; outside\n"
        "     the book there is none to load, and the static image stays */\n"
        "  var root = document.documentElement.dataset.content_root;\n"
        "  if (root === undefined) return;\n"
        "  var js = document.getElementById('llmtrace-plotly-js');\n"
        "  if (!js) {\n"
        "    js = document.createElement('script');\n"
        "    js.id = 'llmtrace-plotly-js';\n"
        "    js.src = root + '_static/plotly.min.js';\n"
        "    document.head.appendChild(js);\n"
        "  }\n"
        "  js.addEventListener('load', draw);\n"
        "})();")
    body = (f'<div class="llmtrace-figure">{FIGURE_START}'
            f'<div id="{div}" class="llmtrace-plot" role="img" aria-label="{alt}"></div>{img}'
            f"<script>\n{script}\n</script>{FIGURE_END}"
            f'<p class="llmtrace-figure-summary">{html.escape(summary)}</p></div>')
    display({"text/plain": summary, "text/html": body,
             PLOTLY_MIME: {**spec_json, "config": config}}, raw=True)


PLOTLY_SMALLEST_PX = 12  # plotly sizes text in pixels: 12 px is 9 pt


def readable(fig) -> None:
    """Refuse an interactive figure the book cannot show well (LlmTraceError, naming the axis):
    text under `PLOTLY_SMALLEST_PX`, or an axis that shows tick labels and has no title."""
    def problem(what):
        return llmtrace_book.LlmTraceError(f"the interactive figure {fig.layout.title.text!r}: {what}")

    if (fig.layout.font.size or 12) < PLOTLY_SMALLEST_PX:  # plotly's default is 12 px
        raise problem(f"its font is under {PLOTLY_SMALLEST_PX} px")
    refs = {ref for t in fig.data for ref in (t.xaxis or "x", t.yaxis or "y")}  # "x", "y2"
    for name in sorted(ref[0] + "axis" + ref[1:] for ref in refs):  # "xaxis", "yaxis2"
        axis = fig.layout[name]
        if (axis.tickfont.size or 12) < PLOTLY_SMALLEST_PX:
            raise problem(f"the ticks of its {name} are under {PLOTLY_SMALLEST_PX} px")
        shown = axis.showticklabels is not False and axis.visible is not False
        if shown and not (axis.title.text or "").strip():
            raise problem(f"its {name} has tick labels and no title")


def _static_png(fig) -> bytes | None:
    """PNG bytes of a matplotlib Figure (then closed), or of a plotly figure's first state drawn
    simply with matplotlib (heatmaps, lines and bars); None when there is nothing to draw."""
    import io

    import matplotlib.pyplot as plt
    import numpy as np

    if not hasattr(fig, "savefig"):
        fig = _plotly_to_matplotlib(fig, plt, np)
        if fig is None:
            return None
    check_figure(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _plotly_to_matplotlib(fig, plt, np):
    traces = [t for t in fig.data if t.visible in (None, True)]
    traces = [t for t in traces if t.type in ("heatmap", "scatter", "bar")]
    if not traces:
        return None
    height = (fig.layout.height or 450) / 100
    mfig, ax = plt.subplots(figsize=(8, min(height, 8)))
    for t in traces:
        if t.type == "heatmap":
            z = np.asarray(t.z, dtype=float)
            down = fig.layout.yaxis.autorange == "reversed"  # row 0 at the top
            im = ax.imshow(z, aspect="auto", origin="upper" if down else "lower",
                           cmap="Blues" if np.nanmin(z) >= 0 else "RdBu_r",
                           vmin=t.zmin, vmax=t.zmax)
            mfig.colorbar(im, ax=ax)
            for labels, ticks in ((t.x, ax.set_xticks), (t.y, ax.set_yticks)):
                if labels is not None and len(labels) <= 40:
                    ticks(range(len(labels)), [str(s) for s in labels])
            if t.x is not None and len(t.x) <= 40:
                plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
        elif t.type == "scatter":
            x = t.x if t.x is not None else np.arange(len(t.y))
            ax.plot(x, t.y, marker="o" if t.mode and "markers" in t.mode else None,
                    label=t.name)
        else:
            x = t.x if t.x is not None else np.arange(len(t.y))
            ax.bar([str(v) for v in x] if x is not None else x, t.y, label=t.name)
    if any(t.name for t in traces if t.type != "heatmap"):
        ax.legend()
    title = fig.layout.title.text
    if title:
        ax.set_title(title)
    ax.set_xlabel(fig.layout.xaxis.title.text or "")
    ax.set_ylabel(fig.layout.yaxis.title.text or "")
    for axis, scale, limits in ((fig.layout.xaxis, ax.set_xscale, ax.set_xlim),
                                (fig.layout.yaxis, ax.set_yscale, ax.set_ylim)):
        if axis.type == "log":  # as plotly draws it; its range is in powers of ten
            scale("log")
            if axis.range is not None:
                limits(*(10.0 ** r for r in axis.range))
    if fig.layout.yaxis.autorange == "reversed" and not any(t.type == "heatmap" for t in traces):
        ax.invert_yaxis()
    mfig.tight_layout()
    return mfig


def show_lines(fn, first: str, last: str | None = None) -> None:
    """The few lines of a library function that a switch adds: from the first line that holds
    `first` up to, not including, the next line that holds `last` (to the function's end without
    it), read from the file when the cell runs, with their line numbers there."""
    import textwrap

    obj = inspect.unwrap(fn)
    root = Path(llmtrace_book.__file__).resolve().parent
    where = Path(inspect.getsourcefile(obj)).resolve().relative_to(root)
    lines, top = inspect.getsourcelines(obj)
    i = next((k for k, line in enumerate(lines) if first in line), None)
    if i is None:
        raise llmtrace_book.LlmTraceError(f"{first!r} is not in {obj.__name__}'s source: "
                                     f"give a text one of its lines holds")
    j = next((k for k in range(i + 1, len(lines)) if last and last in lines[k]), len(lines))
    while j > i + 1 and not lines[j - 1].strip():  # no blank lines at the end
        j -= 1
    code = textwrap.dedent("".join(lines[i:j]))
    say(f"From `llmtrace_book/{where}`, lines {top + i}-{top + j - 1} of `{obj.__name__}`:"
        f"\n\n```python\n{code}```")
