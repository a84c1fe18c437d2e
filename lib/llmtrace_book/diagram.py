"""A map of the machine, drawn from a trace. Three drawings: the map by stages (`stage_dot`), a
screen high, each stage's operations named on hover; the full map (`machine_dot`), the whole
forward pass beside one block with every operation and every edge labelled with the shape of the
tensor that flows along it; and the compact map (`compact_dot`), a chapter's own stage lit up.

The map is Graphviz's DOT text built from the trace's records, so its shapes are the trace's
shapes: from TinyLlama's meta-device trace they are TinyLlama's, exactly. `dot` (Debian's or any
other graphviz package) renders it as SVG, which the book embeds as a vector image.
"""

from __future__ import annotations

import fnmatch
import functools
import shutil
import subprocess

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .config import Config
from .errors import LlmTraceError
from .model import one_layer_of_each_kind
from .trace import Trace, _fmt_shape

RESIDUAL = {("x", "resid_mid"), ("resid_mid", "resid_out")}  # the skip connections


class _Flow(TorchFunctionMode):
    """While active, which recorded tensors each tensor an operation makes derives from (an
    in-place write, as the KV cache's, passes its sources on to the tensor written into)."""

    def __init__(self):
        super().__init__()
        self.came_from: dict[int, tuple] = {}  # id(tensor) -> names of the records it comes from
        self.alive: list = []  # every tensor seen, so that no id is reused during the pass

    def mark(self, t, names: tuple) -> None:
        self.came_from[id(t)] = names
        self.alive.append(t)

    def sources(self, values) -> tuple:
        tensors = [t for t in tree_leaves(values) if isinstance(t, torch.Tensor)]
        return tuple(dict.fromkeys(n for t in tensors for n in self.came_from.get(id(t), ())))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        came = self.sources((args, kwargs))
        name = getattr(func, "__name__", "")
        if name == "__setitem__" or name.endswith("_") and not name.startswith("__"):
            self.mark(args[0], came)  # written in place
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.mark(t, came)
        return out


class _FlowTrace(Trace):
    """A shapes-only trace that notes, for each record, the records its tensor derives from."""

    def __init__(self, flow: _Flow):
        super().__init__(keep_values=False)
        self.flow, self.edges = flow, []

    def record(self, name, op, tensor, macs=0, recompute=None):
        self.edges += [(src, name) for src in self.flow.came_from.get(id(tensor), ())]
        self.flow.mark(tensor, (name,))
        return super().record(name, op, tensor, macs, recompute)


@functools.lru_cache(maxsize=32)
def block_flow(config: Config) -> tuple[tuple[str, str], ...]:
    """Layer 0's data flow as the forward pass computes it: (source, record) pairs of names
    within the layer, "x" for the block's input (the embedding for layer 0), in the order the
    records were made. Found by running one layer of each kind on the meta device and following
    which recorded tensors each recorded tensor derives from: whatever a family records is on
    the map, with the edges its code gives it."""
    one, _ = one_layer_of_each_kind(config)  # its layer 0 is of layer 0's kind
    with _Flow() as flow:
        trace = _FlowTrace(flow)
        one.forward(torch.zeros(1, 2, dtype=torch.long), trace, one.new_cache(2))

    def within(name: str) -> str | None:
        return name[len("layers.0."):] if name.startswith("layers.0.") else None

    edges = []
    for src, dst in trace.edges:
        if within(dst) is not None:
            edges.append(("x" if within(src) is None else within(src), within(dst)))
    return tuple(dict.fromkeys(edges))


def _block_edges(trace) -> tuple[tuple[str, str], ...]:
    config = getattr(trace, "config", None)
    if config is None:
        raise LlmTraceError("the trace does not say which model made it: map the trace of a "
                            "forward pass (model.run or trace_shapes)")
    return block_flow(config)


def _block_input(trace) -> str:
    """The record the block's input comes from: the embedding, scaled if the family scales it."""
    return "embed.scaled" if "embed.scaled" in trace else "embed"


# The whole pass: stage -> (what the node says, the record whose shape leaves it)
PASS = [
    ("prompt", "text", None),
    ("tokens", "token ids", "tokens"),
    ("embed", "embedding", "embed"),
    ("blocks", "{L} blocks", "layers.{last}.resid_out"),
    ("final_norm", "final RMSNorm", "final_norm"),
    ("lm_head", "LM head", "lm_head"),
    ("last", "last logits", None),
    ("sample", "temperature, top-k, top-p, draw", None),
    ("token", "next token", None),
]

LIT = 'style="filled,bold" fillcolor="#ffd54f" color="#e65100"'
PLAIN = 'style="filled" fillcolor="#f5f5f5" color="#9e9e9e"'


def _dot_text(text: str) -> str:
    """Text for a quoted DOT string: backslashes and quotes escaped, one line."""
    return str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")


def _lit(name: str, highlight) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in highlight)


def machine_dot(trace, highlight: str | list[str] = (), title: str = "") -> str:
    """DOT text of the map for a prefill trace (any config, meta or real). `highlight` is a glob
    or a list of globs on the names of one block ("attn.rope_*", "mlp.*") or of the whole pass
    ("embed", "lm_head", "sample", "blocks"): the chapter's "you are here"."""
    highlight = [highlight] if isinstance(highlight, str) else list(highlight or ())
    layers = sorted({int(r.name.split(".")[1]) for r in trace if r.name.startswith("layers.")})
    if not layers:
        raise LlmTraceError("the trace holds no layers: map a forward pass's trace (model.run)")
    L, V = len(layers), trace.shape("lm_head")[-1]
    edges = _block_edges(trace)
    block_lit = any(_lit(a, highlight) or _lit(b, highlight) for a, b in edges)

    out = ['digraph machine {', '  rankdir=TB; nodesep=0.25; ranksep=0.32;',
           '  node [shape=box fontname="Helvetica" fontsize=11 margin="0.12,0.04" height=0.3];',
           '  edge [fontname="Courier" fontsize=9 color="#616161" fontcolor="#37474f"];']
    if title:
        out.append(f'  label="{_dot_text(title)}"; labelloc=t; fontname="Helvetica"; fontsize=13;')

    # the whole pass, top to bottom
    out.append('  subgraph cluster_pass { label="the whole pass"; fontname="Helvetica"; '
               'color="#bdbdbd";')
    for key, text, _ in PASS:
        lit = _lit(key, highlight) or (key == "blocks" and block_lit)
        out.append(f'    "p.{key}" [label="{text.format(L=L)}" {LIT if lit else PLAIN}];')
    for (a, _, rec), (b, _, _) in zip(PASS, PASS[1:]):
        label = {"prompt": "text", "last": f"[{V}]", "sample": "one id"}.get(a) \
            or _fmt_shape(trace.shape(rec.format(last=layers[-1])))
        out.append(f'    "p.{a}" -> "p.{b}" [label=" {label}"];')
    out.append('  }')

    # one block, layer 0: every record, every edge labelled with its tensor's shape
    out.append(f'  subgraph cluster_block {{ label="one block (layer 0 of {L})"; '
               f'fontname="Helvetica"; color="#bdbdbd"; ordering=out;')
    nodes = list(dict.fromkeys(n for edge in edges for n in edge))  # in data-flow order
    for n in nodes:
        label = "block input x" if n == "x" else n
        tip = "the block's input" if n == "x" else _tip([trace.get(f"layers.0.{n}")])
        out.append(f'    "b.{n}" [label="{label}" {LIT if _lit(n, highlight) else PLAIN} '
                   f'tooltip="{tip}"];')
    for a, b in edges:
        src = _block_input(trace) if a == "x" else f"layers.0.{a}"
        style = ' style="dashed"' if (a, b) in RESIDUAL else ""
        out.append(f'    "b.{a}" -> "b.{b}" [label=" {_fmt_shape(trace.shape(src))}"{style}];')
    out.append('  }')
    out.append('  "p.blocks" -> "b.x" [style=dotted arrowhead=none color="#bdbdbd"];')
    out.append('}')
    return "\n".join(out)


# The compact map draws one block as a row of steps (attention, then the MLP), each step a group
# of the block's records.
ATTN_STEPS = [
    ("attn_norm", "RMSNorm", ["attn_norm"]),
    ("qkv", "q, k, v", ["attn.q_proj", "attn.k_proj", "attn.v_proj",
                        "attn.q", "attn.k", "attn.v"]),
    ("rope", "RoPE", ["attn.rope_q", "attn.rope_k"]),
    ("cache", "KV cache\\nGQA", ["attn.kv_cache.k", "attn.kv_cache.v",
                                "attn.k_expanded", "attn.v_expanded"]),
    ("scores", "scores\\nmask", ["attn.scores", "attn.causal_mask", "attn.masked_scores"]),
    ("softmax", "softmax", ["attn.weights"]),
    ("mix", "mix\\nout", ["attn.weighted_sum", "attn.merged", "attn.out"]),
    ("resid_mid", "+", ["resid_mid"]),
]
MLP_STEPS = [
    ("mlp_norm", "RMSNorm", ["mlp_norm"]),
    ("mlp", "SwiGLU\\nMLP", ["mlp.gate", "mlp.up", "mlp.act", "mlp.gated", "mlp.down",
                           # a mixture of experts (moe.py) in its place
                           "mlp.router", "mlp.experts_chosen", "mlp.expert_weights",
                           "mlp.expert_out", "mlp.out"]),
    ("resid_out", "+", ["resid_out"]),
]


def _steps(trace) -> tuple[list, list]:
    """ATTN_STEPS and MLP_STEPS with every other record of the block in a step: the step of the
    record it is computed from (Qwen2's q_bias joins q, k, v), else of the one it feeds (a
    window mask joins the scores)."""
    edges = _block_edges(trace)
    recorded = {n for edge in edges for n in edge} - {"x"}
    group = {n: key for key, _, names in ATTN_STEPS + MLP_STEPS for n in names if n in recorded}
    for a, b in edges + tuple((b, a) for a, b in edges):  # sources first, then consumers
        if b not in group and a in group and b != "x":
            group[b] = group[a]
    steps = [[(key, text, [n for n, k in group.items() if k == key]) for key, text, _ in part]
             for part in (ATTN_STEPS, MLP_STEPS)]
    return tuple([step for step in part if step[2]] for part in steps)  # OLMo 2: no pre-norm


SHORT_PASS = {"prompt": "text", "tokens": "tokens", "embed": "embedding",
              "final_norm": "final RMSNorm", "lm_head": "LM head", "last": "last logits",
              "sample": "sample", "token": "next token"}


def compact_dot(trace, highlight: str | list[str] = (), title: str = "") -> str:
    """DOT text of the compact map, a few lines high: the whole pass in one row and, when the
    stage is inside a block, the block's steps in a row beneath it (attention, then the MLP, the
    residual connections dashed above), the chapter's stage lit. Each lit step in the pass shows
    its output's shape. Each row is a rank of its own, so that neither row's widths space the
    other's and no line crosses another."""
    highlight = [highlight] if isinstance(highlight, str) else list(highlight or ())
    layers = sorted({int(r.name.split(".")[1]) for r in trace if r.name.startswith("layers.")})
    if not layers:
        raise LlmTraceError("the trace holds no layers: map a forward pass's trace (model.run)")
    L = len(layers)
    attn_steps, mlp_steps = _steps(trace)
    block_lit = any(_lit(n, highlight) for _, _, names in attn_steps + mlp_steps
                    for n in names)

    out = ['digraph machine {', '  rankdir=TB; nodesep=0.14; ranksep=0.3;',
           '  node [shape=box fontname="Helvetica" fontsize=11 margin="0.06,0.03" height=0.28 '
           'width=0.3];',
           '  edge [color="#616161" arrowsize=0.6];']
    if title:
        out.append(f'  label="{_dot_text(title)}"; labelloc=t; fontname="Helvetica"; fontsize=13;')
    loop = _lit("token", highlight)  # the decode loop: the token goes back in, arcing above
    label = ('the whole pass; dashed: the next token is appended, and the pass runs again'
             '"; labelloc="b' if loop else "the whole pass")
    out.append(f'  subgraph cluster_pass {{ label="{label}"; fontname="Helvetica"; '
               'fontsize=10; peripheries=0;')  # no frames: the dashed arcs would cross them
    for key, _, rec in PASS:
        lit = _lit(key, highlight) or (key == "blocks" and block_lit)
        label = f"{L} blocks" if key == "blocks" else SHORT_PASS[key]
        if lit and rec and key != "blocks":
            label += "\\n" + _fmt_shape(trace.shape(rec))
        out.append(f'    "p.{key}" [label="{label}" {LIT if lit else PLAIN}];')
    out.append("    {rank=same; " + " ".join(f'"p.{key}";' for key, _, _ in PASS) + "}")
    out.append("    " + " -> ".join(f'"p.{key}"' for key, _, _ in PASS) + ";")
    if loop:
        out.append('    "p.tokens" -> "p.token" [dir=back style=dashed];')
    out.append('  }')
    if block_lit:  # the block's row, beneath the pass
        out.append(f'  subgraph cluster_block {{ label="one block of {L}, the dashed lines its '
                   'residual connections"; fontname="Helvetica"; fontsize=10; peripheries=0; '
                   'labelloc=b;')
        steps = attn_steps + mlp_steps
        out.append('    "b.x" [shape=point width=0.06 label=""];')
        for key, text, names in steps:
            lit = any(_lit(n, highlight) for n in names)
            circle = " shape=circle width=0.22 margin=0 fixedsize=true" if text == "+" else ""
            out.append(f'    "b.{key}" [label="{text}"{circle} {LIT if lit else PLAIN}];')
        out.append('    {rank=same; "b.x"; ' + " ".join(f'"b.{k}";' for k, _, _ in steps) + "}")
        out.append(f'    "b.x" -> "b.{steps[0][0]}" [arrowhead=none];')
        out.append("    " + " -> ".join(f'"b.{key}"' for key, _, _ in steps) + ";")
        # the block's input, and the two skips that add it back (dashed)
        keys = {key for key, _, _ in steps}
        for a, b in (("x", "resid_mid"), ("resid_mid", "resid_out")):
            if b in keys and (a == "x" or a in keys):
                out.append(f'    "b.{a}" -> "b.{b}" [style=dashed];')
        out.append('  }')
        out.append('  "p.prompt" -> "b.x" [style=invis];  # the block\'s row beneath, from the left')
    out.append('}')
    return "\n".join(out)


# The map by stages: the names a reader of the first chapter has met, one row for the block.
STAGES = [  # (key, label): the pass, around the blocks (between embed and final_norm)
    ("prompt", "text"), ("tokens", "tokens"), ("embed", "embedding"),
    ("final_norm", "final RMSNorm"), ("lm_head", "LM head"), ("last", "last logits"),
    ("sample", "sample"), ("token", "next token"),
]
BLOCK_STAGES = [("attn_norm", "RMSNorm"), ("attn", "attention"), ("resid_mid", "+"),
                ("mlp_norm", "RMSNorm"), ("mlp", "FFN"), ("resid_out", "+")]
STAGE_TIPS = {
    "prompt": "the prompt, a string",
    "last": "the logits of the last position: the scores of the token that comes next",
    "sample": "pick one id from the last position's probabilities (chapter 10)",
    "token": "the next token, appended to the text; the model then runs again (chapter 11)",
    "x": "x, the block's input: the embedding for block 0, then each block's output",
    "residual": "the residual connection: the input is added to what the half computed",
}


def _stage_of(name: str, keys: list[str]) -> str | None:
    """The stage whose key is the name or the start of it (the norms before the rest)."""
    for key in sorted(keys, key=len, reverse=True):
        if name == key or name.startswith(key + ".") or \
                key in ("attn", "mlp") and name.startswith(key):
            return key
    return None


def stage_groups(trace) -> tuple[list, list]:
    """The records of each stage of the map by stages: (key, label, records) for the whole pass
    (the prompt, the sampling and the next token hold none) and for one block, layer 0's. A
    record whose name starts no stage's (Gemma 4's per-layer embeddings) joins the stage of the
    record before it, so every record of the pass and of layer 0 is in exactly one stage."""
    outer = [r for r in trace if not r.name.startswith("layers.")]
    inner = trace.layer(0)
    if not inner:
        raise LlmTraceError("the trace holds no layers: map a forward pass's trace (model.run)")
    groups = []
    for records, stages, cut in ((outer, STAGES, 0), (inner, BLOCK_STAGES, len("layers.0."))):
        keys = [k for k, _ in stages]
        held: dict[str, list] = {k: [] for k in keys}
        last = keys[1]  # tokens; attention (a record before any named one)
        for r in records:
            last = _stage_of(r.name[cut:], keys) or last
            held[last].append(r)
        groups.append([(k, text, held[k]) for k, text in stages])
    block = [g for g in groups[1] if g[2] or g[0] not in ("attn_norm", "mlp_norm")]
    return groups[0], block  # OLMo 2: no norm before each half


def _tip(records) -> str:
    """A tooltip: each record's name, operation and shape, one a line."""
    return "\\n".join(_dot_text(f"{r.name}: {r.op} {_fmt_shape(r.shape)}") for r in records)


def _two_lines(text: str, small: str) -> str:
    """An HTML-like DOT label: the stage's name over its output's shape, in small type."""
    import html

    return (f'<{html.escape(text)}<BR/><FONT FACE="Courier" POINT-SIZE="9" COLOR="#37474f">'
            f'{html.escape(small)}</FONT>>')


def stage_dot(trace, title: str = "") -> str:
    """DOT text of the map by stages, a screen high: the pass top to bottom, the block as one row
    of its stages (RMSNorm, attention, +, RMSNorm, FFN, +) with the residual connections dashed,
    each stage of the pass over the shape it hands on. Each node's tooltip lists the records it
    holds (`stage_groups`), which `machine_map` makes its SVG <title>, shown on hover."""
    outer, block = stage_groups(trace)
    L = len({int(r.name.split(".")[1]) for r in trace if r.name.startswith("layers.")})
    V = trace.shape("lm_head")[-1]
    stream = _fmt_shape(trace.shape(f"layers.{L - 1}.resid_out"))
    small = {"tokens": "tokens", "embed": "embed", "final_norm": "final_norm",
             "lm_head": "lm_head"}
    out = [f'digraph machine {{ tooltip="{_dot_text("the machine, by stages: hover a stage")}";',
           '  rankdir=TB; nodesep=0.25; ranksep=0.3;',
           '  node [shape=box fontname="Helvetica" fontsize=11 margin="0.1,0.03" height=0.3 '
           f'{PLAIN}];',
           '  edge [color="#616161" arrowsize=0.7];']
    if title:
        out.append(f'  label="{_dot_text(title)}"; labelloc=t; fontname="Helvetica"; fontsize=13;')
    for key, text, records in outer:
        shape = (_fmt_shape(trace.shape(small[key])) if key in small else
                 f"[{V}]" if key == "last" else "one id" if key == "sample" else "")
        label = _two_lines(text, shape) if shape else f'"{text}"'
        tip = _tip(records) if records else _dot_text(STAGE_TIPS[key])
        out.append(f'  "p.{key}" [label={label} tooltip="{tip}"];')
    tip = f"{L} blocks, one after the other: hover a stage for block 0's operations"
    label = (f"× {L} blocks: the same in shape, each with its own weights; {stream} in and out."
             "\\nThe bold line is the residual stream: each half reads it and adds into it.")
    out.append(f'  subgraph cluster_block {{ label="{label}"; fontname="Helvetica"; fontsize=10; '
               f'color="#9e9e9e"; labelloc=b; tooltip="{_dot_text(tip)}";')
    # the stream in one row (its input and the two sums), each half's stages in the row beneath
    out.append(f'    "b.x" [shape=point width=0.06 label="" tooltip="{STAGE_TIPS["x"]}"];')
    for key, text, records in block:
        circle = ' shape=circle width=0.25 margin=0' if text == "+" else ""
        out.append(f'    "b.{key}" [label="{text}"{circle} tooltip="{_tip(records)}"];')
    sums = ["x"] + [k for k, text, _ in block if text == "+"]
    halves = [k for k, text, _ in block if text != "+"]
    out.append("    {rank=same; " + " ".join(f'"b.{k}";' for k in sums) + "}")
    out.append("    {rank=same; " + " ".join(f'"b.{k}";' for k in halves) + "}")
    stream = f'penwidth=2.2 color="#37474f" tooltip="{STAGE_TIPS["residual"]}"'
    for a, b in zip(sums, sums[1:]):
        out.append(f'    "b.{a}" -> "b.{b}" [{stream}];')
    keys = [k for k, _, _ in block]
    for a, b in zip(["x"] + keys, keys):
        if b in sums:  # a half adds into the stream: drawn upwards, ranked downwards
            out.append(f'    "b.{b}" -> "b.{a}" [dir=back];')
        else:
            out.append(f'    "b.{a}" -> "b.{b}";')
    out.append('  }')
    chain = ["p.prompt", "p.tokens", "p.embed", "b.x", "b.resid_out", "p.final_norm",
             "p.lm_head", "p.last", "p.sample", "p.token"]
    for a, b in zip(chain, chain[1:]):
        if (a, b) != ("b.x", "b.resid_out"):
            extra = " [arrowhead=none]" if b == "b.x" else \
                " [minlen=2]" if a == "b.resid_out" else ""  # beneath the halves' row
            out.append(f'  "{a}" -> "{b}"{extra};')
    out.append('}')
    return "\n".join(out)


def render_svg(dot: str) -> str:
    """SVG text from DOT text, with Graphviz's `dot`."""
    exe = shutil.which("dot")
    if exe is None:
        raise LlmTraceError("Graphviz's `dot` is not installed: apt-get install graphviz "
                            "(or `make graphviz` in the book's checkout)")
    r = subprocess.run([exe, "-Tsvg"], input=dot, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        first = (r.stderr.strip().splitlines() or ["no message"])[0]
        raise LlmTraceError(f"dot failed ({first}): check the DOT text it was given")
    return r.stdout[r.stdout.index("<svg"):]  # drop the XML prolog and doctype


def _inline(svg: str, prefix: str) -> str:
    """SVG text to put inside the page's HTML, where hovering shows a node's <title>: each
    node's, edge's and cluster's title is its tooltip (Graphviz titles them by their DOT names,
    and an edge without a tooltip has none), its ids are prefixed (two maps on a page), and it
    shrinks to the column if it is wider."""
    import re

    svg = re.sub(r'<title>[^<]*</title>(\s*<g id="a_[^"]*"><a xlink:title="([^"]*)">)',
                 r"<title>\2</title>\1", svg)
    svg = re.sub(r'(class="edge">\s*)<title>[^<]*</title>(?!\s*<g id="a_)', r"\1", svg)
    svg = svg.replace(' id="', f' id="{prefix}-')
    return svg.strip().replace("<svg ", '<svg style="max-width: 100%; height: auto" ', 1)


def machine_map(trace, highlight: str | list[str] = (), title: str = "",
                compact: bool | None = None, folded: str = ""):
    """The map for a notebook cell. With a stage lit, the compact map (`compact_dot`), an SVG
    image: the stage chapters say where they are in the machine. With none, the map by stages
    (`stage_dot`), put into the page's HTML so that hovering a stage names its operations.
    `compact=False` draws the full map (`machine_dot`), every operation of one block; `folded`
    puts the map in a folded box (HTML `<details>`) under that one line."""
    from IPython.display import HTML, SVG

    if compact is None and not highlight and not folded:
        return HTML(_inline(render_svg(stage_dot(trace, title)), "stages"))
    draw = compact_dot if (bool(highlight) if compact is None else compact) else machine_dot
    svg = render_svg(draw(trace, highlight, title))
    if not folded:
        return SVG(svg)
    import html

    return HTML(f"<details><summary>{html.escape(folded)}</summary>"
                f"{_inline(svg, 'full')}</details>")
