"""The map of the machine is drawn from the trace: every operation of a block is on it, and every
edge carries the shape the trace recorded."""

import re
import shutil

import pytest

from llmtrace.diagram import BLOCK_EDGES, machine_dot, render_svg
from llmtrace.model import trace_shapes


@pytest.fixture(scope="module")
def tiny_trace():
    return trace_shapes("tinyllama-1.1b", 6, decode_steps=0)[0]


def test_every_operation_of_a_block_is_on_the_map(tiny_trace):
    on_map = {n for edge in BLOCK_EDGES for n in edge} - {"x"}
    recorded = {r.name.split(".", 2)[2] for r in tiny_trace.layer(0)} - {"attn_norm.mean_sq", "mlp_norm.mean_sq"}
    assert on_map == recorded


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


def test_every_operation_of_a_block_is_in_one_step_of_the_compact_map():
    from llmtrace.diagram import ATTN_STEPS, MLP_STEPS

    grouped = [n for _, _, names in ATTN_STEPS + MLP_STEPS for n in names]
    assert len(grouped) == len(set(grouped))  # no record in two steps
    assert set(grouped) == {n for edge in BLOCK_EDGES for n in edge} - {"x"}


def test_compact_map_lights_the_steps_that_hold_the_stage(tiny_trace):
    from llmtrace.diagram import compact_dot

    assert _lit_nodes(compact_dot(tiny_trace, "attn.rope_*")) == {"b.rope", "p.blocks"}
    assert _lit_nodes(compact_dot(tiny_trace, ["attn_norm", "mlp_norm", "final_norm"])) == \
        {"b.attn_norm", "b.mlp_norm", "p.blocks", "p.final_norm"}
    dot = compact_dot(tiny_trace, "attn.*")
    assert _lit_nodes(dot) == {"b.qkv", "b.rope", "b.cache", "b.scores", "b.softmax", "b.mix",
                               "p.blocks"}
    assert 'label="22 blocks"' in dot and "one block of 22, folded" in dot


def test_compact_map_outside_the_block_shows_the_pass_only_with_its_shapes(tiny_trace):
    from llmtrace.diagram import compact_dot

    dot = compact_dot(tiny_trace, ["final_norm", "lm_head"])
    assert "cluster_block" not in dot
    assert _lit_nodes(dot) == {"p.final_norm", "p.lm_head"}
    assert 'label="LM head\\n[1, 6, 32000]"' in dot  # the trace's shape under a lit step


def test_the_map_is_compact_by_default_once_a_stage_is_lit(tiny_trace):
    """Chapter 1 shows the whole machine (no stage); a stage chapter's map is a few lines high."""
    assert shutil.which("dot"), "Graphviz is not installed: run `make graphviz`"
    from llmtrace.diagram import machine_map

    def height_pt(svg):
        return float(re.search(r"<svg[^>]* height=\"([\d.]+)pt\"", svg).group(1))

    full, stage = machine_map(tiny_trace).data, machine_map(tiny_trace, "mlp.*").data
    assert "one block (layer 0 of 22)" in full and "one block of 22, folded" in stage
    assert height_pt(stage) < 250 < 4 * 250 < height_pt(full)
    assert "one block (layer 0 of 22)" in machine_map(tiny_trace, "mlp.*", compact=False).data
