"""The trace and the patches under bad input: the trace's arguments, its look-ups, the logit lens,
and patch functions that return the wrong thing, take the wrong parameters or are shadowed. Each
gives one line that names what was wrong and what to do, never an error from inside torch."""

import pytest
import torch

from helpers import PROMPT, one_line
from llmtrace_book import LlmTraceError, Trace, generate, logit_lens
from llmtrace_book.lens import lens_grid


@pytest.fixture(scope="module")
def traced(tiny):
    return tiny.run(PROMPT)[1]


# --- the trace's arguments --------------------------------------------------------------------
@pytest.mark.parametrize("names", [3, b"layers.*", [1, 2], {"a": 1}, ["layers.*", None]])
def test_names_that_are_not_globs(tiny, names):
    with pytest.raises(LlmTraceError) as err:
        tiny.run(PROMPT, names=names)
    assert "names must be a glob, a list of globs or a function of the name" in one_line(err)


def test_a_glob_that_matches_nothing_says_so(tiny):
    with pytest.raises(LlmTraceError) as err:
        tiny.run(PROMPT, names=["layers.*.attn.weights", "layers.*.attn.weight"])
    message = one_line(err)
    assert "names matching no record of the pass: 'layers.*.attn.weight'" in message
    assert "did you mean layers.*.attn.weights" in message
    with pytest.raises(LlmTraceError, match=r"'layers.9.mlp.up' \(this trace has layers 0..1\)"):
        tiny.run(PROMPT, names="layers.9.mlp.up")


@pytest.mark.parametrize("value", ["yes", 1, None, 0.0])
def test_keep_values_must_be_a_bool(tiny, value):
    with pytest.raises(LlmTraceError) as err:
        tiny.run(PROMPT, keep_values=value)
    assert f"keep_values must be True or False, got {value!r}" in one_line(err)


def test_keep_freed_memory_is_an_opt_in_that_must_be_0_or_1(tiny, monkeypatch):
    monkeypatch.setenv("LLMTRACE_KEEP_FREED_MEMORY", "yes")
    with pytest.raises(LlmTraceError) as err:
        tiny.run(PROMPT)
    assert "LLMTRACE_KEEP_FREED_MEMORY='yes': set it to 1" in one_line(err)


# --- look-ups -----------------------------------------------------------------------------------
def test_trace_lookups(traced):
    with pytest.raises(LlmTraceError) as err:
        traced[0]
    assert "look a record up by its name" in one_line(err) and "trace.records[i]" in str(err.value)
    with pytest.raises(LlmTraceError) as err:
        traced["layers.1.attn.weight"]
    assert "did you mean layers.1.attn.weights" in one_line(err)
    assert "layers.0." not in str(err.value)  # the suggestions come from the layer asked for
    with pytest.raises(LlmTraceError, match="this trace has layers 0..1"):
        traced["layers.7.attn.weights"]
    with pytest.raises(LlmTraceError) as err:
        traced["layers.01.attn.weights"]
    assert "layer numbers have no leading zero: 'layers.1.attn.weights'" in one_line(err)
    with pytest.raises(LlmTraceError, match="find takes a glob on the records' names, got NoneType"):
        traced.find(None)


@pytest.mark.parametrize("layers", [0, -1, 1.5, "1", True])
def test_table_layers_must_be_a_positive_integer(traced, layers):
    with pytest.raises(LlmTraceError) as err:
        traced.table(layers=layers)
    assert "layers must be a whole number of layers, at least 1" in one_line(err)
    assert "layers=1 shows the first layer in full" in str(err.value)


@pytest.mark.parametrize("position", [6, 7, -7, 2.0, "last"])
def test_logit_lens_position_outside_the_prompt(tiny, traced, position):
    with pytest.raises(LlmTraceError) as err:
        logit_lens(tiny, traced, position)
    assert "position must be an integer from -6 to 5 (the prompt's 6 positions)" in one_line(err)


@pytest.mark.parametrize("token", [32000, -1, 3.0])
def test_lens_grid_token_outside_the_vocabulary(tiny, traced, token):
    with pytest.raises(LlmTraceError) as err:
        lens_grid(tiny, traced, token)
    assert "token must be a token id from 0 to 31999" in one_line(err)


# --- patches ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fn, says", [
    (lambda t: t.double(), "returned [1, 6, 64] float64 on cpu, not the op's [1, 6, 64] float32"),
    (lambda t: t.to("meta"), "returned [1, 6, 64] float32 on meta, not the op's [1, 6, 64] "
                             "float32 on cpu"),
    (lambda t: t.long(), "returned [1, 6, 64] int64 on cpu"),
])
def test_patch_returns_another_dtype_or_device(tiny, fn, says):
    with pytest.raises(LlmTraceError) as err:
        tiny.run(PROMPT, patch={"embed": fn})
    assert says in one_line(err) and "return a tensor like the one it received" in str(err.value)


def test_patch_on_a_meta_pass_returning_a_cpu_tensor(tiny_meta):
    ids = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(LlmTraceError) as err:
        tiny_meta.run(ids, keep_values=False, patch={"embed": lambda t: torch.zeros(t.shape)})
    assert "float32 on cpu, not the op's [1, 6, 2048] float32 on meta" in one_line(err)


def test_patched_token_ids_outside_the_vocabulary(tiny):
    for bad in (32000, -1):
        with pytest.raises(LlmTraceError) as err:
            tiny.run(PROMPT, patch={"tokens": lambda t: t * 0 + bad})
        assert f"returned token id {bad}, outside the vocabulary (0 .. 31999)" in one_line(err)
    with pytest.raises(LlmTraceError, match="outside the vocabulary"):
        generate(tiny, PROMPT, 2, patch={"tokens": lambda t: t + 40000})


@pytest.mark.parametrize("fn, n", [(lambda: 0, 0), (lambda t, name, extra: t, 3)])
def test_patch_with_no_parameter_or_three(tiny, fn, n):
    with pytest.raises(LlmTraceError) as err:
        tiny.run(PROMPT, patch={"embed": fn})
    assert f"the patch for 'embed' takes {n} parameter(s): a patch takes (tensor) or " \
           f"(tensor, name)" in one_line(err)


def test_patch_keys_accept_defaults_and_builtins(tiny):
    logits, _ = tiny.run(PROMPT, keep_values=False)
    same, _ = tiny.run(PROMPT, keep_values=False, patch={"embed": lambda t, name=None: t,
                                                        "lm_head": torch.clone})
    assert torch.equal(same, logits)


def test_a_glob_shadowed_by_an_earlier_one(tiny):
    with pytest.raises(LlmTraceError) as err:
        tiny.run(PROMPT, patch={"*": lambda t: t, "layers.*": lambda t: t})
    message = one_line(err)
    assert "'layers.*' (every operation it matches was taken by the earlier '*'" in message
    assert "put the narrower key first" in message and "matches no operation" not in message
    tiny.run(PROMPT, patch={"layers.*": lambda t: t, "*": lambda t: t})  # narrower first: fine
