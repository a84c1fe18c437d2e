"""Chapter 14's headline numbers, measured a second way: HF transformers' LlamaForCausalLM with
forward hooks, on the same fp32 weights, against what the chapter printed (its committed outputs)
and against llmtrace's own patches.

- the effect of patching the residual stream, at the country's position and at the last one,
  entering every layer: the layer where the two swap;
- the share of the effect that the top head carries, and its direct part;
- the direct logit attribution of that head's layer.
"""

import ast
import json
import re
from pathlib import Path

import pytest
import torch

from llmtrace import Trace
from llmtrace.trace import Patched

CHAPTER = Path(__file__).resolve().parents[1] / "notebooks" / "14_inside_the_layers.ipynb"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def chapter():
    """The chapter's country list (from its source) and its printed text (from its outputs)."""
    cells = json.loads(CHAPTER.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    src = next(s for s in code if s.lstrip().startswith("from llmtrace.tokenize") and
               "capitals = {" in s)
    start = src.index("capitals = {")
    capitals = ast.literal_eval(src[start + len("capitals = "):src.index("}", start) + 1])
    text = []
    for c in cells:
        for o in c.get("outputs", []):
            text.append("".join(o.get("text", "")))
            text.append("".join(o.get("data", {}).get("text/markdown", "")))
    return capitals, "\n".join(text)


def number(pattern, text):
    m = re.search(pattern, text)
    assert m, f"the chapter's output no longer says {pattern!r}"
    return [float(g) if "." in g else int(g) for g in m.groups()]


@pytest.fixture(scope="module")
def pairs(embedded, hf_reference, chapter):
    """The chapter's prompts, answered by HF: kept when its top token is the capital, each paired
    with the next (clean i, corrupted i+1)."""
    capitals, _ = chapter
    T = embedded.encode(PROMPT).shape[1]
    prompts = {c: PROMPT.replace("France", c) for c in capitals}
    same = [c for c in capitals if embedded.encode(prompts[c]).shape[1] == T]
    ids = torch.cat([embedded.encode(prompts[c]) for c in same])  # [C, T]
    first = torch.tensor([int(embedded.encode(f"{prompts[c]} {capitals[c]}")[0, T])
                          for c in same])
    with torch.no_grad():
        top = hf_reference(ids).logits[:, -1].argmax(-1)
    keep = top == first
    ids, first = ids[keep], first[keep]
    N = len(ids)
    clean = torch.arange(N)
    corr = (clean + 1) % N
    return ids, first[clean], first[corr], corr, [c for c, k in zip(same, keep) if k]


class Hooks:
    """Forward pre-hooks that replace part of a module's first input, removed on exit."""

    def __init__(self):
        self.handles = []

    def replace(self, module, fn):  # fn(x) -> new x
        self.handles.append(module.register_forward_pre_hook(
            lambda mod, args: (fn(args[0]), *args[1:])))

    def capture(self, module, into, key, output=False):
        if output:
            h = module.register_forward_hook(lambda mod, args, out: into.__setitem__(key, out))
        else:
            h = module.register_forward_pre_hook(
                lambda mod, args: into.__setitem__(key, args[0]))
        self.handles.append(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits[:, -1]  # [B, V]


def m_of(logits, a, b):
    return logits.gather(1, a[:, None])[:, 0] - logits.gather(1, b[:, None])[:, 0]


@pytest.fixture(scope="module")
def clean_runs(hf_reference, pairs):
    """HF's run of every prompt, with each layer's input, each o_proj's input and output, and
    the final norm's input captured."""
    ids, a, b, corr, _ = pairs
    hf = hf_reference
    seen = {}
    with Hooks() as hooks:
        for l, layer in enumerate(hf.model.layers):
            hooks.capture(layer, seen, ("in", l))
            hooks.capture(layer.self_attn.o_proj, seen, ("z", l))
            hooks.capture(layer.self_attn.o_proj, seen, ("out", l), output=True)
        hooks.capture(hf.model.norm, seen, "final")
        logits = hf_logits(hf, ids)
    m_clean, m_corr = m_of(logits, a, b), m_of(logits[corr], a, b)
    return seen, m_clean, m_corr


def hf_patch_streams(hf, ids, pairs, clean_runs, rows):
    """Normalized effects of patching, with HF: row r runs pair P[r]'s corrupted prompt with the
    stream entering layer Ly[r] at position Pos[r] from the clean run (a layer pre-hook)."""
    _, a, b, corr, _ = pairs
    seen, m_clean, m_corr = clean_runs
    P, Ly, Pos = rows.T

    def patch_layer(l):
        sel = (Ly == l).nonzero()[:, 0]

        def fn(x):  # [R, T, D]: the stream entering layer l
            x = x.clone()
            x[sel, Pos[sel]] = seen[("in", l)][P[sel], Pos[sel]]
            return x
        return fn

    with Hooks() as hooks:
        for l in Ly.unique().tolist():
            hooks.replace(hf.model.layers[l], patch_layer(l))
        logits = hf_logits(hf, ids[corr[P]])
    return (m_of(logits, a[P], b[P]) - m_corr[P]) / (m_clean[P] - m_corr[P])


def test_patching_the_stream_swaps_positions_in_the_layer_the_chapter_says(
        embedded, hf_reference, pairs, chapter, clean_runs):
    ids = pairs[0]
    _, text = chapter
    N, T = ids.shape
    L = embedded.config.n_layers
    start = int((ids != ids[0]).any(0).nonzero()[0])  # the country's position
    printed = {int(l): (float(c), float(t)) for l, c, t in re.findall(
        r"layer\s+(\d+): at the country\s+(-?[\d.]+), at the last position\s+(-?[\d.]+)", text)}
    assert sorted(printed) == list(range(L))

    # the last position entering every layer: one batch row per (pair, layer)
    rows = torch.cartesian_prod(torch.arange(N), torch.arange(L), torch.tensor([T - 1]))
    last = hf_patch_streams(hf_reference, ids, pairs, clean_runs, rows).view(N, L).mean(0)
    for l in range(L):  # the chapter printed two decimals
        assert abs(last[l] - printed[l][1]) < 0.006, (l, float(last[l]), printed[l])
    flip = next(l for l in range(L) if last[l] > 0.5)
    (said,) = number(r"does it from the stream entering layer (\d+) on", text)
    assert flip == said and 0 < flip < L
    assert (last[:flip] < 0.1).all() and (last[flip:] > 0.9).all()

    # the country's position, at the layers on either side of the swap and at the ends
    layers = torch.tensor(sorted({0, flip - 1, flip, L - 1}))
    rows = torch.cartesian_prod(torch.arange(N), layers, torch.tensor([start]))
    country = hf_patch_streams(hf_reference, ids, pairs, clean_runs, rows)
    country = country.view(N, len(layers)).mean(0)
    for l, e in zip(layers.tolist(), country):
        assert abs(e - printed[l][0]) < 0.006, (l, float(e), printed[l])
        assert (e > 0.9) if l < flip else (abs(e) < 0.1)


def test_the_top_heads_share_and_its_direct_part_as_the_chapter_says(
        embedded, hf_reference, pairs, chapter, clean_runs):
    ids, a, b, corr, _ = pairs
    seen, m_clean, m_corr = clean_runs
    _, text = chapter
    c = embedded.config
    hd = c.head_dim
    layer, head, mean, lo, hi = number(
        r"head (\d+)\.(\d+) alone brings back (-?[\d.]+) of the clean answer "
        r"\(from (-?[\d.]+) to (-?[\d.]+)", text)
    cols = slice(head * hd, (head + 1) * hd)
    z_clean = seen[("z", layer)][:, -1, cols]  # [N, hd]: the head's output, clean runs

    def put_head(x):  # [N, T, H*hd]: o_proj's input in the corrupted runs
        x = x.clone()
        x[:, -1, cols] = z_clean
        return x

    with Hooks() as hooks:
        hooks.replace(hf_reference.model.layers[layer].self_attn.o_proj, put_head)
        total = (m_of(hf_logits(hf_reference, ids[corr]), a, b) - m_corr) / (m_clean - m_corr)
    assert abs(total.mean() - mean) < 0.006 and abs(total.min() - lo) < 0.006
    assert abs(total.max() - hi) < 0.006

    # llmtrace's own patch, one batched pass: the same numbers to float precision
    name = f"layers.{layer}.attn.weighted_sum"
    src = Trace(names=[name])
    embedded.forward(ids, src)

    def put_z(t):  # [N, H, T, hd]
        t = t.clone()
        t[:, head, -1] = src[name][:, head, -1]
        return t
    ours = embedded.forward(ids[corr], Patched({name: put_z}))[:, -1]
    ours = (m_of(ours, a, b) - m_corr) / (m_clean - m_corr)
    assert torch.allclose(ours, total, atol=2e-3)

    # the direct part: the head's change added to the final norm's input only
    W = hf_reference.model.layers[layer].self_attn.o_proj.weight[:, cols]  # [D, hd]
    delta = (z_clean - seen[("z", layer)][corr, -1, cols]) @ W.T  # [N, D]

    def add_delta(x):  # [N, T, D]
        x = x.clone()
        x[:, -1] += delta
        return x

    with Hooks() as hooks:
        hooks.replace(hf_reference.model.norm, add_delta)
        direct = (m_of(hf_logits(hf_reference, ids[corr]), a, b) - m_corr) / (m_clean - m_corr)
    (said_direct,) = number(r"splits into (-?[\d.]+) straight into the logits", text)
    assert abs(direct.mean() - said_direct) < 0.006


def test_direct_logit_attribution_of_the_layer_as_the_chapter_says(
        embedded, hf_reference, pairs, chapter, clean_runs):
    ids, a, b, corr, _ = pairs
    seen, _, _ = clean_runs
    _, text = chapter
    comp, mean, lo, hi = number(r"The largest direct term is `(\d+)\.attn`, "
                                r"\+?(-?[\d.]+) \(from \+?(-?[\d.]+) to \+?(-?[\d.]+)\)", text)
    norm = hf_reference.model.norm
    x = seen["final"][:, -1]  # [N, D]: the stream the final norm reads
    rms = (x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
    U = hf_reference.lm_head.weight
    direction = norm.weight * (U[a] - U[b]) / rms  # [N, D]
    dla = (seen[("out", comp)][:, -1] * direction).sum(-1)  # [N]
    for got, said in [(dla.mean(), mean), (dla.min(), lo), (dla.max(), hi)]:
        assert abs(got - said) < 0.051, (float(got), said)  # printed to one decimal

    # llmtrace's trace of the same runs: the same attribution to float precision
    t = Trace(names=[f"layers.{comp}.attn.out", "final_norm.mean_sq"])
    embedded.forward(ids, t)
    w = embedded.weights
    ours_dir = w.final_norm * (w.lm_head[a] - w.lm_head[b]) / (
        t["final_norm.mean_sq"][:, -1] + embedded.config.norm_eps).sqrt()
    ours = (t[f"layers.{comp}.attn.out"][:, -1] * ours_dir).sum(-1)
    assert torch.allclose(ours, dla, atol=1e-3)
