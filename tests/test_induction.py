"""Chapter 15's headline numbers, measured a second way: HF transformers' LlamaForCausalLM, eager
attention, on the same fp32 weights, with forward hooks, against what the chapter printed (its
committed outputs):

- the loss on each copy of the repeated random tokens, and the top heads by each score;
- mean-ablation of the induction heads, of the previous-token heads and of the control draws (each
  head's columns of o_proj's input replaced by their mean over the second batch);
- path patching into the receiving head's key and query (the input of HF's k_proj or q_proj
  recomputed from the stream with one earlier head's output replaced by its mean);
- the previous-token head without RoPE (cos 1, sin 0 handed to its attention) and with every
  position moved as far on as the chapter moves it (HF's own rotary tables for those positions);
- the faithfulness of the smallest circuit (every other head ablated).
"""

import json
import re
from pathlib import Path

import pytest
import torch

CHAPTER = Path(__file__).resolve().parents[1] / "notebooks" / "15_induction.ipynb"


@pytest.fixture(scope="module")
def chapter():
    cells = json.loads(CHAPTER.read_text())["cells"]
    src = {c["id"]: "".join(c["source"]) for c in cells}
    text = "\n".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/markdown", ""))
                     for c in cells for o in c.get("outputs", []))
    return src, text


def said(pattern, text):
    m = re.search(pattern, text, re.M)
    assert m, f"the chapter's output no longer says {pattern!r}"
    return m.groups()


class Run:
    """HF's model with hooks: each layer's attention weights captured; o_proj, k_proj or q_proj
    inputs replaced where asked."""

    def __init__(self, hf):
        self.hf, self.handles, self.weights = hf, [], {}

    def pre(self, module, fn, kwargs=False):
        self.handles.append(module.register_forward_pre_hook(fn, with_kwargs=kwargs))

    def __call__(self, ids):
        for l, layer in enumerate(self.hf.model.layers):
            self.handles.append(layer.self_attn.register_forward_hook(
                lambda mod, args, out, l=l: self.weights.__setitem__(l, out[1])))
        try:
            with torch.no_grad():
                return self.hf(ids).logits
        finally:
            for h in self.handles:
                h.remove()


def loss_of(logits, ids):
    return -logits[:, :-1].log_softmax(-1).gather(2, ids[:, 1:, None])[..., 0]


@pytest.fixture(scope="module")
def setup(embedded, hf_reference, chapter):
    src, text = chapter
    B, R = map(int, re.search(r"B, R = (\d+), (\d+)", src["c15-data"]).groups())
    V = embedded.config.vocab_size
    first = torch.randint(1000, V, (B, R), generator=torch.Generator().manual_seed(0))
    ref_first = torch.randint(1000, V, (B, R), generator=torch.Generator().manual_seed(1))
    ids, ref = torch.cat([first, first], 1), torch.cat([ref_first, ref_first], 1)
    hf = hf_reference
    run = Run(hf)
    logits = run(ids)
    W = torch.stack([run.weights[l] for l in range(len(hf.model.layers))])  # [L, B, H, T, T]
    z_ref = {}
    ref_run = Run(hf)
    for l, layer in enumerate(hf.model.layers):
        ref_run.pre(layer.self_attn.o_proj, lambda m, a, l=l: z_ref.__setitem__(l, a[0]))
    ref_run(ref)
    means = {l: z.mean(0) for l, z in z_ref.items()}  # [T, H*hd]: per position
    return dict(B=B, R=R, ids=ids, logits=logits, W=W, means=means, hf=hf, text=text)


def heads(text, kind):
    (listed,) = said(rf"^  {kind}:\s+(.*)$", text)
    return [(int(l), int(h), float(s)) for l, h, s in re.findall(r"(\d+)\.(\d+): ([\d.]+)", listed)]


def ablated_loss(s, hd, H, ablate, copy="second"):
    """The second (or first) copy's mean loss with these (layer, head)s mean-ablated, through
    HF."""
    run = Run(s["hf"])
    for l in sorted({l for l, _ in ablate}):
        cols = torch.cat([torch.arange(h * hd, (h + 1) * hd) for m, h in ablate if m == l])

        def put(mod, args, l=l, cols=cols):
            x = args[0].clone()
            x[..., cols] = s["means"][l][:, cols]
            return (x,)
        run.pre(s["hf"].model.layers[l].self_attn.o_proj, put)
    R = s["R"]
    loss = loss_of(run(s["ids"]), s["ids"])
    return float((loss[:, R:] if copy == "second" else loss[:, :R - 1]).mean())


def test_the_loss_and_the_heads_scores_as_the_chapter_says(embedded, setup):
    s, R = setup, setup["R"]
    loss = loss_of(s["logits"], s["ids"])
    first, second = map(float, said(r"first copy:\s+([\d.]+)\n.*second copy:\s+([\d.]+)",
                                    s["text"]))
    assert abs(float(loss[:, :R - 1].mean()) - first) < 0.051
    assert abs(float(loss[:, R:].mean()) - second) < 0.051
    T, H = 2 * R, embedded.config.n_heads
    i, j = torch.arange(1, T), torch.arange(R, T)
    scores = {"previous-token": s["W"][..., i, i - 1].mean((1, 3)),
              "induction": s["W"][..., j, j - R + 1].mean((1, 3))}
    for kind, score in scores.items():
        listed = heads(s["text"], kind)
        top = [divmod(int(n), H) for n in score.flatten().topk(len(listed)).indices]
        assert top == [(l, h) for l, h, _ in listed], kind
        for l, h, v in listed:
            assert abs(float(score[l, h]) - v) < 0.006, (kind, l, h)


def test_the_ablations_and_their_control_as_the_chapter_says(embedded, setup):
    s, c = setup, embedded.config
    H, hd = c.n_heads, c.head_dim
    prev = [(l, h) for l, h, _ in heads(s["text"], "previous-token")]
    ind = [(l, h) for l, h, _ in heads(s["text"], "induction")]
    groups = [("the induction heads", ind), ("the previous-token heads", prev)] + [
        (f"previous-token head {l}.{h} alone", [(l, h)]) for l, h in prev]
    for name, group in groups:
        on_first, on_second = said(rf"^  {re.escape(name)} +([\d.]+) +([\d.]+)$", s["text"])
        assert abs(ablated_loss(s, hd, H, group) - float(on_second)) < 0.051, name
        assert abs(ablated_loss(s, hd, H, group, "first") - float(on_first)) < 0.051, name
    others = [(l, h) for l in range(c.n_layers) for h in range(H) if (l, h) not in prev + ind]
    g = torch.Generator().manual_seed(2)
    draws = [[others[n] for n in torch.randperm(len(others), generator=g)[:len(ind)]]
             for _ in range(5)]
    got = [ablated_loss(s, hd, H, d) for d in draws]
    lo, hi = map(float, said(r"other heads, \d+ draws +([\d.]+) to ([\d.]+)", s["text"]))
    assert abs(min(got) - lo) < 0.051 and abs(max(got) - hi) < 0.051


def test_path_patching_into_the_key_and_query_as_the_chapter_says(embedded, setup):
    s, c = setup, embedded.config
    H, hd, D, R = c.n_heads, c.head_dim, c.hidden_size, setup["R"]
    l2, h2 = map(int, said(r"head (\d+)\.(\d+)'s induction score, clean", s["text"]))
    hf = s["hf"]
    hidden = {}
    run = Run(hf)
    z = {}
    for l, layer in enumerate(hf.model.layers[:l2 + 1]):
        run.pre(layer, lambda m, a, l=l: hidden.__setitem__(l, a[0]))
        run.pre(layer.self_attn.o_proj, lambda m, a, l=l: z.__setitem__(l, a[0]))
    run(s["ids"])
    x_in = hidden[l2]
    layer2 = hf.model.layers[l2]
    T = 2 * R
    j = torch.arange(R, T)

    def score_with(side, sender):
        l, h = sender
        o = hf.model.layers[l].self_attn.o_proj.weight[:, h * hd:(h + 1) * hd]  # [D, hd]
        cols = slice(h * hd, (h + 1) * hd)
        cut = x_in - z[l][..., cols] @ o.T + s["means"][l][:, cols] @ o.T
        with torch.no_grad():
            normed = layer2.input_layernorm(cut)
        proj = layer2.self_attn.k_proj if side == "key" else layer2.self_attn.q_proj
        r = Run(hf)
        r.pre(proj, lambda m, a: (normed,))
        r(s["ids"])
        return float(r.weights[l2][:, h2][:, j, j - R + 1].mean())

    for side in ("key", "query"):
        (listed,) = said(rf"^  its {side}\s+(.*)$", s["text"])
        for l, h, v in re.findall(r"(\d+)\.(\d+): ([\d.]+)", listed)[:2]:
            assert abs(score_with(side, (int(l), int(h))) - float(v)) < 0.006, (side, l, h)


def test_the_previous_token_head_without_rope_and_moved_as_the_chapter_says(embedded, setup):
    s, R = setup, setup["R"]
    lp, hp = map(int, said(r"head (\d+)\.(\d+), the mean weight on the token before",
                           s["text"]))
    as_ran, plain, shift, moved = said(
        r"as it ran +([\d.]+)\n +without the rotation +([\d.]+)\n +every position ([\d,]+) on"
        r" +([\d.]+)", s["text"])
    as_ran, plain, moved = float(as_ran), float(plain), float(moved)
    shift = int(shift.replace(",", ""))
    hf, T = s["hf"], 2 * R
    i = torch.arange(1, T)
    attn = hf.model.layers[lp].self_attn

    def weight(position_embeddings):
        r = Run(hf)

        def swap(mod, args, kwargs):
            if position_embeddings is not None:
                kwargs["position_embeddings"] = position_embeddings(kwargs["position_embeddings"])
            return args, kwargs
        r.pre(attn, swap, kwargs=True)
        r(s["ids"])
        return r.weights[lp][:, hp]

    clean = weight(None)
    assert abs(float(clean[:, i, i - 1].mean()) - as_ran) < 0.006
    unrotated = weight(lambda cs: (torch.ones_like(cs[0]), torch.zeros_like(cs[1])))
    assert abs(float(unrotated[:, i, i - 1].mean()) - plain) < 0.006
    x = torch.zeros(1, T, embedded.config.hidden_size)
    far = hf.model.rotary_emb(x, torch.arange(shift, shift + T)[None])
    shifted = weight(lambda cs: far)
    assert abs(float(shifted[:, i, i - 1].mean()) - moved) < 0.006
    assert float((shifted - clean).abs().max()) < 1e-4


def test_the_smallest_circuits_faithfulness_as_the_chapter_says(embedded, setup):
    s, c = setup, embedded.config
    H, hd, L, R = c.n_heads, c.head_dim, c.n_layers, setup["R"]
    (all_said,) = said(r"every head ablated ([\d.]+)", s["text"])
    n, share = said(r"^ +(\d+) +[\d.]+ +([\d.]+)$", s["text"])  # the first row: the smallest
    T = 2 * R
    i, j = torch.arange(1, T), torch.arange(R, T)
    prev, ind = s["W"][..., i, i - 1].mean((1, 3)), s["W"][..., j, j - R + 1].mean((1, 3))
    k = int(n) // 2
    circuit = {divmod(int(x), H) for x in prev.flatten().topk(k).indices} | {
        divmod(int(x), H) for x in ind.flatten().topk(k).indices}
    assert len(circuit) == int(n)
    every = [(l, h) for l in range(L) for h in range(H)]
    gone = ablated_loss(s, hd, H, every)
    assert abs(gone - float(all_said)) < 0.051
    kept = ablated_loss(s, hd, H, [x for x in every if x not in circuit])
    clean = float(loss_of(s["logits"], s["ids"])[:, R:].mean())
    assert abs((gone - kept) / (gone - clean) - float(share)) < 0.006
