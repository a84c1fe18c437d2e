"""The book's listings (`book.show_source`) follow the model that runs: on a plain Llama the
lines only another family runs give way to one comment line; on a model that sets a switch
(Gemma 3) they stay."""

import inspect
import re
import sys
from pathlib import Path

import pytest

from llmtrace import load_model
from llmtrace.attention import attend, attention
from llmtrace.config import Config
from llmtrace.embed import embed
from llmtrace.mlp import swiglu
from llmtrace.model import Model, block
from llmtrace.norm import rms_norm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
import book  # noqa: E402

LISTED = [attention, attend, block, Model.forward, Model.head, embed, rms_norm, swiglu]
# what names another family's code: the families, the switches and their local names
OTHERS = re.compile(r"Qwen|Gemma|Mistral|GeGLU|pos\.(local|base|window)|(?<![.\w])(offset|act|off)\b|"
                    + "|".join(book.SWITCHES))


@pytest.fixture(scope="module")
def llama():
    return load_model("embedded").config


@pytest.fixture(scope="module")
def gemma():
    """A tiny Gemma 3: the 270M preset's switches on a few small layers."""
    c = Config.from_name("gemma-3-270m")
    return c.replace(n_layers=2, layer_types=c.layer_types[4:6], vocab_size=128,
                     hidden_size=16, n_heads=2, n_kv_heads=1, head_dim=8, ffn_size=32)


def source(fn):
    return inspect.getsource(inspect.unwrap(fn))


def listing(fn, config):
    code, gone = book.abridge(source(fn), config, inspect.unwrap(fn).__name__)
    return code, gone


@pytest.mark.parametrize("fn", LISTED, ids=lambda f: f.__qualname__)
def test_the_llama_listing_names_no_other_family_and_no_switch(fn, llama):
    code, gone = listing(fn, llama)
    assert gone > 0, "the listing should leave another family's lines out"
    found = sorted({m.group(0) for m in OTHERS.finditer(code)})
    assert not found, f"{fn.__qualname__}'s Llama listing still names {found}:\n{code}"
    own = {line.strip() for line in source(fn).splitlines()}
    for line in code.splitlines():  # the library's own lines, or the one comment line
        assert line.strip() in own or "other families run here" in line or \
            _joined(line, source(fn)), line


def _joined(line, src):
    """A line made of the library's lines with a switch's argument, parameter or branch
    left out: each of its pieces is in the source."""
    pieces = [p for p in re.split(r'[,()]\s*|\s+|"""', line) if p]
    return all(p in src for p in pieces)


def test_the_llama_listing_still_runs_as_the_library_does(llama):
    """The abridged block is valid Python that computes what the library's block computes."""
    import torch

    from llmtrace import attention as attention_module
    from llmtrace import model as model_module

    ns = dict(vars(model_module))
    exec(listing(block, llama)[0], ns)
    ns_attn = dict(vars(attention_module))
    exec(listing(attention, llama)[0], ns_attn)
    exec(listing(attend, llama)[0], ns_attn)
    ns["attention"] = ns_attn["attention"]
    m = load_model("embedded")
    ids = m.encode(book.PROMPT)
    pos = attention_module.Positions.of(0, ids.shape[1], m.config)
    x = torch.nn.functional.embedding(ids, m.weights.embed)
    lw = m.weights.layers[0]
    assert torch.equal(ns["block"](x, lw, m.config, pos), block(x, lw, m.config, pos))


def test_the_llama_listing_says_where_the_lines_went(llama):
    code, gone = listing(attention, llama)
    notes = [line.strip() for line in code.splitlines() if "other families" in line]
    assert notes == [f"# ... {n} lines other families run here: chapter 16"
                     for n in (8, 5, 7, 5, 2, 6, 4)]
    assert gone == 38
    assert "output_gate" not in code and "rotary_dim" not in code  # inside `if pos.rope`
    assert "if config.qkv_bias" in source(attention)  # ... which the library has


def test_a_docstring_loses_only_the_other_familys_sentences():
    doc = ('    """What the MLP adds to the stream [B, T, D];\n'
           '    sandwich_norm (Gemma): normalized once more before the add."""\n')
    assert book._abridge_doc(doc, [], "llama") == (
        '    """What the MLP adds to the stream [B, T, D]."""\n', 1)
    assert book._abridge_doc(doc, [], "gemma3_text") == (doc, 0)
    mixed = '    """Scaled dot products. window [T, S]: a window\'s mask."""\n'
    assert book._abridge_doc(mixed, ["window"], "llama")[0] == \
        '    """Scaled dot products."""\n'


@pytest.mark.parametrize("fn", LISTED, ids=lambda f: f.__qualname__)
def test_a_gemma_listing_keeps_its_switches(fn, gemma):
    """Every line of a switch Gemma 3 sets stays; only what it lacks goes (Qwen2's bias,
    Llama 3's RoPE scaling, gpt-oss's sinks, SmolLM3's layers without RoPE, Qwen3-Next's
    output gate and partial RoPE)."""
    code, gone = listing(fn, gemma)
    src = source(fn)
    assert OTHERS.search(src), f"{fn.__qualname__} reads no switch: it needs no abridging"
    if fn is attend:  # the sinks' parameter, docstring line and branch
        assert gone == 4 and "sinks" not in code and "scale" in code and "window" in code
        return
    if fn is block:  # OLMo 2's lines go (Gemma 3 has a norm before each sublayer), and Gemma
        # 4's per-layer input and scalar; the rest stays
        assert gone == 3 and "OLMo" not in code and "pre_norm" not in code and " off)" in code
        assert "ple_size" not in code and "layer_scalar" not in code
        return
    if fn.__qualname__ == "Model.forward":  # Gemma 4's per-layer inputs go (4 lines), and
        # SmolLM3's two (layers without RoPE)
        assert gone == 6 and "ple_size" not in code and "no_rope_layers" not in code
        assert "pos.local" in code  # Gemma 3's own line stays
        return
    if fn.__qualname__ == "Model.head":  # Gemma 4's soft cap goes; Gemma 3's norm offset stays
        assert gone == 2 and "final_softcap" not in code and "c.norm_offset" in code
        return
    if fn is not attention:
        assert gone == 0 and code == src
        return
    assert gone == 31 and "qkv_bias" not in code and "rope_scaling" not in code
    assert "pos.rope" not in code and "no RoPE" not in code
    assert "output_gate" not in code and "rotary_dim" not in code  # Qwen3-Next's
    assert "OLMo" not in code  # its norm over the whole projection goes: Gemma's is per head
    for line in src.splitlines():
        if any(s in line for s in ("qk_norm", "pos.base", "norm_offset", "attn_scale")) and \
                "OLMo" not in line:
            assert line.replace(", w.sinks)", ")") in code.splitlines(), line  # gpt-oss's goes


def test_a_switch_the_model_sets_keeps_only_its_own_lines(llama):
    """A Qwen2-shaped config (qkv_bias on): the bias lines stay, the others' go."""
    code, _ = listing(attention, llama.replace(qkv_bias=True))
    assert "if config.qkv_bias" in code and "qk_norm" not in code and "pos.base" not in code


def test_show_source_follows_the_model_start_chapter_loaded(llama, monkeypatch, gemma):
    said = []
    monkeypatch.setattr(book, "say", said.append)
    monkeypatch.setattr(book, "_RUNNING", [llama])
    book.show_source(swiglu)
    assert "abridged (4 lines of other families left out)" in said[0]
    assert "gelu" not in said[0] and "F.silu(gate)" in said[0]
    book.show_source(swiglu, config=gemma)
    assert "abridged" not in said[1] and "gelu_tanh" in said[1]
