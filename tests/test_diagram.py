"""The map of the machine is drawn from the trace: every operation of a block is on it, for every
family, with the data flow its code gives it, and every edge carries the shape the trace
recorded."""

import re
import shutil

import pytest

from llmtrace_book import Config
from llmtrace_book.diagram import block_flow, machine_dot, render_svg
from llmtrace_book.model import trace_shapes
from tiny_checkpoint import ROWS, hf_config


@pytest.fixture(scope="module")
def tiny_trace():
    return trace_shapes("tinyllama-1.1b", 6, decode_steps=0)[0]


def family_trace(f: str):
    """The meta trace of a prompt of 6 on a family's tiny config (tiny_checkpoint.ROWS)."""
    return trace_shapes(Config.from_hf(hf_config(f).to_dict(), name=f), 6, decode_steps=0)[0]


def nodes(dot: str) -> set[str]:
    return set(re.findall(r'"b\.([\w.]+)" \[label=', dot)) - {"x"}


@pytest.mark.parametrize("f", list(ROWS))
def test_every_record_of_layer_0_is_on_the_map(f):
    trace = family_trace(f)
    recorded = {r.name.split(".", 2)[2] for r in trace.layer(0)}
    assert nodes(machine_dot(trace)) == recorded


def test_the_flow_is_the_codes():
    """Edges from what each tensor was computed from: Gemma 3's norm after attention sits
    between attention's output and the residual add, its window mask between the causal mask
    and the masked scores; Qwen2's bias follows its projection."""
    gemma = block_flow(Config.from_name("gemma-3-270m"))
    assert {("attn.out", "attn_post_norm"), ("attn_post_norm", "resid_mid"),
            ("attn.causal_mask", "attn.window_mask"),
            ("attn.window_mask", "attn.masked_scores")} <= set(gemma)
    assert ("attn.out", "resid_mid") not in gemma
    qwen2 = block_flow(Config.from_hf(hf_config("qwen2").to_dict(), name="q"))
    assert ("attn.q_proj", "attn.q_bias") in qwen2 and ("attn.q_bias", "attn.q") in qwen2


def test_edges_carry_tinyllamas_shapes(tiny_trace):
    dot = machine_dot(tiny_trace)
    assert '"b.attn.k" -> "b.attn.rope_k" [label=" [1, 6, 4, 64]"]' in dot
    assert '"b.attn.k_expanded" -> "b.attn.scores" [label=" [1, 32, 6, 64]"]' in dot
    assert '"b.attn.causal_mask" -> "b.attn.masked_scores" [label=" [6, 6]"]' in dot
    assert '"p.lm_head" -> "p.last" [label=" [1, 6, 32000]"]' in dot
    assert 'label="22 blocks"' in dot and 'one block (layer 0 of 22)' in dot


def test_highlight_lights_the_stage_and_its_place_in_the_pass(tiny_trace):
    dot = machine_dot(tiny_trace, "mlp.*")
    lit = set(re.findall(r'"([pb]\.[\w.]+)" \[label="[^"]*" style="filled,bold"', dot))
    assert lit == {"b.mlp.gate", "b.mlp.up", "b.mlp.act", "b.mlp.gated", "b.mlp.down", "p.blocks"}


def test_renders_as_svg(tiny_trace):
    assert shutil.which("dot"), "Graphviz is not installed: run `make graphviz`"
    svg = render_svg(machine_dot(tiny_trace, "attn.rope_*"))
    assert svg.startswith("<svg") and "attn.rope_q" in svg and "[1, 6, 32, 64]" in svg


def test_titles_with_quotes_and_no_highlight(tiny_trace):
    dot = machine_dot(tiny_trace, highlight=None, title='the "whole" pass \\ one block')
    assert 'label="the \\"whole\\" pass \\\\ one block";' in dot
    assert "#ffd54f" not in dot  # nothing lit
    if shutil.which("dot"):
        assert render_svg(dot).startswith("<svg")  # Graphviz parses it


# The compact map: a chapter's "you are here" in a few lines of height.

def _lit_nodes(dot):
    return set(re.findall(r'"([pb]\.[\w.]+)" \[label="[^"]*" style="filled,bold"', dot))


@pytest.mark.parametrize("f", list(ROWS))
def test_every_record_of_a_block_is_in_one_step_of_the_compact_map(f):
    from llmtrace_book.diagram import _steps

    trace = family_trace(f)
    attn, mlp = _steps(trace)
    grouped = [n for _, _, names in attn + mlp for n in names]
    assert len(grouped) == len(set(grouped))  # no record in two steps
    assert set(grouped) == {r.name.split(".", 2)[2] for r in trace.layer(0)}


def test_compact_map_lights_the_steps_that_hold_the_stage(tiny_trace):
    from llmtrace_book.diagram import compact_dot

    assert _lit_nodes(compact_dot(tiny_trace, "attn.rope_*")) == {"b.rope", "p.blocks"}
    assert _lit_nodes(compact_dot(tiny_trace, ["attn_norm", "mlp_norm", "final_norm"])) == \
        {"b.attn_norm", "b.mlp_norm", "p.blocks", "p.final_norm"}
    dot = compact_dot(tiny_trace, "attn.*")
    assert _lit_nodes(dot) == {"b.qkv", "b.rope", "b.cache", "b.scores", "b.softmax", "b.mix",
                               "p.blocks"}
    assert 'label="22 blocks"' in dot and "one block of 22" in dot


def test_compact_map_outside_the_block_shows_the_pass_only_with_its_shapes(tiny_trace):
    from llmtrace_book.diagram import compact_dot

    dot = compact_dot(tiny_trace, ["final_norm", "lm_head"])
    assert "cluster_block" not in dot
    assert _lit_nodes(dot) == {"p.final_norm", "p.lm_head"}
    assert 'label="LM head\\n[1, 6, 32000]"' in dot  # the trace's shape under a lit step


def test_the_map_is_compact_by_default_once_a_stage_is_lit(tiny_trace):
    """Chapter 1 shows the whole machine (no stage); a stage chapter's map is a few lines high."""
    assert shutil.which("dot"), "Graphviz is not installed: run `make graphviz`"
    from llmtrace_book.diagram import machine_map

    def height_pt(svg):
        return float(re.search(r"<svg[^>]* height=\"([\d.]+)pt\"", svg).group(1))

    full, stage = machine_map(tiny_trace, compact=False).data, machine_map(tiny_trace, "mlp.*").data
    assert "one block (layer 0 of 22)" in full and "one block of 22" in stage
    assert height_pt(stage) < 250 < 4 * 250 < height_pt(full)
    assert "one block (layer 0 of 22)" in machine_map(tiny_trace, "mlp.*", compact=False).data
    assert "× 22 blocks" in machine_map(tiny_trace).data  # no stage: the map by stages



def _centres(svg) -> dict[str, tuple[float, float]]:
    """Each node's centre in the rendered SVG, by its DOT name (the middle of its outline)."""
    import html

    centres = {}
    for name, body in re.findall(r'<g id="node\d+" class="node">\s*<title>([^<]*)</title>(.*?)</g>',
                                 svg, re.S):
        xs, ys = [], []
        for pts in re.findall(r'points="([^"]+)"', body):
            for pair in pts.split():
                x, y = pair.split(",")
                xs.append(float(x)), ys.append(float(y))
        for cx, cy, rx, ry in re.findall(r'cx="([-\d.]+)" cy="([-\d.]+)" rx="([\d.]+)" '
                                         r'ry="([\d.]+)"', body):
            xs += [float(cx) - float(rx), float(cx) + float(rx)]
            ys += [float(cy) - float(ry), float(cy) + float(ry)]
        centres[html.unescape(name)] = ((min(xs) + max(xs)) / 2, (min(ys) + max(ys)) / 2)
    return centres


def test_the_compact_map_draws_the_block_as_one_row_beneath_the_pass(tiny_trace):
    """The block's steps in one row, left to right in the order they run, under the pass's row;
    the two residual connections are its only other lines (no line runs back across the row)."""
    assert shutil.which("dot"), "Graphviz is not installed: run `make graphviz`"
    from llmtrace_book.diagram import compact_dot, render_svg

    dot = compact_dot(tiny_trace, "attn.*")
    at = _centres(render_svg(dot))
    block = ["b.x", "b.attn_norm", "b.qkv", "b.rope", "b.cache", "b.scores", "b.softmax",
             "b.mix", "b.resid_mid", "b.mlp_norm", "b.mlp", "b.resid_out"]
    passes = [n for n in at if n.startswith("p.")]
    assert {round(at[n][1]) for n in block} == {round(at["b.qkv"][1])}  # one row
    assert [at[n][0] for n in block] == sorted(at[n][0] for n in block)  # in order
    assert len({round(at[n][1]) for n in passes}) == 1 and at["p.prompt"][1] < at["b.qkv"][1]
    skips = re.findall(r'"b\.(\w+)" -> "b\.(\w+)" \[style=dashed\]', dot)
    assert skips == [("x", "resid_mid"), ("resid_mid", "resid_out")]
    assert "constraint=false" not in dot  # every line runs with the flow


def test_the_map_by_stages_draws_the_residual_stream_as_one_line(tiny_trace):
    """The stream (the block's input and its two sums) in one row; the halves' stages in the
    row beneath, each half between the sums it reads from and adds into."""
    assert shutil.which("dot"), "Graphviz is not installed: run `make graphviz`"
    from llmtrace_book.diagram import render_svg, stage_dot

    at = _centres(render_svg(stage_dot(tiny_trace)))
    stream, halves = ["b.x", "b.resid_mid", "b.resid_out"], ["b.attn_norm", "b.attn",
                                                             "b.mlp_norm", "b.mlp"]
    assert len({round(at[n][1]) for n in stream}) == 1
    assert len({round(at[n][1]) for n in halves}) == 1
    assert at["b.x"][1] < at["b.attn"][1]  # the stream above (SVG y grows downwards)
    x = {n: at[n][0] for n in stream + halves}
    assert x["b.attn_norm"] < x["b.attn"] <= x["b.resid_mid"] <= x["b.mlp_norm"] < x["b.mlp"] \
        <= x["b.resid_out"] and x["b.x"] < x["b.attn"]

# The map by stages: what the first chapter shows, one screen high, the operations on hover.

def _svg_size_px(svg):
    w, h = re.search(r'<svg[^>]* width="([\d.]+)pt" height="([\d.]+)pt"', svg).groups()
    return float(w) * 4 / 3, float(h) * 4 / 3  # CSS: 1 pt = 4/3 px


def _titles(svg):
    import html

    return [html.unescape(t) for t in re.findall(r"<title>([^<]*)</title>", svg)]


def test_the_map_by_stages_names_the_stages_a_reader_knows(tiny_trace):
    from llmtrace_book.diagram import stage_dot

    dot = stage_dot(tiny_trace)
    pass_ = re.findall(r'"p\.\w+" \[label=<?"?([^<"]+)', dot)
    assert pass_ == ["text", "tokens", "embedding", "final RMSNorm", "LM head",
                     "last logits", "sample", "next token"]
    block = re.findall(r'"b\.\w+" \[label="([^"]+)"', dot)
    assert block == ["RMSNorm", "attention", "+", "RMSNorm", "FFN", "+"]
    assert "× 22 blocks: the same in shape, each with its own weights" in dot
    assert "[1, 6, 2048] in and out" in dot and "[1, 6, 32000]" in dot  # the trace's shapes
    assert "attn_norm.mean_sq" not in dot.split("tooltip")[0]  # no trace names on the nodes


def test_the_map_by_stages_fits_one_screen_and_the_column(tiny_trace):
    """At a 1280 px window the book's column is about 820 px wide (book.COLUMN_INCHES at 100
    dpi): the map is drawn narrower than that, so it is shown at its own size, under 700 px."""
    assert shutil.which("dot"), "Graphviz is not installed: run `make graphviz`"
    from llmtrace_book.diagram import machine_map

    width, height = _svg_size_px(machine_map(tiny_trace).data)
    assert width <= 820 and height <= 700, (width, height)


@pytest.mark.parametrize("f", list(ROWS))
def test_every_record_is_in_one_stage_of_the_map_by_stages(f):
    """Every record of the pass and of layer 0, whatever the family records, in one stage."""
    from llmtrace_book.diagram import stage_groups

    trace = family_trace(f)
    outer, block = stage_groups(trace)
    held = [r.name for _, _, records in outer + block for r in records]
    assert len(held) == len(set(held))
    assert set(held) == {r.name for r in trace if not r.name.startswith("layers.")} | \
        {r.name for r in trace.layer(0)}
    stages = {k: [r.name for r in records] for k, _, records in outer + block}
    assert stages["tokens"] == ["tokens"] and stages["resid_mid"] == ["layers.0.resid_mid"]
    assert all(n.startswith(("layers.0.attn.", "layers.0.attn_")) for n in stages["attn"])
    assert "layers.0.mlp_norm.mean_sq" not in stages["resid_mid"]  # with its norm


def test_hovering_a_stage_names_its_operations(tiny_trace):
    """In the page's HTML each stage's SVG <title> (what a browser shows on hover) lists its
    records, with their operations and shapes: every operation of the trace is named there."""
    assert shutil.which("dot"), "Graphviz is not installed: run `make graphviz`"
    from llmtrace_book.diagram import machine_map

    svg = machine_map(tiny_trace).data
    lines = [line for t in _titles(svg) for line in t.split("\n")]
    named = {line.split(": ", 1)[0] for line in lines}
    assert {r.name for r in tiny_trace if not r.name.startswith("layers.")} <= named
    assert {r.name for r in tiny_trace.layer(0)} <= named
    assert "layers.0.attn.scores: q @ k^T / sqrt(64) [1, 32, 6, 6]" in lines
    assert not [t for t in _titles(svg) if re.match(r"[pb]\.[\w.]+->", t)]  # no DOT names


def test_the_full_map_folded_holds_every_operation(tiny_trace):
    """Under the map by stages, the full map in a folded box: every record of layer 0 a node,
    named, its operation on hover."""
    assert shutil.which("dot"), "Graphviz is not installed: run `make graphviz`"
    from llmtrace_book.diagram import machine_map

    html = machine_map(tiny_trace, compact=False, folded="every operation").data
    assert html.startswith("<details><summary>every operation</summary><svg")
    assert html.endswith("</svg></details>")
    texts = set(re.findall(r"<text[^>]*>([^<]*)</text>", html))
    assert {r.name.split(".", 2)[2] for r in tiny_trace.layer(0)} <= texts
    assert "layers.0.mlp.gate: x @ W_gate^T [1, 6, 5632]" in _titles(html)
