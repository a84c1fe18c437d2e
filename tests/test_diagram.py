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
    assert 'label="22 blocks"' in dot and "one block of 22, folded" in dot


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

    full, stage = machine_map(tiny_trace).data, machine_map(tiny_trace, "mlp.*").data
    assert "one block (layer 0 of 22)" in full and "one block of 22, folded" in stage
    assert height_pt(stage) < 250 < 4 * 250 < height_pt(full)
    assert "one block (layer 0 of 22)" in machine_map(tiny_trace, "mlp.*", compact=False).data
