"""The page's lab graph (llmtrace_book.export.lab): the forward pass with interventions as inputs.

Each form of the export (the page's 4-bit blocks, and fp32) holds a lab graph beside its main
graph, reading the same data. Run by onnxruntime here, as the page runs it, it must give what the
library's own `Patched` runs give, for three prompt pairs: with no intervention, a head's output
patched from the other prompt, an MLP zero-ablated, a head's pattern made uniform, and the
residual stream's whole layer-by-position sweep in one batched pass.
"""

import json

import numpy as np
import pytest
import torch

from llmtrace_book import Trace, export
from llmtrace_book.export.lab import SITES, lab_inputs
from llmtrace_book.trace import Patched

PAIRS = [("The capital of France is", "The capital of Germany is"),
         ("The largest planet in our solar system is", "The smallest planet in our solar system is"),
         ("The opposite of hot is", "The opposite of big is")]
FORMS = ("web.json", "web-fp32.json")
TOLERANCE = 1e-3  # on logits: the goal is the main graph's 1e-4, measured below


@pytest.fixture(scope="module")
def web_dir():
    return export.web_dir()


@pytest.fixture(scope="module")
def labs(web_dir):
    return {form: export.session(web_dir, web=form, graph="lab") for form in FORMS}


def run_lab(sess, ids, answers, inputs):
    feeds = {"ids": ids.numpy(), "answers": np.array(answers, dtype=np.int64)}
    feeds |= {k: v.numpy() for k, v in inputs.items()}
    logits, metric = sess.run(["lab.logits", "lab.metric"], feeds)
    return torch.from_numpy(logits), torch.from_numpy(metric)


@pytest.fixture(scope="module", params=PAIRS, ids=["capital", "planet", "opposite"])
def pair(request, embedded):
    clean, corrupt = request.param
    ids, other = embedded.encode(clean), embedded.encode(corrupt)
    assert ids.shape == other.shape, request.param
    names = ["layers.*.attn.weighted_sum", "layers.*.mlp.down", "layers.*.resid_out", "embed"]
    traces = [Trace(names=names), Trace(names=names)]
    logits = [embedded.forward(x, t)[0, -1] for x, t in zip((ids, other), traces)]
    answers = [int(logits[0].argmax()), int(logits[1].argmax())]
    assert answers[0] != answers[1], request.param
    return ids, other, answers, traces, logits


def test_the_manifest_names_the_lab(web_dir):
    for form in FORMS:
        web = json.loads((web_dir / form).read_text())
        lab = web["lab"]
        assert lab["outputs"] == ["lab.logits", "lab.metric"]
        assert lab["inputs"][:2] == ["ids", "answers"] and len(lab["inputs"]) == 2 + 2 * len(SITES)


@pytest.mark.parametrize("form", FORMS)
def test_no_intervention_is_the_ordinary_pass(embedded, labs, pair, form):
    ids, _, answers, _, logits = pair
    got, metric = run_lab(labs[form], ids, answers, lab_inputs(embedded.config, ids.shape[1], 2))
    for row in range(2):
        assert (got[row] - logits[0]).abs().max() < TOLERANCE
        assert torch.equal(got[row], got[0])  # every row the same pass
    assert abs(float(metric[0]) - float(logits[0][answers[0]] - logits[0][answers[1]])) < 1e-3


@pytest.mark.parametrize("form", FORMS)
def test_patches_and_ablations_are_the_librarys(embedded, labs, pair, form):
    """Row 1: head 4 of the middle layer patched from the clean prompt at the last position, in
    the corrupted run; row 2: the last layer's MLP zero-ablated at every position; row 3: head 0
    of layer 1 given a uniform pattern; each against `Patched`."""
    ids, other, answers, traces, _ = pair
    c = embedded.config
    T, mid = ids.shape[1], c.n_layers // 2
    inputs = lab_inputs(c, T, 4)
    z = traces[0][f"layers.{mid}.attn.weighted_sum"][0]  # [H, T, hd]: the clean run's
    inputs["heads.source"][mid] = z
    inputs["heads.mask"][1, mid, 4, T - 1] = 1
    inputs["mlp.mask"][2, c.n_layers - 1] = 1  # the source is zero
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]  # [T, T]
    inputs["pattern.source"][1] = uniform.expand(c.n_heads, T, T)
    inputs["pattern.mask"][3, 1, 0] = 1
    got, metric = run_lab(labs[form], other, answers, inputs)

    def head_in(t):
        t = t.clone()
        t[:, 4, -1] = z[4, -1]
        return t

    def zero(t):
        return torch.zeros_like(t)

    def flat(t):
        t = t.clone()
        t[:, 0] = uniform
        return t
    for row, patch in [(1, {f"layers.{mid}.attn.weighted_sum": head_in}),
                       (2, {f"layers.{c.n_layers - 1}.mlp.down": zero}),
                       (3, {"layers.1.attn.weights": flat})]:
        want = embedded.forward(other, Patched(patch))[0, -1]
        assert (got[row] - want).abs().max() < TOLERANCE, row
        m = float(want[answers[0]] - want[answers[1]])
        assert abs(float(metric[row]) - m) < 2 * TOLERANCE, row


def test_the_stream_sweep_in_one_pass_is_the_librarys(embedded, labs, pair):
    """Every layer by every position: the clean stream entering the layer written into the
    corrupted run, one row each, against the library's batched `Patched` run of the same rows,
    normalized as chapter 14 normalizes."""
    ids, other, answers, traces, logits = pair
    c = embedded.config
    T, L = ids.shape[1], c.n_layers
    streams = ["embed"] + [f"layers.{l}.resid_out" for l in range(L - 1)]
    source = torch.stack([traces[0][s][0] for s in streams])  # [L, T, D]
    rows = [(l, p) for l in range(L) for p in range(T)]
    inputs = lab_inputs(c, T, len(rows))
    inputs["resid.source"] = source
    for r, (l, p) in enumerate(rows):
        inputs["resid.mask"][r, l, p] = 1
    _, metric = run_lab(labs["web-fp32.json"], other, answers, inputs)

    patch = {}
    for l, name in enumerate(streams):
        def put(t, l=l):
            t = t.clone()
            for r, (m, p) in enumerate(rows):
                if m == l:
                    t[r, p] = source[l, p]
            return t
        patch[name] = put
    want = embedded.forward(other.expand(len(rows), -1), Patched(patch))[:, -1]
    m_want = want[:, answers[0]] - want[:, answers[1]]
    m_clean = float(logits[0][answers[0]] - logits[0][answers[1]])
    m_corr = float(logits[1][answers[0]] - logits[1][answers[1]])
    span = m_clean - m_corr
    effect, effect_want = (metric - m_corr) / span, (m_want - m_corr) / span
    assert (effect - effect_want).abs().max() < 1e-3
    # where the prompts differ in one token, its embedding alone makes the clean run
    differ = (ids != other).nonzero()[:, 1]
    if len(differ) == 1:
        assert abs(float(effect[rows.index((0, int(differ)))]) - 1) < 1e-3
