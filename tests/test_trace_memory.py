"""What a trace of every value holds: records recomputed when read, views, and the pool's memory.
Reading any record gives the very tensor the pass computed, bit for bit."""

import torch
import torch.nn.functional as F

from llmtrace import Trace
from llmtrace.trace import TracePool
from helpers import PROMPT

RECOMPUTED = {"attn.masked_scores", "attn.k_expanded", "attn.v_expanded", "attn.merged", "mlp.act"}


class EveryTensorKept(Trace):
    """The trace as it was before records could be recomputed or pooled: each record keeps the
    tensor its op made."""

    def __init__(self):
        super().__init__(pool=None)

    def record(self, name, op, tensor, macs=0, recompute=None):
        return super().record(name, op, tensor, macs)


def layer_op(name):
    return name.split(".", 2)[2] if name.startswith("layers.") else name


def test_every_record_reads_the_tensor_its_op_made(embedded):
    ids = embedded.ids(PROMPT * 8)  # [1, 40]
    made = EveryTensorKept()
    logits_made = embedded.forward(ids, made)
    pool = TracePool()
    embedded.forward(ids, Trace(pool=pool))  # dropped at once: its memory goes to the pool
    assert pool.nbytes() > 0
    trace = Trace(pool=pool)  # writes into the memory the first one returned
    logits = embedded.forward(ids, trace)
    assert pool.nbytes() == 0 and torch.equal(logits, logits_made)
    assert trace.names == made.names
    for r, m in zip(trace, made):
        assert r.tensor.dtype == m.tensor.dtype and r.tensor.shape == m.tensor.shape, r.name
        assert r.tensor.stride() == m.tensor.stride(), r.name
        assert torch.equal(r.tensor, m.tensor), r.name  # NaN-free: equal is bit for bit here
        assert (r.held is None) == (layer_op(r.name) in RECOMPUTED), r.name
    assert trace.nbytes() < 0.8 * made.nbytes()


def pooled(trace):
    """The addresses of a trace's values in the pool's memory (all but the caller's token ids)."""
    return {r.held.untyped_storage().data_ptr() for r in trace
            if r.held is not None and r.name != "tokens"}


def test_a_dropped_trace_returns_its_memory_and_the_next_one_reuses_it(embedded):
    ids = embedded.ids(PROMPT)
    pool = TracePool()
    first = Trace(pool=pool)
    embedded.forward(ids, first)
    where, held = pooled(first), first.nbytes() - first["tokens"].nbytes
    del first
    assert pool.nbytes() == held  # nothing else read any of it
    second = Trace(pool=pool)
    embedded.forward(ids, second)
    assert pool.nbytes() == 0
    assert pooled(second) == where


def test_a_tensor_kept_from_a_dropped_trace_is_not_returned(embedded):
    pool = TracePool()
    first = Trace(pool=pool)
    embedded.forward(embedded.ids(PROMPT), first)
    total = first.nbytes() - first["tokens"].nbytes  # the caller's ids are not the pool's
    q = first["layers.0.attn.q"]  # a view of q_proj's buffer
    weights = first.get("layers.3.attn.weights")  # the record itself
    q_was, weights_was = q.clone(), weights.tensor.clone()
    del first
    assert pool.nbytes() == total - q.nbytes - weights.held.nbytes
    second = Trace(pool=pool)
    embedded.forward(embedded.ids("Paris is the capital of"), second)
    assert pool.nbytes() == 0  # the same shapes: every returned buffer taken
    assert torch.equal(q, q_was) and torch.equal(weights.tensor, weights_was)
    assert not torch.equal(second["layers.0.attn.q"], q)


def test_a_recomputed_record_reads_what_flowed_under_a_patch(embedded):
    gate_patch = {"layers.2.mlp.gate": lambda t: t * 0.5}
    _, trace = embedded.run(PROMPT, patch=gate_patch)
    act = trace.get("layers.2.mlp.act")
    assert act.held is None  # still recomputed: from the gate that flowed, the patched one
    assert torch.equal(act.tensor, F.silu(trace["layers.2.mlp.gate"]))
    assert torch.equal(trace["layers.2.mlp.gated"], act.tensor * trace["layers.2.mlp.up"])
    # a patched record keeps what the patch returned, and what follows reads it
    _, patched = embedded.run(PROMPT, patch={"layers.4.attn.masked_scores": torch.zeros_like})
    rec = patched.get("layers.4.attn.masked_scores")
    assert rec.held is not None and "[patched]" in rec.op and not rec.tensor.any()
    uniform = torch.full_like(patched["layers.4.attn.weights"][0, 0, 0], 1 / 5)
    assert torch.allclose(patched["layers.4.attn.weights"][0, 0, -1], uniform)


def test_a_record_whose_inputs_are_filtered_out_keeps_its_tensor(embedded):
    names = ["layers.1.attn.masked_scores", "layers.1.mlp.act"]
    _, only = embedded.run(PROMPT, names=names)
    _, every = embedded.run(PROMPT)
    for name in names:
        assert only.get(name).held is not None
        assert torch.equal(only[name], every[name])


def test_the_callers_token_ids_are_kept_as_given(embedded):
    ids = embedded.ids(PROMPT)  # made outside the model's inference mode: autograd may use it
    _, trace = embedded.run(ids)
    assert trace["tokens"] is not ids and trace["tokens"].data_ptr() == ids.data_ptr()
    assert not trace["tokens"].is_inference()
    assert trace["layers.0.attn.q_proj"].is_inference()  # the pass's own: in the pool's memory
