"""What a trace of every value holds: records recomputed when read, views, and the pool's memory.
Reading any record gives the very tensor the pass computed, bit for bit."""

import time

import pytest
import torch
import torch.nn.functional as F

from llmtrace_book import Trace
from llmtrace_book.trace import TracePool
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
        assert r.recomputed == (layer_op(r.name) in RECOMPUTED), r.name
    assert trace.nbytes() < 0.8 * made.nbytes()


def pooled(trace):
    """The addresses of a trace's values in the pool's memory (all but the caller's token ids)."""
    return {r._held.untyped_storage().data_ptr() for r in trace  # not read: not lent
            if r._held is not None and r.name != "tokens"}


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
    assert pool.nbytes() == total - q.nbytes - weights.tensor.nbytes
    second = Trace(pool=pool)
    embedded.forward(embedded.ids("Paris is the capital of"), second)
    assert pool.nbytes() == 0  # the same shapes: every returned buffer taken
    assert torch.equal(q, q_was) and torch.equal(weights.tensor, weights_was)
    assert not torch.equal(second["layers.0.attn.q"], q)


def test_a_recomputed_record_reads_what_flowed_under_a_patch(embedded):
    gate_patch = {"layers.2.mlp.gate": lambda t: t * 0.5}
    _, trace = embedded.run(PROMPT, patch=gate_patch)
    act = trace.get("layers.2.mlp.act")
    assert act.recomputed  # still recomputed: from the gate that flowed, the patched one
    assert torch.equal(act.tensor, F.silu(trace["layers.2.mlp.gate"]))
    assert torch.equal(trace["layers.2.mlp.gated"], act.tensor * trace["layers.2.mlp.up"])
    # a patched record keeps what the patch returned, and what follows reads it
    _, patched = embedded.run(PROMPT, patch={"layers.4.attn.masked_scores": torch.zeros_like})
    rec = patched.get("layers.4.attn.masked_scores")
    assert not rec.recomputed and "[patched]" in rec.op and not rec.tensor.any()
    uniform = torch.full_like(patched["layers.4.attn.weights"][0, 0, 0], 1 / 5)
    assert torch.allclose(patched["layers.4.attn.weights"][0, 0, -1], uniform)


def test_a_record_whose_inputs_are_filtered_out_keeps_its_tensor(embedded):
    names = ["layers.1.attn.masked_scores", "layers.1.mlp.act"]
    _, only = embedded.run(PROMPT, names=names)
    _, every = embedded.run(PROMPT)
    for name in names:
        assert only.get(name).kept and not only.get(name).recomputed
        assert torch.equal(only[name], every[name])


def test_the_callers_token_ids_are_kept_as_given(embedded):
    ids = embedded.ids(PROMPT)  # made outside the model's inference mode: autograd may use it
    _, trace = embedded.run(ids)
    assert trace["tokens"] is not ids and trace["tokens"].data_ptr() == ids.data_ptr()
    assert not trace["tokens"].is_inference()
    assert trace["layers.0.attn.q_proj"].is_inference()  # the pass's own: in the pool's memory


# --- memory a reader holds is never handed to the next trace --------------------------------
def values_then_another_pass(embedded, keep, pool):
    """Trace the prompt, let `keep(trace)` take what a reader would, drop the trace, run another
    prompt of the same length in the same pool; returns (what was kept, the values it had)."""
    trace = Trace(pool=pool)
    embedded.forward(embedded.ids(PROMPT), trace)
    before = trace["layers.2.mlp.down"].clone()
    kept = keep(trace)
    del trace
    embedded.forward(embedded.ids("Paris is the capital of"), Trace(pool=pool))
    return kept, before


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated")
def test_a_storage_kept_alone_is_not_reused(embedded):
    """PyTorch keeps one Python object per storage: a reader's storage and the trace's own
    look the same to any count of uses, so the trace must know it lent it."""
    for how in ("untyped_storage", "storage"):
        pool = TracePool()
        kept, before = values_then_another_pass(
            embedded, lambda t: getattr(t["layers.2.mlp.down"], how)(), pool)
        read = torch.empty(0).set_(kept.untyped() if how == "storage" else kept)
        assert torch.equal(read.view(before.shape), before), how
        assert pool.nbytes() > 0  # what no reader was given is reused all the same


def test_records_kept_without_their_trace_keep_their_values(embedded):
    pool = TracePool()
    kept, before = values_then_another_pass(
        embedded, lambda t: [t.get("layers.2.mlp.down"), t.get("layers.0.attn.k")], pool)
    down, k = kept
    assert torch.equal(down.tensor, before)  # read only after the next pass wrote the pool
    # k is a view of k_proj's buffer: a record of the view keeps the buffer from the pool
    _, again = embedded.run(PROMPT)
    assert torch.equal(k.tensor, again["layers.0.attn.k"])


def test_a_copy_of_a_trace_keeps_its_values(embedded):
    import copy
    for how in (copy.copy, copy.deepcopy):
        pool = TracePool()
        kept, before = values_then_another_pass(embedded, how, pool)
        assert torch.equal(kept["layers.2.mlp.down"], before), how.__name__
        assert kept.pool is None  # a copy owns no pool memory: the original's stays the original's


def test_a_patch_that_keeps_what_it_saw_keeps_its_values(embedded):
    """What the model hands a patch is what flows on, never the pool's memory: keeping it is
    safe whatever the trace does after."""
    seen = []
    _, trace = embedded.run(PROMPT, patch={"layers.0.attn.q": lambda t: seen.append(t) or t})
    q = seen[0].clone()
    del trace
    embedded.run("Paris is the capital of")
    assert torch.equal(seen[0], q)


SENT = []  # what a child process forked from this one holds


def _child(conn, done):
    """In another process: wait until the parent has run a new pass, then send back the values
    it reads in the shared memory it was given."""
    done.wait(timeout=60)
    conn.send(SENT[0].tolist())  # plain numbers: nothing shared back


def test_a_tensor_in_shared_memory_is_not_reused(embedded):
    """A record's tensor moved to shared memory and held by another process only: the sender
    dropping it and its trace must not let the next pass write there."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("fork")
    mine, theirs = ctx.Pipe()
    done = ctx.Event()
    pool = TracePool()
    trace = Trace(pool=pool)
    embedded.forward(embedded.ids(PROMPT), trace)
    SENT.append(trace["layers.2.mlp.down"].share_memory_())
    before = SENT[0].clone()
    child = ctx.Process(target=_child, args=(theirs, done), daemon=True)
    child.start()
    try:
        SENT.clear()
        del trace  # only the child holds the memory now
        embedded.forward(embedded.ids("Paris is the capital of"), Trace(pool=pool))
        done.set()
        assert mine.poll(60), "the child process sent nothing back"
        assert torch.equal(torch.tensor(mine.recv()), before)
    finally:
        child.join(timeout=10)
        child.kill()


def test_threads_tracing_at_once_get_what_one_thread_gets(embedded):
    """Four threads x 25 passes, each over its own prompt, through the one shared pool."""
    from concurrent.futures import ThreadPoolExecutor
    prompts = [PROMPT, "Paris is the capital of", "The capital of Italy is", "Berlin lies in"]
    names = ["layers.0.attn.q_proj", "layers.5.attn.weights", "layers.29.mlp.down", "lm_head"]

    def passes(prompt, n=25):
        got = []
        for _ in range(n):
            _, trace = embedded.run(prompt)
            got.append([trace[n].clone() for n in names])
        return got

    alone = {p: passes(p, 1)[0] for p in prompts}  # one thread, one pass each
    with ThreadPoolExecutor(4) as threads:
        together = dict(zip(prompts, threads.map(passes, prompts)))
    for p in prompts:
        for values in together[p]:
            assert all(torch.equal(a, b) for a, b in zip(values, alone[p])), p
