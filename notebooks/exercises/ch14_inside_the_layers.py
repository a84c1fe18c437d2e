"""Chapter 14: a patch, a patching sweep, noising a head, one head's direct logit attribution,
and a head's QK terms."""

import torch

from llmtrace_book.errors import LlmTraceError
from llmtrace_book.trace import Patched

from .registry import PROMPT, Case, Edited, ReturnedNone, Stub, caller, copy_inputs, edited, \
    exercise, is_stub, run, trace_of
from .verdicts import shape, tensor_compare, with_rtol

OTHER = "The capital of Germany is"  # the corrupted prompt


def patch_country(stream: torch.Tensor, other: torch.Tensor, pos: int) -> torch.Tensor:
    """An activation patch. stream [1, T, D]: the residual stream of the France prompt as it
    flows through the model; other [1, T, D]: the same tensor from the Germany prompt; pos: the
    country's position. -> a new tensor: `stream` with `other`'s vector at `pos`."""
    out = stream.clone()  # the trace keeps the original: do not change it in place
    out[:, pos] = other[:, pos]
    return out


def head_logit_attribution(acts: dict, weights, config, layer: int, head: int, clean: int,
                           corrupt: int) -> float:
    """One head's direct logit attribution (chapter 14's), for the France prompt. acts: the
    traced run's tensors by name (every record of `layers.{layer}.` and `final_norm.mean_sq`);
    weights, config: the model's; layer, head: the head; clean, corrupt: the token ids of the
    two answers (" Paris", " Berlin") -> a float: what the head's output at the last position
    adds to m = logit(clean) - logit(corrupt) straight through the final norm, whose divisor
    (its RMS) is frozen as it was in the run, and the LM head. The head writes its own columns
    of o_proj times its output z (`attn.weighted_sum`); with sandwich_norm (Gemma), through the
    norm after attention too, its divisor frozen the same way."""
    c, w = config, weights.layers[layer]
    D, H, hd = c.hidden_size, c.n_heads, c.head_dim
    one = 1.0 if c.norm_offset else 0.0  # Gemma's norms scale by (1 + weight)
    z = acts[f"layers.{layer}.attn.weighted_sum"][0, head, -1]  # [hd]: last position
    out = w.o_proj.view(D, H, hd)[:, head] @ z  # [D]: the head's columns of o_proj, times z
    if c.sandwich_norm:  # Gemma: through the norm after attention, its divisor frozen
        ms = acts[f"layers.{layer}.attn_post_norm.mean_sq"][0, -1]  # [1]
        out = out * (w.post_attn_norm + one) / (ms + c.norm_eps).sqrt()  # [D]
    rms = (acts["final_norm.mean_sq"][0, -1] + c.norm_eps).sqrt()  # [1]: frozen
    u = weights.lm_head[clean] - weights.lm_head[corrupt]  # [D]: the two answers' rows
    direction = (weights.final_norm + one) * u / rms  # [D]
    return float(out @ direction)  # a dot product: the head's share of m


def answers(model) -> tuple[int, int]:
    """The first token of " Paris" after the France prompt and of " Berlin" after Germany's."""
    T, T2 = model.encode(PROMPT).shape[1], model.encode(OTHER).shape[1]
    return (int(model.encode(f"{PROMPT} Paris")[0, T]),
            int(model.encode(f"{OTHER} Berlin")[0, T2]))


def all_heads(model, trace, a, b):
    """[L, H]: every head's direct term, as chapter 14 computes it (one einsum per layer),
    and the check that the heads of a layer sum to its attention's direct term."""
    c, w = model.config, model.weights
    D, H, hd, eps = c.hidden_size, c.n_heads, c.head_dim, c.norm_eps
    one = 1.0 if c.norm_offset else 0.0
    rms = (trace["final_norm.mean_sq"][0, -1] + eps).sqrt()
    direction = (w.final_norm + one) * (w.lm_head[a] - w.lm_head[b]) / rms  # [D]
    rows = []
    for l, lw in enumerate(w.layers):
        z = trace[f"layers.{l}.attn.weighted_sum"][0, :, -1]  # [H, hd]
        head_out = torch.einsum("he,dhe->hd", z, lw.o_proj.view(D, H, hd))  # [H, D]
        added = trace[f"layers.{l}.attn.out"][0, -1]  # [D]
        if c.sandwich_norm:
            post = (lw.post_attn_norm + one) / (
                trace[f"layers.{l}.attn_post_norm.mean_sq"][0, -1] + eps).sqrt()
            head_out, added = head_out * post, added * post
        if not torch.allclose(head_out.sum(0), added, atol=1e-4, rtol=1e-4):
            raise LlmTraceError(f"layer {l}'s heads do not add up to its attn.out")
        rows.append(head_out @ direction)  # [H]
    return torch.stack(rows)  # [L, H]


def _dla_variant(mistake):
    def dla(acts, weights, c, layer, head, clean, corrupt):
        w = weights.layers[layer]
        D, H, hd = c.hidden_size, c.n_heads, c.head_dim
        one = 1.0 if c.norm_offset else 0.0
        z = acts[f"layers.{layer}.attn.weighted_sum"][0, head, 0 if mistake == "first" else -1]
        out = w.o_proj.view(D, H, hd)[:, head] @ z
        if c.sandwich_norm:
            ms = acts[f"layers.{layer}.attn_post_norm.mean_sq"][0, -1]
            out = out * (w.post_attn_norm + one) / (ms + c.norm_eps).sqrt()
        rms = (acts["final_norm.mean_sq"][0, -1] + c.norm_eps).sqrt()
        if mistake == "own_rms":
            rms = (out.pow(2).mean() + c.norm_eps).sqrt()
        u = weights.lm_head[clean] - weights.lm_head[corrupt]
        gain = 1.0 + one if mistake == "no_gain" else weights.final_norm + one
        return float(out @ (gain * u / rms))
    return dla


@exercise(14, patch_country)
def _(model) -> Case:
    ids, other_ids = model.encode(PROMPT), model.encode(OTHER)  # [1, T] each
    differ = (ids != other_ids).nonzero() if ids.shape == other_ids.shape else []
    if len(differ) != 1:
        raise LlmTraceError(f"{model.name}'s tokenizer does not split {PROMPT!r} and {OTHER!r} "
                            "into the same number of tokens differing in one")
    pos = int(differ[0, 1])
    L = model.config.n_layers
    name = f"layers.{max(L // 2 - 1, 0)}.resid_out"  # the stream entering the middle layer
    other = model.run(other_ids, names=[name])[1][name]  # [1, T, D]
    stream = trace_of(model)[name]

    def call(fn):
        run(fn, stream, other, pos, names=["stream", "other", "pos"])  # a stub, an edit: here

        def patch(t):
            before = t.clone()
            out = fn(t, other.clone(), pos)
            if not torch.equal(t, before):
                raise Edited("your function changed `stream` in place: the stream the model "
                             "passes on is the one you return; copy it first (stream.clone())")
            return out
        logits, _ = model.run(ids, keep_values=False, patch={name: patch})
        return logits  # [1, T, V]

    T = ids.shape[1]
    mistakes = [(lambda s, o, p: o.clone(), "patch only the country's position, pos"),
                (lambda s, o, p: patch_country(s, o, T - 1),
                 "patch the country's position, pos, not the last one"),
                (lambda s, o, p: patch_country(s, o, p - 1), "the position is off by one: "
                                                             "the country is at pos"),
                (lambda s, o, p: patch_country(s, o, min(p + 1, T - 1)),
                 "the position is off by one: the country is at pos")]
    want = call(patch_country)
    return Case(call, want, f"the patched logits {shape(want)}", tensor_compare(1e-4), mistakes)


@exercise(14, head_logit_attribution)
def _(model) -> Case:
    trace, c = trace_of(model), model.config
    a, b = answers(model)
    grid = all_heads(model, trace, a, b)  # [L, H]
    top = divmod(int(grid.abs().flatten().argmax()), c.n_heads)
    heads = list(dict.fromkeys([top, (c.n_layers - 1, 0), (0, c.n_heads - 1)]))
    want = [float(grid[l, h]) for l, h in heads]
    layers = {l for l, _ in heads}
    acts = {r.name: r.tensor for r in trace.records if r.tensor is not None and (
        r.name == "final_norm.mean_sq" or any(r.name.startswith(f"layers.{l}.")
                                              for l in layers))}
    names = ["acts", "weights", "config", "layer", "head", "clean", "corrupt"]

    def call(fn):
        args = (acts, model.weights, c)
        copies = copy_inputs(args)
        out = []
        for l, h in heads:
            got = fn(*copies, l, h, a, b)
            if got is None:
                raise Stub if is_stub(fn) else ReturnedNone
            out.append(float(got.item() if isinstance(got, torch.Tensor) else got))
        for name, before, after in zip(names, args, copies):
            if (hit := edited(before, after, name)):
                raise Edited(f"your function changed its input `{hit}` in place: work on a "
                             f"copy (`.clone()`)")
        return out

    scale = max(abs(x) for x in want)

    def compare(got, want):
        for (l, h), g, w in zip(heads, got, want):
            if abs(g - w) > 1e-4 * scale:
                return f"head {h} of layer {l}: wanted {w:.4g}, got {g:.4g}"
        return None
    return Case(call, want, f"{len(heads)} heads' direct terms",
                with_rtol(compare, 1e-4), [
                    (_dla_variant("own_rms"), "freeze the final norm's divisor as it was in the "
                                              "run, sqrt(final_norm.mean_sq + eps), not the RMS "
                                              "of the head's output alone"),
                    (_dla_variant("no_gain"), "the final norm's gain (its weight) is missing "
                                              "from the direction"),
                    (_dla_variant("first"), "the answer is read at the LAST position: "
                                            "z = weighted_sum[0, head, -1]"),
                    (lambda *a: -head_logit_attribution(*a),
                     "the sign is flipped: m = logit(clean) - logit(corrupt)")])


def patch_sweep(run_patched, n_layers: int, positions: list) -> torch.Tensor:
    """An activation-patching sweep. run_patched(layer, pos) -> a float: the normalized effect
    of one patched run (the Germany prompt, with the France prompt's residual stream written in
    as it enters `layer`, at position `pos`; 0 the corrupted run, 1 the clean one); n_layers and
    positions: what to sweep -> a tensor [n_layers, len(positions)]: row l, column i the effect
    of patching layer l at positions[i]."""
    return torch.tensor([[run_patched(l, pos) for pos in positions] for l in range(n_layers)])


def _streams(model, trace):
    L = model.config.n_layers
    start = "embed.scaled" if "embed.scaled" in trace else "embed"
    return [start] + [f"layers.{l}.resid_out" for l in range(L - 1)]  # entering each layer


@exercise(14, patch_sweep)
def _(model) -> Case:
    ids, other_ids = model.encode(PROMPT), model.encode(OTHER)  # [1, T] each
    if ids.shape != other_ids.shape:
        raise LlmTraceError(f"{model.name}'s tokenizer splits {PROMPT!r} and {OTHER!r} into "
                            "different numbers of tokens")
    T, L = ids.shape[1], model.config.n_layers
    pos = int((ids != other_ids).nonzero()[0, 1])  # the country
    positions = [pos, T - 1]
    a, b = answers(model)
    trace = trace_of(model)
    streams = _streams(model, trace)
    logits_c = model.run(ids, keep_values=False)[0][0, -1]
    logits_r = model.run(other_ids, keep_values=False)[0][0, -1]
    m_clean, m_corr = float(logits_c[a] - logits_c[b]), float(logits_r[a] - logits_r[b])

    # every (layer, position) patched once, in one batched pass (a row each): run_patched
    # reads its run's effect from there
    grid = [(l, p) for l in range(L) for p in range(T)]
    patch = {}
    for l in range(L):
        rows = [r for r, (m, _) in enumerate(grid) if m == l]

        def put(t, rows=rows, name=streams[l]):
            t = t.clone()  # [rows, T, D]
            for r in rows:
                t[r, grid[r][1]] = trace[name][0, grid[r][1]]
            return t
        patch[streams[l]] = put
    lg = model.forward(other_ids.expand(len(grid), -1), Patched(patch))[:, -1]  # [rows, V]
    effect = dict(zip(grid, ((lg[:, a] - lg[:, b] - m_corr) / (m_clean - m_corr)).tolist()))

    def run_patched(layer, at):
        return effect[layer, at]

    def call(fn):
        return run(fn, run_patched, L, list(positions),
                   names=["run_patched", "n_layers", "positions"])
    want = call(patch_sweep)
    return Case(call, want, f"the sweep {shape(want)}", tensor_compare(1e-4), [
        (lambda r, n, ps: patch_sweep(r, n, ps).T,
         "rows are the layers, columns the positions: [n_layers, len(positions)]"),
        (lambda r, n, ps: torch.tensor([[r(l, i) for i in range(len(ps))] for l in range(n)]),
         "patch at the positions given, positions[i], not at i")])


def qk_terms(q_parts: torch.Tensor, k_parts: torch.Tensor, scale: float) -> torch.Tensor:
    """A QK attribution. q_parts [P, hd]: the share of each of P components of the stream (the
    embedding, every attention and MLP output before the head's layer) in one head's query at the
    last position, through the norm (its divisor frozen as it was in the run), W_Q and the
    rotation of that position; k_parts [P, hd]: each component's share of the country's key minus
    the other positions' mean key, the same way; scale: the attention's scale (1 / sqrt(hd) in a
    Llama) -> [P, P]: row a, column b the term (q_parts[a] . k_parts[b]) * scale. Their sum is
    the country's lead in the head's score over the other positions' mean."""
    return q_parts @ k_parts.T * scale  # [P, P]


@exercise(14, qk_terms)
def _(model) -> Case:
    from llmtrace_book.rope import apply_rope

    trace, c, w = trace_of(model), model.config, model.weights
    ids, other_ids = model.encode(PROMPT), model.encode(OTHER)
    T, H, hd = ids.shape[1], c.n_heads, c.head_dim
    pos = int((ids != other_ids).nonzero()[0, 1]) if ids.shape == other_ids.shape else 0
    # the head that looks most at the country from the last position, past layer 0
    look = torch.stack([trace[f"layers.{l}.attn.weights"][0, :, -1, pos]
                        for l in range(1, c.n_layers)])  # [L - 1, H]
    layer, head = divmod(int(look.flatten().argmax()), H)
    layer += 1
    one = 1.0 if c.norm_offset else 0.0
    add = ("attn_post_norm", "mlp_post_norm") if c.sandwich_norm else ("attn.out", "mlp.down")
    parts = torch.stack([trace[_streams(model, trace)[0]][0]] + [
        trace[f"layers.{l}.{n}"][0] for l in range(layer) for n in add])  # [P, T, D]
    x_in = trace[_streams(model, trace)[layer]][0]  # [T, D]
    rms = (x_in.pow(2).mean(-1, keepdim=True) + c.norm_eps).sqrt()  # [T, 1]: frozen
    normed = parts * (w.layers[layer].attn_norm + one) / rms  # [P, T, D]
    rope = model.positions(0, T)

    def rotated(rows):  # [hd, D] -> [P, T, hd]
        x = (normed @ rows.T)[:, :, None]  # [P, T, 1, hd]
        return apply_rope(x, rope.cos, rope.sin)[:, :, 0]
    lw = w.layers[layer]
    q = rotated(lw.q_proj.view(H, hd, -1)[head])[:, -1]  # [P, hd]
    k = rotated(lw.k_proj.view(c.n_kv_heads, hd, -1)[head // (H // c.n_kv_heads)])
    others = [p for p in range(T) if p != pos]
    k_lead = k[:, pos] - k[:, others].mean(1)  # [P, hd]
    scale = c.attn_scale or hd ** -0.5
    want = qk_terms(q, k_lead, scale)
    return Case(caller(q, k_lead, scale), want, f"QK terms of layer {layer}'s head {head} {shape(want)}",
                tensor_compare(1e-5), [
                    (lambda q, k, s: q @ k.T, "multiply by the attention's scale, as the "
                                              "scores are"),
                    (lambda q, k, s: qk_terms(k, q, s), "rows are the query's components, "
                                                        "columns the key's"),
                    (lambda q, k, s: (q * k).sum(-1) * s, "every pair of a query component "
                                                          "and a key component: [P, P]")])


def noise_head(z: torch.Tensor, z_other: torch.Tensor, head: int) -> torch.Tensor:
    """Noising one head. z [1, H, T, hd]: one layer's head outputs (`attn.weighted_sum`) as they
    flow in the France prompt's run; z_other: the same from the Germany prompt's; head: which
    -> a new tensor: z with that head's output at the last position taken from z_other."""
    out = z.clone()  # the trace keeps the tensor it was given
    out[:, head, -1] = z_other[:, head, -1]
    return out


@exercise(14, noise_head)
def _(model) -> Case:
    trace, c = trace_of(model), model.config
    ids, other_ids = model.encode(PROMPT), model.encode(OTHER)
    if ids.shape != other_ids.shape:
        raise LlmTraceError(f"{model.name}'s tokenizer splits {PROMPT!r} and {OTHER!r} into "
                            "different numbers of tokens")
    a, b = answers(model)
    layer, head = divmod(int(all_heads(model, trace, a, b).flatten().argmax()), c.n_heads)
    name = f"layers.{layer}.attn.weighted_sum"
    other = model.run(other_ids, names=[name])[1][name]  # [1, H, T, hd]

    def call(fn):
        run(fn, trace[name], other, head, names=["z", "z_other", "head"])  # a stub, an edit

        def patch(t):
            before = t.clone()
            out = fn(t, other.clone(), head)
            if not torch.equal(t, before):
                raise Edited("your function changed `z` in place: copy it first (z.clone())")
            return out
        return model.run(ids, keep_values=False, patch={name: patch})[0]  # [1, T, V]
    want = call(noise_head)

    def every_position(z, o, h):
        out = z.clone()
        out[:, h] = o[:, h]
        return out

    def every_head(z, o, h):
        out = z.clone()
        out[:, :, -1] = o[:, :, -1]
        return out
    return Case(call, want, f"the noised logits {shape(want)}", tensor_compare(1e-4), [
        (every_position, "only the last position, where the answer is read: z[:, head, -1]"),
        (every_head, "only the one head: z[:, head, -1], not every head's"),
        (lambda z, o, h: o.clone(), "the clean run with ONE head's output from the other: "
                                    "start from z, not z_other")])
