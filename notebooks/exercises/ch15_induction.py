"""Chapter 15: an induction score; a path patch into a key; a faithfulness ablation."""

import torch

from llmtrace_book import Trace

from .registry import Case, caller, exercise, store
from .verdicts import shape, tensor_compare


def induction_score(weights: torch.Tensor, R: int) -> torch.Tensor:
    """An induction score. weights [B, H, 2R, 2R]: one layer's attention weights on sequences of
    R random tokens written twice -> [H]: for each head, the mean weight that a position i of the
    second copy (R <= i < 2R) puts on position i - R + 1, just after the earlier copy of its
    token, over the batch and those positions."""
    second = torch.arange(R, 2 * R)  # the second copy's positions
    return weights[..., second, second - R + 1].mean((0, 2))  # [H]


def repeated_weights(model, B: int = 4, R: int = 10):
    """Every layer's weights [L, B, H, 2R, 2R] on B seeded random sequences of R tokens, twice."""
    s = store(model)
    if "repeated" not in s:
        g = torch.Generator().manual_seed(0)
        first = torch.randint(min(1000, model.config.vocab_size // 2), model.config.vocab_size,
                              (B, R), generator=g)
        trace = Trace(names=["layers.*.attn.weights"])
        model.forward(torch.cat([first, first], dim=1), trace)
        s["repeated"] = torch.stack([trace[f"layers.{l}.attn.weights"]
                                     for l in range(model.config.n_layers)]), R
    return s["repeated"]


def two_batches(model, B: int = 4, R: int = 10) -> dict:
    """Two more seeded batches of B sequences of R random tokens, twice each, traced in one pass:
    each layer's head outputs and streams, [2B, ...]; the first batch is a run, the second the
    runs a mean is taken over (made once per model)."""
    s = store(model)
    if "two_batches" not in s:
        c = model.config
        g = torch.Generator().manual_seed(1)
        runs = [torch.randint(min(1000, c.vocab_size // 2), c.vocab_size, (B, R), generator=g)
                for _ in range(2)]
        names = ([f"layers.{l}.attn.weighted_sum" for l in range(c.n_layers)]
                 + [f"layers.{l}.resid_out" for l in range(c.n_layers)] + ["embed"])
        trace = Trace(names=names)
        model.forward(torch.cat([torch.cat([r, r], 1) for r in runs]), trace)
        s["two_batches"] = {n: trace[n] for n in names}
    return s["two_batches"]


@exercise(15, induction_score)
def _(model) -> Case:
    W, R = repeated_weights(model)  # [L, B, H, 2R, 2R]
    # the same positions read another way: row R + n, column n + 1 is the diagonal of the
    # block of rows R.. and columns 1..R
    diag = torch.diagonal(W[..., R:, 1:R + 1], dim1=-2, dim2=-1).mean((1, -1))  # [L, H]
    layer = int(diag.max(-1).values.argmax())  # the layer of the strongest induction head
    weights, want = W[layer], diag[layer]  # [B, H, 2R, 2R], [H]

    def same_token(w, R):  # the earlier copy itself: a duplicate-token score
        s = torch.arange(R, 2 * R)
        return w[..., s, s - R].mean((0, 2))

    def first_copy_too(w, R):
        s = torch.arange(1, 2 * R)
        return w[..., s, (s - R + 1).clamp(min=0)].mean((0, 2))
    return Case(caller(weights, R), want, f"layer {layer}'s induction scores {shape(want)}",
                tensor_compare(1e-5), [
                    (same_token, "that is the earlier copy of the token itself (i - R): the "
                     "induction head looks one further, at the token that came NEXT, i - R + 1"),
                    (lambda w, R: w[..., torch.arange(R, 2 * R), torch.arange(R, 2 * R) - R + 1]
                     .mean(), "one number per head: take the mean over the batch and the "
                     "positions only, not over the heads"),
                    (first_copy_too, "only the second copy's positions, R to 2R - 1: in the "
                     "first copy there is no earlier copy to find")])


def keep_only(z: torch.Tensor, mean_z: torch.Tensor, keep: list) -> torch.Tensor:
    """A faithfulness ablation, for one layer. z [B, H, T, hd]: its heads' outputs in a run;
    mean_z [H, T, hd]: each head's mean output at each position over other runs; keep: the heads
    of the circuit in this layer -> a new tensor like z: the kept heads as they ran, every other
    head's output replaced by its mean."""
    out = mean_z.expand_as(z).clone()  # every head mean-ablated ...
    out[:, keep] = z[:, keep]  # ... but the circuit's
    return out


@exercise(15, keep_only)
def _(model) -> Case:
    W, R = repeated_weights(model)
    diag = torch.diagonal(W[..., R:, 1:R + 1], dim1=-2, dim2=-1).mean((1, -1))  # [L, H]
    layer = int(diag.max(-1).values.argmax())  # the strongest induction head's layer
    z_all = two_batches(model)[f"layers.{layer}.attn.weighted_sum"]  # [2B, H, T, hd]
    half = z_all.shape[0] // 2
    z, mean_z = z_all[:half], z_all[half:].mean(0)  # this run; the other runs' mean
    H = z.shape[1]
    keep = diag[layer].argsort(descending=True)[:max(1, H // 3)].sort().values.tolist()
    want = torch.where(torch.isin(torch.arange(H), torch.tensor(keep))[None, :, None, None],
                       z, mean_z[None])
    return Case(caller(z, mean_z, keep), want, f"layer {layer}, {len(keep)} heads kept "
                f"{shape(want)}", tensor_compare(1e-6), [
                    (lambda z, m, k: m.expand_as(z).clone(),
                     "keep the listed heads as they ran: copy them back in from z"),
                    (lambda z, m, k: keep_only(z, m, [h for h in range(z.shape[1])
                                                      if h not in k]),
                     "keep the listed heads as they ran and replace the OTHERS by their mean"),
                    (lambda z, m, k: keep_only(z, m.mean(1, keepdim=True), k),
                     "the mean at each position, as mean_z gives it: not over the positions "
                     "too")])


def key_without(x_in: torch.Tensor, head_out: torch.Tensor, head_mean: torch.Tensor,
                norm_weight: torch.Tensor, eps: float, k_proj: torch.Tensor) -> torch.Tensor:
    """A path patch into a key. x_in [B, T, D]: the stream entering the receiving head's layer;
    head_out [B, T, D]: what one earlier head wrote into it; head_mean [T, D]: that head's mean
    output at each position over other runs; norm_weight [D], eps: the layer's RMSNorm before
    attention; k_proj [KV*hd, D]: its key projection -> [B, T, KV*hd]: the keys the layer computes
    when the sender's output in its stream is replaced by its mean."""
    x = x_in - head_out + head_mean  # the sender's own work taken out of the stream
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * norm_weight  # the norm, again
    return x @ k_proj.T  # [B, T, KV*hd]


@exercise(15, key_without)
def _(model) -> Case:
    c, w = model.config, model.weights
    acts = two_batches(model)
    W, R = repeated_weights(model)
    T, H, hd, D = 2 * R, c.n_heads, c.head_dim, c.hidden_size
    i = torch.arange(1, T)
    prev = W[..., i, i - 1].mean((1, 3))  # [L, H]: previous-token scores
    diag = torch.diagonal(W[..., R:, 1:R + 1], dim1=-2, dim2=-1).mean((1, -1))  # [L, H]
    diag[0] = -1  # a receiver above some sender
    receiver = int(diag.max(-1).values.argmax())
    sender_l, sender_h = divmod(int(prev[:receiver].flatten().argmax()), H)
    z = acts[f"layers.{sender_l}.attn.weighted_sum"]  # [2B, H, T, hd]
    o_proj = w.layers[sender_l].o_proj.view(D, H, hd)[:, sender_h]  # [D, hd]
    out = z[:, sender_h] @ o_proj.T  # [2B, T, D]
    half = out.shape[0] // 2
    head_out, head_mean = out[:half], out[half:].mean(0)
    x_in = acts[f"layers.{receiver - 1}.resid_out"][:half]
    lw = w.layers[receiver]
    gain = lw.attn_norm + (1.0 if c.norm_offset else 0.0)
    want = key_without(x_in, head_out, head_mean, gain, c.norm_eps, lw.k_proj)

    def normed_first(x, o, m, g, eps, k):  # the norm of the old stream, then the cut
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g
        return (n - o + m) @ k.T
    return Case(caller(x_in, head_out, head_mean, gain, c.norm_eps, lw.k_proj), want,
                f"layer {receiver}'s keys, the path cut {shape(want)}",
                tensor_compare(1e-5), [
                    (lambda x, o, m, g, eps, k: key_without(x, o, 0 * m, g, eps, k),
                     "replace the sender's output by its MEAN: add head_mean back"),
                    (normed_first, "take the sender out of the stream first, then normalize: "
                                   "the norm reads the changed stream"),
                    (lambda x, o, m, g, eps, k: key_without(x, 0 * o, 0 * m, g, eps, k),
                     "take the sender's output OUT of the stream: x_in - head_out")])
