"""Chapter 11: one decode step of attention with a cache, the greedy loop around a model, then
a whole generation from the weights with a KV cache of your own."""

import math

import torch
import torch.nn.functional as F

from llmtrace_book import LlmTraceError, generate
from llmtrace_book.rope import rope_frequencies

from .ch06_rope import rope_rotate
from .ch07_ffn import activation
from .registry import PROMPT, Case, Edited, Stub, ReturnedNone, copy_inputs, edited, \
    exercise, is_stub, run, store, trace_of
from .verdicts import shape, tensor_diff, with_rtol


def kv_cache_step(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, pos: int) -> torch.Tensor:
    """One decode step of attention with a KV cache, for the token at position `pos`.
    q [H, head_dim]: its query; k_new, v_new [KV, head_dim]: its key and value (q and k after
    RoPE); k_cache, v_cache [max_len, KV, head_dim]: positions 0..pos-1 filled, the rest not yet.
    Write k_new, v_new at `pos`, attend over positions 0..pos (each KV head repeated for its
    H/KV query heads, scores scaled by 1/sqrt(head_dim), softmax) -> out [H, head_dim]."""
    k_cache[pos], v_cache[pos] = k_new, v_new  # write: the next step reads this position too
    n_rep = q.shape[0] // k_new.shape[0]
    k = k_cache[:pos + 1].repeat_interleave(n_rep, dim=1).transpose(0, 1)  # [H, pos+1, hd]
    v = v_cache[:pos + 1].repeat_interleave(n_rep, dim=1).transpose(0, 1)  # [H, pos+1, hd]
    scores = q[:, None, :] @ k.transpose(1, 2) / math.sqrt(q.shape[-1])  # [H, 1, pos+1]
    return (scores.softmax(-1) @ v)[:, 0]  # [H, head_dim]


def decode_loop(step, prompt_ids: torch.Tensor, n_new: int) -> list[int]:
    """Greedy decoding with a KV cache. step(ids, start) runs the model on ids [1, t] at
    positions start .. start+t-1, reading earlier positions from its cache and writing these,
    and returns logits [1, t, V]. prompt_ids [1, T]. -> the n_new greedy token ids: prefill the
    prompt, then feed each new token alone, at its own position."""
    logits = step(prompt_ids, 0)  # [1, T, V]: prefill fills positions 0..T-1
    tokens = [int(logits[0, -1].argmax())]
    pos = prompt_ids.shape[1]  # the position of the token just chosen
    while len(tokens) < n_new:
        logits = step(torch.tensor([[tokens[-1]]]), pos)  # [1, 1, V]
        tokens.append(int(logits[0, -1].argmax()))
        pos += 1
    return tokens


def generate_with_cache(prompt_ids: torch.Tensor, weights, config, n_new: int):
    """Greedy generation from the weights, with a KV cache of your own. prompt_ids [1, T];
    weights: the model's (embed [V, D], layers, final_norm [D], lm_head [V, D]); config: its
    Config; n_new -> (the n_new greedy token ids, their logits [n_new, V]): the prefill runs the
    T prompt positions and keeps each layer's K and V; each decode step runs the newest token
    alone, at its own position, appends its K and V to the cache and attends over all of them.
    Chapters 6 and 8 have the layer; today's families add what their docstrings say."""
    c, wt = config, weights
    H, KV, hd = c.n_heads, c.n_kv_heads, c.head_dim
    cache = [None] * len(wt.layers)  # per layer: (K, V) [1, KV, S, hd] of every position so far

    def norm(t, weight):  # RMSNorm; Gemma stores gain - 1
        gain = weight + 1 if c.norm_offset else weight
        return gain * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.norm_eps)

    def attend(x, w, i, start):  # x [1, t, D] at positions start .. start+t-1
        B, t, _ = x.shape
        q = F.linear(x, w.q_proj, w.q_bias).view(B, t, H, hd)
        k = F.linear(x, w.k_proj, w.k_bias).view(B, t, KV, hd)
        v = F.linear(x, w.v_proj, w.v_bias).view(B, t, KV, hd).transpose(1, 2)
        if c.qk_norm:  # Qwen3, Gemma 3
            q, k = norm(q, w.q_norm), norm(k, w.k_norm)
        local = bool(c.layer_types and c.is_sliding(i) and c.rope_local_theta)
        freqs = rope_frequencies(hd, c.rope_local_theta if local else c.rope_theta,
                                 scaling=() if local else c.rope_scaling)  # [hd/2]
        angles = torch.arange(start, start + t).float()[:, None] * freqs  # [t, hd/2]
        cos, sin = torch.cat([angles] * 2, -1).cos(), torch.cat([angles] * 2, -1).sin()
        if c.has_rope(i):  # SmolLM3 leaves every fourth layer's q and k unturned
            q, k = rope_rotate(q, cos, sin), rope_rotate(k, cos, sin)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [1, H, t, hd], [1, KV, t, hd]
        if cache[i] is not None:  # the earlier positions' K and V, computed once
            k, v = torch.cat([cache[i][0], k], 2), torch.cat([cache[i][1], v], 2)
        cache[i] = (k, v)  # [1, KV, S, hd] each
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        scores = q @ k.transpose(-2, -1) * (c.attn_scale or 1 / math.sqrt(hd))  # [1, H, t, S]
        p, j = torch.arange(start, start + t)[:, None], torch.arange(k.shape[2])[None, :]
        blocked = (j > p) | (c.is_sliding(i) & (j <= p - c.sliding_window))  # [t, S]
        out = scores.masked_fill(blocked, float("-inf")).softmax(-1) @ v  # [1, H, t, hd]
        return F.linear(out.transpose(1, 2).reshape(B, t, H * hd), w.o_proj)  # [1, t, D]

    def step(ids, start):  # ids [1, t] -> the last position's logits [V]
        x = wt.embed[ids]  # [1, t, D]
        if c.embed_scale:  # Gemma: rows times sqrt(D), in the table's dtype
            x = x * torch.tensor(c.hidden_size ** 0.5, dtype=x.dtype)
        for i, w in enumerate(wt.layers):
            h = attend(norm(x, w.attn_norm), w, i, start)
            x = x + (norm(h, w.post_attn_norm) if c.sandwich_norm else h)
            g = norm(x, w.mlp_norm)
            h = F.linear(activation(c)(F.linear(g, w.gate)) * F.linear(g, w.up), w.down)
            x = x + (norm(h, w.post_mlp_norm) if c.sandwich_norm else h)
        return F.linear(norm(x, wt.final_norm), wt.lm_head)[0, -1]  # [V]

    last, pos = step(prompt_ids, 0), prompt_ids.shape[1]  # the prefill
    tokens, logits = [int(last.argmax())], [last]
    while len(tokens) < n_new:  # each step: the newest token alone, at its position
        last = step(torch.tensor([[tokens[-1]]]), pos)
        tokens.append(int(last.argmax()))
        logits.append(last)
        pos += 1
    return tokens, torch.stack(logits)  # n_new ids, [n_new, V]


# --- kv_cache_step -----------------------------------------------------------------------------

def _rows_kept(pos):
    """An edit check for a cache: only row `pos` may change."""
    def problem(before, after):
        if not isinstance(after, torch.Tensor) or after.shape != before.shape:
            return "the cache must stay the same tensor, [max_len, KV, head_dim]"
        rest = torch.ones(before.shape[0], dtype=torch.bool)
        rest[pos] = False
        if not torch.equal(after[rest], before[rest]):
            return (f"your function changed the cache outside position {pos}: write k_new and "
                    f"v_new at pos only")
        return None
    return problem


@exercise(11, kv_cache_step)
def _(model) -> Case:
    trace, c = trace_of(model), model.config
    q_all = trace["layers.0.attn.rope_q"][0]  # [T, H, hd]
    k_all, v_all = trace["layers.0.attn.rope_k"][0], trace["layers.0.attn.v"][0]  # [T, KV, hd]
    T = q_all.shape[0]
    pos, max_len = T - 1, T + 3
    if c.is_sliding(0):  # a window (Mistral, Gemma 3): a position it does not cut yet
        pos = min(pos, c.sliding_window - 1)
    if c.attn_scale:  # Gemma's own score scale, folded into q for a 1/sqrt(hd) step
        q_all = q_all * (c.attn_scale * math.sqrt(c.head_dim))
    # positions 0..pos-1 hold the prompt's K and V; the rest holds what a cache may hold there:
    # anything (seeded noise of the same size), so that reading too far shows
    g = torch.Generator().manual_seed(0)
    noise = torch.randn((2, max_len, c.n_kv_heads, c.head_dim), generator=g)
    k_cache = noise[0] * k_all.std() + k_all.mean()
    v_cache = noise[1] * v_all.std() + v_all.mean()
    k_cache[:pos], v_cache[:pos] = k_all[:pos], v_all[:pos]
    want = trace["layers.0.attn.weighted_sum"][0, :, pos]  # [H, hd]: the output at pos
    args = (q_all[pos], k_all[pos], v_all[pos], k_cache, v_cache, pos)
    may = {"k_cache": _rows_kept(pos), "v_cache": _rows_kept(pos)}

    def call(fn):
        given = []
        out = run(fn, *args, names=["q", "k_new", "v_new", "k_cache", "v_cache", "pos"],
                  may_edit=may, copies_out=given)
        return out, bool(torch.equal(given[3][pos], args[1])
                         and torch.equal(given[4][pos], args[2]))

    def compare(got, want):
        d = tensor_diff(got[0], want[0], 1e-5)
        if d or got[1] == want[1]:
            return d
        return ("the output is right, but the cache does not hold k_new and v_new at pos: "
                "write them there, the next step reads them")
    compare = with_rtol(compare, 1e-5)

    def step(write, read_to, scale=True, tiled=False):
        def fn(q, k_new, v_new, kc, vc, pos):
            if write:
                kc[pos], vc[pos] = k_new, v_new
            n_rep = q.shape[0] // k_new.shape[0]
            rep = ((lambda t: t.repeat(1, n_rep, 1)) if tiled
                   else (lambda t: t.repeat_interleave(n_rep, dim=1)))
            k = rep(kc[:read_to(pos)]).transpose(0, 1)
            v = rep(vc[:read_to(pos)]).transpose(0, 1)
            s = q[:, None, :] @ k.transpose(1, 2) / (math.sqrt(q.shape[-1]) if scale else 1)
            return (s.softmax(-1) @ v)[:, 0]
        return fn

    return Case(call, (want, True), f"the step's output {shape(want)} and the cache", compare, [
                    (step(True, lambda p: p), "read positions 0..pos INCLUDED: "
                                              "k_cache[:pos + 1] (off by one)"),
                    (step(True, lambda p: None), "read only positions 0..pos: the cache beyond "
                                                 "holds nothing yet, k_cache[:pos + 1]"),
                    (step(False, lambda p: p + 1), "write k_new and v_new at pos before reading"),
                    (step(True, lambda p: p + 1, scale=False),
                     "the 1/sqrt(head_dim) scale is missing"),
                    (step(True, lambda p: p + 1, tiled=True),
                     "each KV head serves n_rep consecutive query heads: repeat_interleave")])


# --- decode_loop ---------------------------------------------------------------------------------

class Step:
    """The model as a decode loop sees it: step(ids, start) -> logits [1, t, V]. It keeps the
    token of each position it has seen (the cache) and runs the model over positions 0..start+t-1,
    so its logits are those of a cached pass; it records each call's (start, t). Runs are
    remembered by their tokens (`memo`, one per model): checking a loop again costs nothing."""

    def __init__(self, model, memo: dict):
        self.model, self.memo, self.tokens, self.calls = model, memo, [], []

    def __call__(self, ids, start):
        ids = torch.as_tensor(ids).reshape(1, -1).long()  # [1, t]
        start = int(start)
        self.calls.append((start, ids.shape[1]))
        if start and not self.tokens:
            raise LlmTraceError(f"step(ids, start={start}): the cache is empty: the prefill "
                                "comes first, step(prompt_ids, 0)")
        if not 0 <= start <= len(self.tokens):
            raise LlmTraceError(f"step(ids, start={start}): the cache holds positions 0.."
                                f"{len(self.tokens) - 1} only: start must be the position of "
                                f"the first new token, {len(self.tokens)}")
        self.tokens = self.tokens[:start] + ids[0].tolist()  # write at start.., like a cache
        key = tuple(self.tokens)
        if key not in self.memo:
            if len(self.memo) > 64:  # a learner's many tries: keep memory bounded
                self.memo.clear()
            self.memo[key] = self.model.run(torch.tensor([self.tokens]), keep_values=False)[0]
        return self.memo[key][:, start:].clone()  # [1, t, V]


N_NEW = 3  # tokens the decode exercises generate


@exercise(11, decode_loop)
def _(model) -> Case:
    ids = model.encode(PROMPT)  # [1, T]
    T = ids.shape[1]
    want_calls = [(0, T)] + [(T + i, 1) for i in range(N_NEW - 1)]
    trace_of(model)
    memo = {tuple(ids[0].tolist()): store(model)["logits"]}  # the prefill has run already

    def call(fn):
        step = Step(model, memo)
        out = run(fn, step, ids, N_NEW, names=["step", "prompt_ids", "n_new"])
        tokens = out.flatten().tolist() if isinstance(out, torch.Tensor) else list(out)
        return [int(t) for t in tokens], step.calls

    def compare(got, want):
        (tokens, calls), (want_tokens, _) = got, want
        if tokens != want_tokens:
            return f"tokens: wanted {want_tokens}, got {tokens}"
        if calls != want_calls:
            fed = sum(t for _, t in calls)
            return (f"the right tokens, but {fed} positions went through the model where a "
                    f"KV cache needs {sum(t for _, t in want_calls)}: after the prefill, feed "
                    f"only the new token, at start = its position")
        return None
    compare.rtol = None

    def diagnose(got):
        _, calls = got
        for i, ((s, t), (ws, wt)) in enumerate(zip(calls, want_calls)):
            if i and t == 1 and s != ws:
                return (f"step call {i} had start={s}, wanted {ws}: the decode loop forgets the "
                        f"KV cache position (start is the new token's own position: the "
                        f"prompt's length, then one more per step)")
        return None

    def from_zero(step, ids, n):
        tokens = [int(step(ids, 0)[0, -1].argmax())]
        while len(tokens) < n:
            tokens.append(int(step(torch.tensor([[tokens[-1]]]), 0)[0, -1].argmax()))
        return tokens

    def first_position(step, ids, n):
        tokens, pos = [int(step(ids, 0)[0, 0].argmax())], ids.shape[1]
        while len(tokens) < n:
            tokens.append(int(step(torch.tensor([[tokens[-1]]]), pos)[0, -1].argmax()))
            pos += 1
        return tokens

    return Case(call, call(decode_loop), f"{N_NEW} greedy tokens, each step at its cache "
                                         f"position", compare, [
                    (from_zero, "the decode loop forgets the KV cache position: pass each new "
                                "token's own position as start"),
                    (first_position, "the next token comes from the LAST position's logits, "
                                     "logits[0, -1]")], diagnose)


# --- generate_with_cache -------------------------------------------------------------------------

class Counted(torch.Tensor):
    """The embedding table, counting the rows looked up in it: the positions a generation runs
    through the model (a lookup per position)."""
    rows = 0
    LOOKUPS = (torch.Tensor.__getitem__, F.embedding, torch.index_select,
               torch.Tensor.index_select, torch.take)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func in cls.LOOKUPS and isinstance(out, torch.Tensor) and out.dim():
            cls.rows += out.numel() // out.shape[-1]
        return out


@exercise(11, generate_with_cache)
def _(model) -> Case:
    ids = model.encode(PROMPT)  # [1, T]
    T = ids.shape[1]
    g = generate(model, ids, max_new_tokens=N_NEW, trace=False, stop_at_eos=False)
    want = (g.new_ids, torch.stack(g.step_logits))  # N_NEW ids, [N_NEW, V]
    cached = T + N_NEW - 1  # positions through the model: the prompt, then one per step

    def call(fn):
        args = (ids, model.weights, model.config, N_NEW)
        copies = copy_inputs(args)
        table = copies[1].embed
        counted = table.as_subclass(Counted)
        copies[1].embed = counted
        if copies[1].lm_head is table:  # a tied head stays the same tensor
            copies[1].lm_head = counted
        Counted.rows = 0
        out = fn(*copies)
        rows = Counted.rows
        names = ["prompt_ids", "weights", "config", "n_new"]
        for name, before, after in zip(names, args, copies):
            if (hit := edited(before, after, name)):
                raise Edited(f"your function changed its input `{hit}` in place: work on a "
                             f"copy (`.clone()`) or write the result into a new tensor")
        if out is None:
            raise Stub if is_stub(fn) else ReturnedNone
        return out, rows

    def compare(got, want):
        (out, rows), (tokens, logits) = got, want
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            return f"wanted (tokens, logits), got {type(out).__name__}"
        got_tokens = out[0].flatten().tolist() if isinstance(out[0], torch.Tensor) \
            else list(out[0])
        if [int(t) for t in got_tokens] != tokens:
            return f"tokens: wanted {tokens}, got {[int(t) for t in got_tokens]}"
        logits_got = torch.stack(list(out[1])) if isinstance(out[1], (list, tuple)) else out[1]
        d = tensor_diff(logits_got, logits, 1e-4)
        if d:
            return f"logits: {d}"
        if rows and rows != cached:
            return (f"the right tokens and logits, but {rows} positions went through the "
                    f"model (rows looked up in the embedding) where a KV cache needs "
                    f"{cached}: after the prefill, run only the newest token, and read the "
                    f"earlier K and V from the cache")
        return None
    compare = with_rtol(compare, 1e-4)

    def diagnose(got):
        out, _ = got
        logits = torch.stack(list(out[1])) if isinstance(out[1], (list, tuple)) else out[1]
        if isinstance(logits, torch.Tensor) and logits.shape == want[1].shape and \
                tensor_diff(logits[:1], want[1][:1], 1e-4) is None and \
                tensor_diff(logits, want[1], 1e-4) is not None:
            return ("the prefill is right, the decode steps are not: the newest token sits at "
                    "position T + step (its RoPE angle, its mask row), and attends over the "
                    "cache's K and V followed by its own")
        return None

    return Case(call, (want, cached), "generate's tokens and logits",
                with_rtol(lambda got, w: compare(got, w[0]), 1e-4), [], diagnose)
