"""Chapter 14's headline numbers, measured a second way: HF transformers' LlamaForCausalLM with
forward hooks, on the same fp32 weights, against what the chapter printed (its committed outputs)
and against llmtrace's own patches.

- the effect of patching the residual stream, at the country's position and at the last one,
  entering every layer: the layer where the two swap;
- the share of the effect that the top head carries, and its direct part;
- the direct logit attribution of that head's layer;
- that head noised (the corrupted run's output written in: m, and the answer flips), ablated
  (zero, mean, resample), patched into every ordered pair of two prompts, and the other heads of
  its layer patched together;
- its attention pattern and its values, each patched alone; a uniform pattern in its place, and
  the country's weight moved to the first token;
- the head fed values computed from the stream entering each earlier layer, its pattern kept;
- per-sublayer tracing at the country's position (each MLP and attention output alone, MLP 0 both
  ways, the later MLPs together), with HF's module outputs replaced by forward hooks;
- the head's change sent to one receiver at a time (HF's norms before the MLPs, the attention, the
  logits take it on their input alone);
- the head's OV circuit read through the unembedding, from HF's hidden states, and every head's;
- the massive activation's controls (random dimensions zeroed; position 0 moved as far, in a
  random direction) and how close the mean is;
- path patching into the head's query and key (what builds its pattern);
- the key head across relations and templates (the table "Does it generalise?");
- attribution patching: gradients through HF's modules, times the runs' difference.
"""

import ast
import json
import re
from pathlib import Path

import pytest
import torch

from llmtrace_book import Trace
from llmtrace_book.trace import Patched

CHAPTER = Path(__file__).resolve().parents[1] / "notebooks" / "14_inside_the_layers.ipynb"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def chapter():
    """The chapter's country list (from its source) and its printed text (from its outputs)."""
    cells = json.loads(CHAPTER.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    src = next(s for s in code if s.lstrip().startswith("from llmtrace_book.tokenize") and
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
        r"head (\d+)\.(\d+) alone restores (-?[\d.]+) of the clean answer "
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
                                r"\+?(-?[\d.]+) \(from \+?(-?[\d.]+) to \+?(-?[\d.]+);", text)
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


# --- the additions: noising, ablation, the head's pattern and values, per-sublayer tracing, a
# path to one receiver, the OV circuit, the massive activation's control ---------------------

def interval(x, n=10_000, seed=0):
    """The chapter's 95% interval: a bootstrap of the mean over the pairs, seed 0."""
    g = torch.Generator().manual_seed(seed)
    x = x.double()
    means = x[torch.randint(len(x), (n, len(x)), generator=g)].mean(1)
    return float(means.quantile(0.025)), float(means.quantile(0.975))


def ci_said(label, text):
    """'<label> 0.87 (95% CI 0.81 to 0.95)' in the chapter's output -> (mean, lo, hi)."""
    return number(re.escape(label) + r"\s*(-?[\d.]+) \(95% CI (-?[\d.]+) to (-?[\d.]+)\)", text)


def assert_ci(x, said, tol=0.006):  # printed to two decimals
    got = (float(x.mean()), *interval(x))
    assert all(abs(g - s) < tol for g, s in zip(got, said)), (got, said)


def key_head(text):
    layer, head = number(r"head (\d+)\.(\d+) alone restores", text)
    return layer, head


def normalized(m, m_clean, m_corr):
    return (m - m_corr) / (m_clean - m_corr)


@pytest.fixture(scope="module")
def all_logits(hf_reference, pairs):
    """HF's last-position logits of every prompt, unpatched."""
    return hf_logits(hf_reference, pairs[0])


def with_head(hf, ids, layer, head, hd, values):
    """HF logits of `ids` with one head's output (o_proj's input columns) at the last position
    set to `values` [R, hd]."""
    cols = slice(head * hd, (head + 1) * hd)

    def put(x):  # [R, T, H*hd]
        x = x.clone()
        x[:, -1, cols] = values
        return x
    with Hooks() as hooks:
        hooks.replace(hf.model.layers[layer].self_attn.o_proj, put)
        return hf_logits(hf, ids)


def test_noising_ablation_and_every_ordered_pair_as_the_chapter_says(
        embedded, hf_reference, pairs, chapter, clean_runs, all_logits):
    ids, a, b, corr, _ = pairs
    seen, m_clean, m_corr = clean_runs
    _, text = chapter
    hf, hd, H = hf_reference, embedded.config.head_dim, embedded.config.n_heads
    layer, head = key_head(text)
    N = len(ids)
    z = seen[("z", layer)][:, -1].view(N, H, hd)  # [N, H, hd]: every prompt's heads
    first = a  # clean i is prompt i: its answer is a[i]

    # noising: the clean prompts with the corrupted prompts' head
    noised = m_of(with_head(hf, ids, layer, head, hd, z[corr, head]), a, b)
    removed = (m_clean - noised) / (m_clean - m_corr)
    assert_ci(removed, ci_said(f"noising, {N} pairs: removes", text))
    (said_noised,) = number(r"m goes from -?[\d.]+ to (-?[\d.]+), and the answer flips", text)
    assert abs(noised.mean() - said_noised) < 0.06 and noised.mean() < 0  # the answer flips

    # every ordered pair of two prompts, both ways
    I, J = torch.cartesian_prod(torch.arange(N), torch.arange(N)).T
    keep = I != J
    I, J = I[keep], J[keep]
    mc, mr = m_of(all_logits[I], first[I], first[J]), m_of(all_logits[J], first[I], first[J])
    den = m_of(with_head(hf, ids[J], layer, head, hd, z[I, head]), first[I], first[J])
    res_lg = with_head(hf, ids[I], layer, head, hd, z[J, head])
    res = m_of(res_lg, first[I], first[J])
    assert_ci((den - mr) / (mc - mr), ci_said(f"denoising, all {len(I)} ordered pairs: restores",
                                              text))
    assert_ci((mc - res) / (mc - mr), ci_said(f"noising, all {len(I)} ordered pairs: removes",
                                              text))

    # ablations: m and the right answers, as the chapter's table prints them
    rows = dict(re.findall(r"^\s+(zero|mean|resample)\s+(-?[\d.]+\s+\d+ of \d+)", text, re.M))
    zero_lg = with_head(hf, ids, layer, head, hd, torch.zeros(N, hd))
    mean_lg = with_head(hf, ids, layer, head, hd, z[:, head].mean(0).expand(N, hd))
    for kind, (m, right, total) in {
            "zero": (m_of(zero_lg, a, b), zero_lg.argmax(-1) == first, N),
            "mean": (m_of(mean_lg, a, b), mean_lg.argmax(-1) == first, N),
            "resample": (res, res_lg.argmax(-1) == first[I], len(I))}.items():
        said_m, said_right, said_total = rows[kind].replace(" of ", " ").split()
        assert abs(m.mean() - float(said_m)) < 0.006, (kind, float(m.mean()), said_m)
        assert (int(right.sum()), total) == (int(said_right), int(said_total)), kind
    # zero-ablation as a share of the gap between the clean and the corrupted m
    assert_ci((m_clean - m_of(zero_lg, a, b)) / (m_clean - m_corr),
              ci_said("zero-ablation removes", text))

    # the other heads of the layer, patched together, against the sum of their single patches
    rest = [h for h in range(H) if h != head]
    cols = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in rest])

    def put_rest(x):  # [N, T, H*hd]: the corrupted runs
        x = x.clone()
        x[:, -1, cols] = seen[("z", layer)][:, -1, cols]
        return x
    with Hooks() as hooks:
        hooks.replace(hf.model.layers[layer].self_attn.o_proj, put_rest)
        together = normalized(m_of(hf_logits(hf, ids[corr]), a, b), m_clean, m_corr)
    singles = sum(normalized(m_of(with_head(hf, ids[corr], layer, h, hd, z[:, h]), a, b),
                             m_clean, m_corr).mean() for h in rest)
    said_t, said_s = number(r"patched together, bring back (-?[\d.]+); the sum of their \d+ "
                            r"single patches is (-?[\d.]+)", text)
    assert abs(together.mean() - said_t) < 0.006 and abs(singles - said_s) < 0.006
    assert together.mean() < singles - 0.02  # patches need not add: here they do not


def test_the_heads_pattern_against_its_values_as_the_chapter_says(
        embedded, hf_reference, pairs, chapter, clean_runs):
    ids, a, b, corr, _ = pairs
    _, m_clean, m_corr = clean_runs
    _, text = chapter
    c = embedded.config
    hf, hd = hf_reference, c.head_dim
    layer, head = key_head(text)
    attn = hf.model.layers[layer].self_attn
    seen = {}
    with Hooks() as hooks:  # the clean runs: the layer's weights and values
        hooks.handles.append(attn.register_forward_hook(
            lambda mod, args, out: seen.__setitem__("weights", out[1])))
        hooks.capture(attn.v_proj, seen, "v", output=True)
        hf_logits(hf, ids)
    N, T = ids.shape
    pattern = seen["weights"][:, head, -1]  # [N, T]
    kv = head // c.n_rep
    v = seen["v"].view(N, T, c.n_kv_heads, hd)[:, :, kv]  # [N, T, hd]
    start = int((ids != ids[0]).any(0).nonzero()[0])
    (said_w,) = number(r"<country> ([\d.]+)", text)
    assert abs(pattern[:, start].mean() - said_w) < 0.006

    # the head's output with one half from the clean run: z = pattern @ values
    for half, z in [("its pattern restores", (pattern[:, None] @ v[corr])[:, 0]),
                    ("its values", (pattern[corr][:, None] @ v)[:, 0])]:
        m = m_of(with_head(hf, ids[corr], layer, head, hd, z), a, b)
        assert_ci(normalized(m, m_clean, m_corr), ci_said(half, text))

    # a uniform pattern over every key, in the clean runs: the values' mean
    m = m_of(with_head(hf, ids, layer, head, hd, v.mean(1)), a, b)
    assert_ci((m_clean - m) / (m_clean - m_corr), ci_said("keys, in the clean run: removes", text))

    # the country's weight moved to the first token, in the clean runs
    moved = pattern.clone()
    moved[:, 0] += moved[:, start]
    moved[:, start] = 0
    lg = with_head(hf, ids, layer, head, hd, (moved[:, None] @ v)[:, 0])
    assert_ci((m_clean - m_of(lg, a, b)) / (m_clean - m_corr),
              ci_said("the first token, in the clean run: removes", text))
    (said_right,) = number(r"the first token, in the clean run: removes .*?,\n(\d+) of", text)
    assert int((lg.argmax(-1) == a).sum()) == said_right


def test_the_head_fed_values_from_earlier_streams_as_the_chapter_says(
        embedded, hf_reference, pairs, chapter, clean_runs):
    """The head's values computed from the stream entering layer k (HF's hidden states, through
    the head's layer's input norm and v_proj), its clean pattern kept: m and the share kept."""
    ids, a, b, _, _ = pairs
    _, m_clean, m_corr = clean_runs
    _, text = chapter
    c = embedded.config
    hf, hd = hf_reference, c.head_dim
    layer, head = key_head(text)
    attn = hf.model.layers[layer].self_attn
    seen = {}
    with Hooks() as hooks:
        hooks.handles.append(attn.register_forward_hook(
            lambda mod, args, out: seen.__setitem__("weights", out[1])))
        with torch.no_grad():
            hidden = hf(ids, output_hidden_states=True).hidden_states  # entering each layer
    pattern = seen["weights"][:, head, -1]  # [N, T]
    kv = head // c.n_rep
    table = re.search(r"entering layer k, in the clean run.*?\n(.*?)\n\n",
                      text, re.S).group(1)
    rows = re.findall(r"^\s+(\d+)\s+(-?[\d.]+)\s+(-?[\d.]+) \(95% CI (-?[\d.]+) to "
                      r"(-?[\d.]+)\)$", table, re.M)
    assert len(rows) >= 4 and int(rows[-1][0]) == layer
    for k, said_m, *said_kept in rows:
        with torch.no_grad():
            v = attn.v_proj(hf.model.layers[layer].input_layernorm(hidden[int(k)]))
        v = v.view(*ids.shape, c.n_kv_heads, hd)[:, :, kv]  # [N, T, hd]
        m = m_of(with_head(hf, ids, layer, head, hd, (pattern[:, None] @ v)[:, 0]), a, b)
        assert abs(m.mean() - float(said_m)) < 0.006, (k, float(m.mean()), said_m)
        assert_ci(normalized(m, m_clean, m_corr), tuple(map(float, said_kept)))


def replace_at(module, pos, values, rows=None):
    """A forward hook: the module's output at position pos, in `rows`, becomes values."""
    def hook(mod, args, out):
        out = out.clone()
        r = slice(None) if rows is None else rows
        out[r, pos] = values
        return out
    return module.register_forward_hook(hook)


def test_per_sublayer_tracing_at_the_country_as_the_chapter_says(
        embedded, hf_reference, pairs, chapter, clean_runs):
    ids, a, b, corr, _ = pairs
    _, m_clean, m_corr = clean_runs
    _, text = chapter
    hf = hf_reference
    N = len(ids)
    start = int((ids != ids[0]).any(0).nonzero()[0])
    (flip,) = number(r"does it from the stream entering layer (\d+) on", text)
    layers = hf.model.layers[:flip]
    outs = {}
    with Hooks() as hooks:  # every prompt's attention and MLP outputs at the country
        for l, layer in enumerate(layers):
            hooks.capture(layer.self_attn.o_proj, outs, ("attn", l), output=True)
            hooks.capture(layer.mlp, outs, ("mlp", l), output=True)
        hf_logits(hf, ids)

    def effect(patches, runs, src):
        """patches: [(kind, layer)]; runs the prompts `runs` with those outputs from `src`."""
        with Hooks() as hooks:
            for kind, l in patches:
                mod = layers[l].self_attn.o_proj if kind == "attn" else layers[l].mlp
                hooks.handles.append(replace_at(mod, start, outs[(kind, l)][src, start]))
            return m_of(hf_logits(hf, ids[runs]), a, b)

    clean = torch.arange(N)
    mlp0 = normalized(effect([("mlp", 0)], corr, clean), m_clean, m_corr)
    assert_ci(mlp0, ci_said("mlp.down of layer 0 alone: restores", text))
    removed0 = (m_clean - effect([("mlp", 0)], clean, corr)) / (m_clean - m_corr)
    assert_ci(removed0, ci_said("mlp.down of layer 0, noising: removes", text))
    window = [("mlp", l) for l in range(1, flip)]
    assert_ci(normalized(effect(window, corr, clean), m_clean, m_corr),
              ci_said(f"mlp.down of layers 1-{flip - 1} together: restore", text))
    assert_ci((m_clean - effect(window, clean, corr)) / (m_clean - m_corr),
              ci_said("noising: remove", text))

    # every single sublayer after MLP 0: the largest MLP, and the attention outputs' size
    single = {(k, l): normalized(effect([(k, l)], corr, clean), m_clean, m_corr).mean()
              for k in ("attn", "mlp") for l in range(flip) if (k, l) != ("mlp", 0)}
    top, said_top = number(r"the largest, `(\d+)\.mlp`, restores (-?[\d.]+)", text)
    assert max(range(1, flip), key=lambda l: single[("mlp", l)]) == top
    assert abs(single[("mlp", top)] - said_top) < 0.006
    (said_attn,) = number(r"no attention output at that position more than ([\d.]+) in size",
                          text)
    assert abs(max(abs(single[("attn", l)]) for l in range(flip)) - said_attn) < 0.006


def test_the_heads_change_to_one_receiver_at_a_time_as_the_chapter_says(
        embedded, hf_reference, pairs, chapter, clean_runs):
    ids, a, b, corr, _ = pairs
    seen, m_clean, m_corr = clean_runs
    _, text = chapter
    hf, hd = hf_reference, embedded.config.head_dim
    L = embedded.config.n_layers
    layer, head = key_head(text)
    cols = slice(head * hd, (head + 1) * hd)
    W = hf.model.layers[layer].self_attn.o_proj.weight[:, cols]  # [D, hd]
    delta = (seen[("z", layer)][:, -1, cols] - seen[("z", layer)][corr, -1, cols]) @ W.T

    def add_delta(x):  # [N, T, D]: a norm's input, at the last position
        x = x.clone()
        x[:, -1] += delta
        return x

    def path(norms):
        """The corrupted runs with the head's change on these norms' inputs alone: the norm
        before an MLP, before an attention, or the final one."""
        with Hooks() as hooks:
            for norm in norms:
                hooks.replace(norm, add_delta)
            return normalized(m_of(hf_logits(hf, ids[corr]), a, b), m_clean, m_corr)

    layers = hf.model.layers
    mlps = [layers[l].post_attention_layernorm for l in range(layer, L)]
    attns = [layers[l].input_layernorm for l in range(layer + 1, L)]
    assert_ci(path([hf.model.norm]), ci_said("logits:", text))
    assert_ci(path(mlps), ci_said(f"MLPs {layer}-{L - 1}:", text))
    assert_ci(path(attns), ci_said(f"attention {layer + 1}-{L - 1}:", text))
    for l in range(layer, L):
        assert_ci(path([layers[l].post_attention_layernorm]), ci_said(f"MLP {l}:", text))


def test_the_heads_ov_circuit_ranks_the_capital_as_the_chapter_says(
        embedded, hf_reference, pairs, chapter):
    ids, a, _, _, countries = pairs
    _, text = chapter
    c = embedded.config
    hf, hd = hf_reference, c.head_dim
    layer, head = key_head(text)
    start = int((ids != ids[0]).any(0).nonzero()[0])
    with torch.no_grad():
        hidden = hf(ids, output_hidden_states=True).hidden_states  # entering each layer
        attn = hf.model.layers[layer].self_attn
        kv = head // c.n_rep
        W_V = attn.v_proj.weight[kv * hd:(kv + 1) * hd]  # [hd, D]
        W_O = attn.o_proj.weight[:, head * hd:(head + 1) * hd]  # [D, hd]

        def ranks(l):  # the capital's rank, the stream entering layer l through the circuit
            x = hf.model.layers[layer].input_layernorm(hidden[l][:, start])  # [N, D]
            lg = hf.lm_head(hf.model.norm((x @ W_V.T) @ W_O.T))  # [N, V]
            return ((lg > lg.gather(1, a[:, None])).sum(-1) + 1).tolist()

        early, late = ranks(1), ranks(layer)
    printed = dict((name, (int(r1), int(r2))) for name, r1, r2 in
                   re.findall(r"^\s+(\w+)\s+(\d+)\s+(\d+)$", text, re.M) if name in countries)
    assert printed == {c: (r1, r2) for c, r1, r2 in zip(countries, early, late)}
    assert sorted(early)[(len(early) - 1) // 2] <= sorted(late)[(len(late) - 1) // 2]

    # every head of every layer, from the stream entering layer 1, through HF's modules
    N, H = len(ids), c.n_heads
    with torch.no_grad():
        ranks = []
        for layer_l in hf.model.layers:
            x = layer_l.input_layernorm(hidden[1][:, start])  # [N, D]
            v = layer_l.self_attn.v_proj(x).view(N, c.n_kv_heads, hd)
            v = v.repeat_interleave(c.n_rep, 1)  # [N, H, hd]
            W = layer_l.self_attn.o_proj.weight.view(-1, H, hd)  # [D, H, hd]
            lg = hf.lm_head(hf.model.norm(torch.einsum("nhe,dhe->nhd", v, W)))  # [N, H, V]
            ranks.append((lg > lg.gather(2, a[:, None, None].expand(N, H, 1))).sum(-1) + 1)
        med = torch.stack(ranks, 1).median(0).values  # [L, H]: the lower median
    listed = re.search(r"median rank of the capital 40 or better: ([\d., ]+)\n", text).group(1)
    assert [f"{l}.{h}" for l, h in (med <= 40).nonzero().tolist()] == listed.split(", ")
    bl, bh, said_best = re.search(r"the best outside layer \d+: (\d+)\.(\d+), median rank "
                                  r"about ([\d,]+)", text).groups()
    outside = med.clone()
    outside[layer] = med.max() + 1
    assert divmod(int(outside.argmin()), H) == (int(bl), int(bh))
    assert f"{float(f'{float(outside.min()):.2g}'):,.0f}" == said_best


def test_the_massive_activations_control_as_the_chapter_says(
        embedded, hf_reference, pairs, chapter):
    ids, a, _, _, _ = pairs
    _, text = chapter
    hf = hf_reference
    massive, *dims = number(r"jumps in layer (\d+) to a largest value.*?Dimensions? "
                            r"(\d+) and (\d+) hold", text)
    cells = json.loads(CHAPTER.read_text())["cells"]
    src = next("".join(c["source"]) for c in cells if "texts = [" in "".join(c["source"]))
    begin = src.index("texts = [") + len("texts = ")
    texts = ast.literal_eval(src[begin:src.index("]", begin) + 1])
    D = embedded.config.hidden_size

    # random dimensions drawn as the chapter draws them, zeroed at the first position
    g = torch.Generator().manual_seed(0)
    pool = torch.tensor([d for d in range(D) if d not in dims])
    draws = torch.stack([pool[torch.randperm(len(pool), generator=g)[:len(dims)]]
                         for _ in range(8)])  # [8, dims]
    N = len(ids)
    rows = torch.arange(len(draws) * N)

    def zero(mod, args, out):  # [R, T, D]: the layer's output
        out = out.clone()
        out[rows[:, None], 0, draws.repeat_interleave(N, 0)] = 0
        return out
    h = hf.model.layers[massive].register_forward_hook(zero)
    try:
        right = (hf_logits(hf, ids[rows % N]).argmax(-1) == a[rows % N]).float().mean()
    finally:
        h.remove()
    (said,) = number(r"(\d+)% of the answers right", text)
    assert round(float(right) * 100) == said == 100

    # the mean over the texts' first positions against the prompts' own
    seen = {}
    with Hooks() as hooks:
        hooks.capture(hf.model.layers[massive], seen, "out", output=True)
        firsts = torch.cat([embedded.encode(s)[:, :1] for s in texts])
        hf_logits(hf, firsts)
        theirs = seen["out"][:, 0, dims].mean(0)
        hf_logits(hf, ids[:1])
        own = seen["out"][0, 0, dims]
    (said_gap,) = number(r"within ([\d.]+)% of the prompts' own values", text)

    # the size-matched control: position 0 moved as far as zero-ablation moves it, at random
    seen = {}
    with Hooks() as hooks:
        hooks.capture(hf.model.layers[massive], seen, "out", output=True)
        hf_logits(hf, ids)
    far = seen["out"][:, 0, dims].norm(dim=-1)  # [N]
    u = torch.randn(len(draws), D, generator=torch.Generator().manual_seed(1))
    u = u / u.norm(dim=-1, keepdim=True)

    def move(mod, args, out):  # [R, T, D]
        out = out.clone()
        out[:, 0] += far[rows % N, None] * u.repeat_interleave(N, 0)
        return out
    h = hf.model.layers[massive].register_forward_hook(move)
    try:
        moved = (hf_logits(hf, ids[rows % N]).argmax(-1) == a[rows % N]).float().mean()
    finally:
        h.remove()
    (said_moved,) = number(r"in a random direction, \d+ draws x \d+ prompts: (\d+)% right", text)
    assert round(float(moved) * 100) == said_moved
    assert abs(float(((theirs - own) / own).abs().max()) * 100 - said_gap) < 0.051


def test_what_builds_the_heads_pattern_as_the_chapter_says(
        embedded, hf_reference, pairs, chapter, clean_runs):
    """Path patching into the key head's query and key: each group of components the chapter
    lists (every attention output, every MLP output, a third of the layers before the head's)
    taken out of the stream that HF's q_proj reads at the last position, or k_proj at the
    country, the input norm recomputed, everything else as it was; the head's weight on the
    country, read from HF's attention weights."""
    ids, _, _, _, _ = pairs
    seen, _, _ = clean_runs
    _, text = chapter
    c = embedded.config
    hf, hd = hf_reference, c.head_dim
    layer, head = key_head(text)
    N, T = ids.shape
    start = int((ids != ids[0]).any(0).nonzero()[0])
    layers = hf.model.layers
    mlp_out = {}
    with Hooks() as hooks:
        for l in range(layer):
            hooks.capture(layers[l].mlp, mlp_out, l, output=True)
        hf_logits(hf, ids)
    with torch.no_grad():
        embed = hf.model.embed_tokens(ids)
    parts = {"embed": embed} | {f"{l}.attn": seen[("out", l)] for l in range(layer)} | {
        f"{l}.mlp": mlp_out[l] for l in range(layer)}  # each [N, T, D]
    x_in = seen[("in", layer)]  # [N, T, D]: the stream entering the head's layer
    assert torch.allclose(sum(parts.values()), x_in, atol=1e-3)  # the stream is their sum
    attn = layers[layer].self_attn

    def weight_on_country(side, removed):  # removed [N, D] at the side's position
        proj, pos, cols = ((attn.q_proj, T - 1, slice(head * hd, (head + 1) * hd))
                           if side == "query" else
                           (attn.k_proj, start, slice(head // c.n_rep * hd,
                                                      (head // c.n_rep + 1) * hd)))
        with torch.no_grad():
            new = proj(layers[layer].input_layernorm(x_in[:, pos] - removed))[:, cols]

        def put(mod, args, out):
            out = out.clone()
            out[:, pos, cols] = new
            return out
        got = {}
        with Hooks() as hooks:
            hooks.handles.append(proj.register_forward_hook(put))
            hooks.handles.append(attn.register_forward_hook(
                lambda mod, args, out: got.__setitem__("w", out[1])))
            hf_logits(hf, ids)
        return got["w"][:, head, -1, start].mean()

    for side, none, together, more in re.findall(
            r"from its (query|key) with this taken out \(none: ([\d.]+)\)\n.*\n  together: (.*)\n"
            r"\s+(layers .*)",
            text):
        assert abs(weight_on_country(side, torch.zeros_like(x_in[:, 0])) - float(none)) < 0.006
        listed = dict(item.rsplit(" ", 1) for item in (together + " " + more).split(", "))
        assert {"every attention", "every MLP"} <= set(listed), listed
        for group, said in listed.items():
            if group == "every attention":
                names = [n for n in parts if n.endswith(".attn")]
            elif group == "every MLP":
                names = [n for n in parts if n.endswith(".mlp")]
            else:
                first, last = map(int, group.removeprefix("layers ").split("-"))
                names = [n for n in parts
                         if n != "embed" and first <= int(n.split(".")[0]) <= last]
            removed = sum(parts[n][:, start if side == "key" else T - 1] for n in names)
            got = float(weight_on_country(side, removed))
            assert abs(got - float(said)) < 0.006, (side, group, got, said)


def test_the_key_head_across_relations_as_the_chapter_says(embedded, hf_reference, chapter):
    """The table "Does it generalise?": for each relation the chapter lists (its templates and
    answers read from the chapter's source), the prompts HF answers right, each answer once,
    paired with the next; then, with HF's o_proj input replaced at the last position, the
    printed best layer's heads patched together from the clean run, its best head alone, and
    that head's weight on the country from HF's attention weights."""
    cells = json.loads(CHAPTER.read_text())["cells"]
    src = next("".join(c["source"]) for c in cells if c.get("id") == "c14-gen")
    capitals, text = chapter
    tables = {"capitals": capitals}
    for name in ("languages", "currencies"):
        start = src.index(f"{name} = {{")
        tables[name] = ast.literal_eval(src[start + len(name) + 3:src.index("}", start) + 1])
    relations = re.findall(r'"([^"]+)": \("([^"]+)", (\w+)\)', src)
    assert len(relations) == 4, relations
    hf, c = hf_reference, embedded.config
    H, hd = c.n_heads, c.head_dim
    for row, template, table in relations:
        said = re.search(rf"^{re.escape(row)} +(\d+) +(\d+) \(([\d.]+)\) +(\d+)\.(\d+) "
                         rf"\(([\d.]+)\) +([\d.]+)$", text, re.M)
        assert said, f"the chapter's table no longer has the row {row!r}"
        n_said, layer, by_layer, l2, head, by_head, looks = said.groups()
        layer, head = int(layer), int(head)
        assert int(l2) == layer
        answers = tables[table]
        enc = {k: embedded.encode(template.replace("X", k)) for k in answers}
        T = enc[next(iter(answers))].shape[1]
        ok = [k for k in answers if enc[k].shape[1] == T]
        ans = {k: int(embedded.encode(template.replace("X", k) + " " + answers[k])[0, T])
               for k in ok}
        top = hf_logits(hf, torch.cat([enc[k] for k in ok])).argmax(-1).tolist()
        ok = [k for k, t in zip(ok, top) if t == ans[k]]
        ok = [k for i, k in enumerate(ok) if ans[k] not in [ans[d] for d in ok[:i]]]
        n = len(ok)
        assert n == int(n_said), (row, ok)
        ids = torch.cat([enc[k] for k in ok])
        a = torch.tensor([ans[k] for k in ok])
        b, corr = a.roll(-1), torch.arange(n).roll(-1)
        z, got = {}, {}
        o_proj = hf.model.layers[layer].self_attn.o_proj
        with Hooks() as hooks:
            hooks.capture(o_proj, z, "z")
            hooks.handles.append(hf.model.layers[layer].self_attn.register_forward_hook(
                lambda mod, args, out: got.__setitem__("w", out[1])))
            logits = hf_logits(hf, ids)
        m_clean, m_corr = m_of(logits, a, b), m_of(logits[corr], a, b)
        clean_z = z["z"][:, -1]  # [n, H*hd]

        def effect(cols):
            def put(x):
                x = x.clone()
                x[:, -1, cols] = clean_z[:, cols]
                return x
            with Hooks() as hooks:
                hooks.replace(o_proj, put)
                m = m_of(hf_logits(hf, ids[corr]), a, b)
            return float(normalized(m, m_clean, m_corr).mean())

        assert abs(effect(slice(None)) - float(by_layer)) < 0.006, row
        assert abs(effect(slice(head * hd, (head + 1) * hd)) - float(by_head)) < 0.006, row
        country = int((ids != ids[0]).any(0).nonzero()[0])
        weight = float(got["w"][:, head, -1, country].mean())
        assert abs(weight - float(looks)) < 0.006, row


def test_attribution_patching_as_the_chapter_says(embedded, hf_reference, pairs, chapter,
                                                   clean_runs):
    """Attribution patching through HF: the corrupted prompts run with autograd, the gradient of
    the pairs' m kept at each o_proj input (every head's output) and each layer's input (the
    stream), times the clean run's value minus the corrupted one's, normalized."""
    ids, a, b, corr, _ = pairs
    seen, m_clean, m_corr = clean_runs
    _, text = chapter
    hf, c = hf_reference, embedded.config
    H, hd, L = c.n_heads, c.head_dim, c.n_layers
    layer, head = key_head(text)
    N, T = ids.shape
    start = int((ids != ids[0]).any(0).nonzero()[0])
    kept = {}

    def keep(key):
        def hook(mod, args):
            args[0].retain_grad()
            kept[key] = args[0]
        return hook
    with Hooks() as hooks:
        for l, lyr in enumerate(hf.model.layers):
            hooks.handles.append(lyr.register_forward_pre_hook(keep(("in", l))))
            hooks.handles.append(lyr.self_attn.o_proj.register_forward_pre_hook(keep(("z", l))))
        with torch.enable_grad():
            logits = hf(ids[corr]).logits[:, -1]
            m = m_of(logits, a, b)
            assert torch.allclose(m.detach(), m_corr, atol=1e-4)
            m.sum().backward()
    hf.zero_grad(set_to_none=True)  # the weights' gradients: not this test's
    span = m_clean - m_corr  # [N]
    cols = slice(head * hd, (head + 1) * hd)
    dz = (seen[("z", layer)][:, -1] - seen[("z", layer)][corr, -1])[:, cols]  # [N, hd]
    head_attr = ((dz * kept[("z", layer)].grad[:, -1, cols]).sum(-1) / span).mean()
    exact_said, attr_said = number(r"head \d+\.\d+: exact ([\d.]+), attribution ([\d.]+)", text)
    assert abs(float(head_attr) - attr_said) < 0.006
    country = []
    for l in range(layer):
        dx = seen[("in", l)][:, start] - seen[("in", l)][corr, start]  # [N, D]
        country.append(((dx * kept[("in", l)].grad[:, start]).sum(-1) / span).mean())
    (said_attr,) = number(r"the country's stream, layers 0-\d+: exact [\d.]+, attribution "
                          r"([-\d.]+)", text)
    assert abs(float(torch.stack(country).mean()) - said_attr) < 0.006


def test_the_heads_qk_split_as_the_chapter_says(embedded, hf_reference, pairs, chapter,
                                                 clean_runs):
    """The country's lead in the key head's score, split by what wrote the query and what
    wrote the keys: HF's components (embed_tokens, every o_proj and mlp output before the head's
    layer), through its input norm with the divisor frozen, q_proj / k_proj and HF's own
    rotary tables, against the lead read off HF's attention weights."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ids, _, _, _, _ = pairs
    seen, _, _ = clean_runs
    _, text = chapter
    c = embedded.config
    hf, H, hd = hf_reference, c.n_heads, c.head_dim
    layer, head = key_head(text)
    N, T = ids.shape
    start = int((ids != ids[0]).any(0).nonzero()[0])
    layers = hf.model.layers
    mlp_out, got = {}, {}
    attn = layers[layer].self_attn
    with Hooks() as hooks:
        for l in range(layer):
            hooks.capture(layers[l].mlp, mlp_out, l, output=True)
        hooks.handles.append(attn.register_forward_hook(
            lambda mod, args, out: got.__setitem__("w", out[1])))
        hf_logits(hf, ids)
    with torch.no_grad():
        embed = hf.model.embed_tokens(ids)
    names = ["embed"] + [f"{l}.{s}" for l in range(layer) for s in ("attn", "mlp")]
    parts = torch.stack([embed] + [seen[("out", l)] if s == "attn" else mlp_out[l]
                                   for l in range(layer) for s in ("attn", "mlp")])
    x_in = seen[("in", layer)]
    norm = layers[layer].input_layernorm
    rms = (x_in.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
    normed = parts * norm.weight / rms  # [P, N, T, D]
    P = len(names)
    cos, sin = hf.model.rotary_emb(x_in, torch.arange(T)[None])
    with torch.no_grad():
        q = normed @ attn.q_proj.weight[head * hd:(head + 1) * hd].T  # [P, N, T, hd]
        kv = head // c.n_rep
        k = normed @ attn.k_proj.weight[kv * hd:(kv + 1) * hd].T
        q, k = apply_rotary_pos_emb(q.flatten(0, 1)[:, None], k.flatten(0, 1)[:, None],
                                    cos, sin)
    q, k = q[:, 0].view(P, N, T, hd)[:, :, -1], k[:, 0].view(P, N, T, hd)
    others = [p for p in range(T) if p != start]
    k_lead = k[:, :, start] - k[:, :, others].mean(2)
    qk = torch.einsum("and,bnd->nab", q, k_lead) / hd ** 0.5  # [N, P, P]
    w = got["w"][:, head, -1]  # [N, T]
    lead = (w[:, start, None].log() - w[:, others].log()).mean(-1)
    said_lead, said_sum = number(r"the country's score ahead of the other positions' mean: "
                                 r"([\d.]+)\n  the sum of the \d+ x \d+ terms: ([\d.]+)", text)
    assert abs(float(lead.mean()) - said_lead) < 0.006
    assert abs(float(qk.sum((1, 2)).mean()) - said_sum) < 0.006
    kind = ["embed"] + [n.split(".")[1] for n in names[1:]]
    qs = [i for i, n in enumerate(kind) if n == "attn"]
    ks = [i for i, n in enumerate(kind) if n == "mlp"]
    (attn_mlp,) = number(r"\n +attn +-?[\d.]+ +-?[\d.]+ +(-?[\d.]+)\n", text)
    assert abs(float(qk[:, qs][:, :, ks].sum((1, 2)).mean()) - attn_mlp) < 0.006
    top = qk.mean(0).flatten().argmax()
    q_name, k_name, value = re.search(r"the largest terms: ([\w.]+) x ([\w.]+) ([\d.]+)",
                                      text).groups()
    assert (names[int(top) // P], names[int(top) % P]) == (q_name, k_name)
    assert abs(float(qk.mean(0).flatten()[top]) - float(value)) < 0.006
