"""Patches: change a named tensor as it flows on, and the trace records what flowed on."""

import pytest
import torch

from llmtrace_book import LlmTraceError, Patched, generate
from helpers import PROMPT

FRANCE, GERMANY = PROMPT, "The capital of Germany is"


@pytest.fixture(scope="module")
def germany(embedded):
    return embedded.run(GERMANY)


def test_identity_patch_on_every_op_is_bit_identical(embedded, prompt_trace):
    logits, trace = prompt_trace
    seen = []

    def identity(t, name):
        seen.append(name)
        return t

    patched_logits, patched = embedded.run(FRANCE, patch={"*": identity})
    assert torch.equal(patched_logits, logits)
    assert seen == trace.names  # every operation of the pass went through the patch, in order
    for r in patched:
        assert torch.equal(r.tensor, trace[r.name]), r.name
        assert r.op.endswith("[patched]")


def test_resid_out_from_another_prompt_makes_every_later_record_that_prompts(embedded, prompt_trace,
                                                                              germany):
    _, france = prompt_trace
    _, berlin_trace = germany
    L = 11
    name = f"layers.{L}.resid_out"
    logits, patched = embedded.run(FRANCE, patch={name: lambda t: berlin_trace[name]})
    at = patched.names.index(name)
    before, after = patched.records[:at], patched.records[at:]
    assert any(not torch.equal(france[r.name], berlin_trace[r.name]) for r in before)  # " France"
    for r in before:
        assert torch.equal(r.tensor, france[r.name]), r.name
    for r in after:
        assert torch.equal(r.tensor, berlin_trace[r.name]), r.name
    assert len(after) == 1 + 30 * (embedded.config.n_layers - L - 1) + 3
    assert torch.equal(logits, berlin_trace["lm_head"])
    assert embedded.tokenizer.decode([int(logits[0, -1].argmax())]) == " Berlin"


def test_zeroing_one_head_changes_only_what_depends_on_it(embedded, prompt_trace):
    _, clean = prompt_trace
    c = embedded.config
    L, head = 7, 4

    def zero_head(t):
        t = t.clone()  # [1, H, T, hd]
        t[:, head] = 0
        return t

    _, patched = embedded.run(FRANCE, patch={f"layers.{L}.attn.weighted_sum": zero_head})
    ws = patched[f"layers.{L}.attn.weighted_sum"]
    assert (ws[:, head] == 0).all() and (clean[f"layers.{L}.attn.weighted_sum"][:, head] != 0).any()
    others = [h for h in range(c.n_heads) if h != head]
    assert torch.equal(ws[:, others], clean[f"layers.{L}.attn.weighted_sum"][:, others])
    for r in patched.records[: patched.names.index(f"layers.{L}.attn.weighted_sum")]:
        assert torch.equal(r.tensor, clean[r.name]), r.name  # earlier layers, this layer's Q K V
    cols = slice(head * c.head_dim, (head + 1) * c.head_dim)
    merged, clean_merged = patched[f"layers.{L}.attn.merged"], clean[f"layers.{L}.attn.merged"]
    assert (merged[..., cols] == 0).all()
    assert torch.equal(merged[..., : cols.start], clean_merged[..., : cols.start])
    assert torch.equal(merged[..., cols.stop:], clean_merged[..., cols.stop:])
    assert not torch.equal(patched[f"layers.{L}.attn.out"], clean[f"layers.{L}.attn.out"])
    assert not torch.equal(patched["lm_head"], clean["lm_head"])


def test_patch_applies_in_every_step_of_generate_and_with_tracing_off(embedded):
    berlin = embedded.tokenizer.encode(" Berlin", bos=False)[-1]
    shapes = []

    def push_berlin(logits):
        shapes.append(tuple(logits.shape))
        logits = logits.clone()  # [1, T, V]
        logits[..., berlin] += 100
        return logits

    patch = {"lm_head": push_berlin}
    g = generate(embedded, FRANCE, max_new_tokens=3, stop_at_eos=False, patch=patch)
    assert g.new_ids == [berlin] * 3
    assert shapes == [(1, 5, 49152), (1, 1, 49152), (1, 1, 49152)]
    assert g.steps[0].get("lm_head").op.endswith("[patched]")
    logits = embedded.forward(embedded.encode(FRANCE), Patched(patch))  # tracing off
    assert int(logits[0, -1].argmax()) == berlin


def test_unknown_names_are_refused_with_close_names(embedded):
    close = r"'layers.3.attn.weight' \(did you mean layers.3.attn.weights,"
    with pytest.raises(LlmTraceError, match=close):
        embedded.run(FRANCE, patch={"layers.3.attn.weight": lambda t: t})
    with pytest.raises(LlmTraceError, match=r"'layers.\*.resid_post' \(did you mean layers.\*.resid_"):
        embedded.run(FRANCE, keep_values=False, patch={"layers.*.resid_post": lambda t: t})


def test_bad_patches_are_refused(embedded):
    with pytest.raises(LlmTraceError, match=r"returned \[1, 5, 1\] float32 on cpu, not the op's "
                                            r"\[1, 5, 576\] float32 on cpu"):
        embedded.run(FRANCE, patch={"embed": lambda t: t[..., :1]})
    with pytest.raises(LlmTraceError, match="returned NoneType"):
        embedded.run(FRANCE, patch={"embed": lambda t: None})
    with pytest.raises(LlmTraceError, match="patch must be a dict"):
        embedded.run(FRANCE, patch=["embed"])


def test_patches_work_on_the_meta_device(tiny_meta):
    ids = torch.zeros(1, 6, dtype=torch.long)
    seen = []
    patch = {"layers.*.attn.weighted_sum": lambda t, name: seen.append(name) or t * 0}
    logits, trace = tiny_meta.run(ids, keep_values=False, patch=patch)
    assert logits.device.type == "meta" and logits.shape == (1, 6, 32000)
    assert seen == [f"layers.{i}.attn.weighted_sum" for i in range(22)]
    assert trace.get("layers.21.attn.weighted_sum").op == "weights @ v [patched]"
    assert trace.shape("layers.21.attn.weighted_sum") == (1, 32, 6, 64)
    out_of_range = r"'layers.22.resid_out' \(this trace has layers 0..21\)"
    with pytest.raises(LlmTraceError, match=out_of_range):
        tiny_meta.run(ids, keep_values=False, patch={"layers.22.resid_out": lambda t: t})


def test_forward_with_grad_gives_the_same_logits_and_a_gradient_that_matches_a_patch(embedded):
    """grad=True: the pass runs with autograd, its logits bit-identical to inference mode's; the
    gradient at a head's output predicts the change of a small patch there (first order), and
    the default keeps no graph."""
    ids = embedded.encode(PROMPT)
    name = "layers.20.attn.weighted_sum"
    kept = {}

    def leaf(z):
        kept["z"] = z.detach().clone().requires_grad_()
        return kept["z"]
    flow = Patched({name: leaf})
    logits = embedded.forward(ids, flow, grad=True)
    assert torch.equal(logits.detach(), embedded.forward(ids))
    assert not embedded.forward(ids).requires_grad
    token = int(logits[0, -1].argmax())
    logits[0, -1, token].backward()
    g = kept["z"].grad  # [1, H, T, hd]
    step = 1e-3 * g / g.norm()  # a small move along the gradient
    z = kept["z"].detach()
    moved = embedded.forward(ids, Patched({name: lambda t: z + step}))[0, -1, token]
    predicted = float((g * step).sum())
    assert abs(float(moved - logits[0, -1, token].detach()) - predicted) < 0.05 * abs(predicted)
