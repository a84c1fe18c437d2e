"""Exercises: write a stage of the machine yourself, and check it on the trace's own tensors.

    from llmtrace.exercises import check, solution, NAMES

`check(name, fn)` runs `fn` on the inputs that the named stage received in a traced forward pass of
the running model (`load_model()`, which follows `LLMTRACE_MODEL`; or `check(..., model=m)`),
compares what it returns with what the stage produced, prints one line and returns True or False:

    ✓ on a pass: what matched, and to what tolerance;
    ✗ on a failure: a shape mismatch (wanted, got) or the first element that differs (wanted, got,
      the largest error), with a hint when the result is that of a common mistake;
    … when `fn` is still a stub (its body `...` or `raise NotImplementedError`): "not written
      yet".

An exception inside `fn` becomes a ✗ line with its message: `check` never raises. `solution(name)`
returns a reference function that passes; its docstring is the exercise: the signature to write and
what each argument holds. `CHAPTERS[name]` is the chapter an exercise belongs to.

How a chapter shows an exercise (four cells, after "What you now know"):

1. Markdown: the task in a sentence or two, naming the function and its signature.
2. Markdown, one or two hints, folded:
       <details><summary>Hint</summary>

       The mean is over the last axis: each token's own vector.

       </details>
3. Code, the stub the learner replaces (committed as is; running it prints the stable
   "… rms_norm: not written yet" line, so nbval stays green):
       from llmtrace.exercises import check

       def rms_norm(x, weight, eps):
           \"\"\"x [B, T, D], weight [D] -> [B, T, D]\"\"\"
           ...  # your code here

       _ = check("rms_norm", rms_norm, model=model)  # the verdict is printed
   (`model` is the page's, from `start_chapter`: the check reuses it instead of loading a
   second copy; `_ =` keeps Jupyter from echoing the returned bool under the verdict, which a
   semicolon does not do when nbval runs the cell)
4. Code, the solution, tagged `hide-input` and with metadata
   `{"tags": ["hide-input"], "jupyter": {"source_hidden": true}}` (folded in the HTML and in
   JupyterLab; its pass line shows):
       def rms_norm_solution(x, weight, eps):
           mean_sq = x.pow(2).mean(-1, keepdim=True)  # [B, T, 1]
           return weight * x * torch.rsqrt(mean_sq + eps)  # [B, T, D]

       assert check("rms_norm", rms_norm_solution, model=model)

   The solution is written out in the cell (the learner reads it there), not `solution(name)`;
   the assert makes nbval fail if it ever stops passing.
"""

from __future__ import annotations

import math
import os
import re
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .errors import LlmTraceError

PROMPT = "The capital of France is"
OTHER = "The capital of Germany is"  # the prompt whose stream `patch_country` patches in

CHAPTERS = {
    "count_parameters": 1,
    "bpe_merge": 2,
    "embed": 3,
    "rms_norm": 4,
    "rope_cos_sin": 5,
    "rope_rotate": 5,
    "attn_scores": 6,
    "causal_mask": 6,
    "softmax": 6,
    "repeat_kv": 6,
    "weighted_sum": 6,
    "swiglu": 7,
    "residual_block": 8,
    "lm_head": 9,
    "top_k": 10,
    "top_p": 10,
    "kv_cache_step": 11,
    "decode_loop": 11,
    "patch_country": 14,
    "window_mask": 16,
}
NAMES = list(CHAPTERS)


# --- the reference solutions: each docstring is the exercise --------------------------------------

def count_parameters(config) -> int:
    """The number of parameters of a Llama model, from its config alone: the embedding table
    [V, D]; per block, the two norms' weights [D], q_proj [H * hd, D] and o_proj [D, H * hd],
    k_proj and v_proj [KV * hd, D] each, gate and up [F, D] and down [D, F]; the final norm [D];
    and the LM head [V, D], unless it is tied to the embedding (`config.tied_lm_head`: one matrix
    serves both ends). The fields: vocab_size, hidden_size, n_layers, n_heads, n_kv_heads,
    head_dim, ffn_size, tied_lm_head. Today's families add a few vectors per block
    (chapter 16): biases on q, k, v (`qkv_bias`), q_norm and k_norm [head_dim] each
    (`qk_norm`), and two more norms [D] after the sublayers (`sandwich_norm`)."""
    c = config
    V, D, F, L = c.vocab_size, c.hidden_size, c.ffn_size, c.n_layers
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim  # widths of Q and of K, V
    block = 2 * D + 2 * q * D + 2 * kv * D + 3 * F * D  # norms, q and o, k and v, the FFN
    block += (q + 2 * kv) * bool(c.qkv_bias)  # Qwen2's biases on q, k, v
    block += 2 * c.head_dim * bool(c.qk_norm)  # Qwen3's and Gemma 3's q_norm, k_norm
    block += 2 * D * bool(c.sandwich_norm)  # Gemma 3's norms after each sublayer
    head = 0 if c.tied_lm_head else V * D
    return V * D + L * block + D + head  # embedding, the blocks, the final norm, the head


def bpe_merge(symbols: list[str], priority: Callable[[str, str], int | None]) -> list[str]:
    """Split one word into the tokenizer's pieces by byte-pair merges (chapter 2's loop).

    symbols: the word's first symbols: one per byte for byte-level BPE (printed as GPT-2's
      characters, "Ġ" for a space), one per character for SentencePiece ("▁" for a space).
    priority(left, right): the rank of merging the two pieces, the lower the earlier (merge order
      for byte-level BPE, score order for SentencePiece), or None when they may not merge.
    Returns the list of pieces: merge the adjacent pair with the lowest rank (the leftmost one on
    a tie), again and again, until no adjacent pair may merge."""
    pieces = list(symbols)
    while True:
        pairs = [(priority(a, b), i) for i, (a, b) in enumerate(zip(pieces, pieces[1:]))]
        pairs = [(r, i) for r, i in pairs if r is not None]
        if not pairs:
            return pieces
        _, i = min(pairs)  # the lowest rank; on a tie, the leftmost
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]


def embed(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The embedding lookup. ids [B, T] (int64), table [V, D] -> [B, T, D]: row `id` of the
    table for each token."""
    return table[ids]  # [B, T, D]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm. x [B, T, D], weight [D], eps a float -> [B, T, D]: each token's vector divided by
    its root-mean-square (eps inside the square root), times the weight."""
    mean_sq = x.pow(2).mean(-1, keepdim=True)  # [B, T, 1]: one number per token
    return weight * x * torch.rsqrt(mean_sq + eps)  # [B, T, D]


def rope_cos_sin(positions: torch.Tensor, head_dim: int,
                 theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's angles, as the library's `llmtrace.rope.rope_cos_sin` makes them.
    positions [T] (int64), head_dim, theta -> (cos, sin), each [T, head_dim].
    Pair i turns at freq_i = theta^(-2i / head_dim); the angle is position * freq_i. The library
    pairs dimension d with d + head_dim/2 (HF's rotate-half layout), so both halves of a row hold
    the same head_dim/2 angles."""
    i = torch.arange(0, head_dim, 2).float()  # [head_dim/2]: 2i
    freqs = 1.0 / theta ** (i / head_dim)  # [head_dim/2]
    angles = positions.float()[:, None] * freqs[None, :]  # [T, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, head_dim]: d and d + head_dim/2 share one
    return angles.cos(), angles.sin()


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE's rotation. x [B, T, H, head_dim] (the queries, heads split), cos and sin
    [T, head_dim] -> [B, T, H, head_dim]. Each pair (x[d], x[d + head_dim/2]) turns by its angle:
    x[d] cos - x[d + head_dim/2] sin, and x[d + head_dim/2] cos + x[d] sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (a, b) -> (-b, a) per pair
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, head_dim]: the same for every head
    return x * cos + rotated * sin  # [B, T, H, head_dim]


def attn_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Attention scores. q [B, H, T, head_dim], k [B, H, S, head_dim] (after RoPE, one K per query
    head) -> [B, H, T, S]: scores[..., i, j] = q_i · k_j / sqrt(head_dim)."""
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [B, H, T, S]


def causal_mask(T: int) -> torch.Tensor:
    """The causal mask of a prompt of T tokens -> [T, T] float: 0 where query i may see key j
    (j <= i), -inf where key j is in its future (j > i). It is added to the scores."""
    return torch.full((T, T), float("-inf")).triu(diagonal=1)  # [T, T]


def softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the keys. scores [B, H, T, S] (masked: -inf in the future) -> weights of the
    same shape, each row (fixed head and query) summing to 1."""
    e = (scores - scores.amax(-1, keepdim=True)).exp()  # the largest is exp(0): no overflow
    return e / e.sum(-1, keepdim=True)  # [B, H, T, S]


def repeat_kv(k: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Grouped-query attention's expand. k [B, KV, S, head_dim], n_rep = H / KV ->
    [B, H, S, head_dim]: KV head g serves query heads g*n_rep .. g*n_rep + n_rep - 1."""
    return k.repeat_interleave(n_rep, dim=1)  # [B, KV*n_rep, S, head_dim]


def weighted_sum(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention's output. weights [B, H, T, S], v [B, H, S, head_dim] -> [B, H, T, head_dim]:
    for each query, the values summed with its weights."""
    return weights @ v  # [B, H, T, head_dim]


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


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
           down: torch.Tensor) -> torch.Tensor:
    """The FFN. x [B, T, D]; gate and up [F, D], down [D, F], stored (out, in) as F.linear takes
    them -> [B, T, D]: down(silu(gate(x)) * up(x))."""
    g = F.linear(x, gate)  # [B, T, F]
    u = F.linear(x, up)  # [B, T, F]
    return F.linear(F.silu(g) * u, down)  # [B, T, D]


def residual_block(x: torch.Tensor, attn: Callable, mlp: Callable, norm1: Callable,
                   norm2: Callable) -> torch.Tensor:
    """A pre-norm block. x [B, T, D]: the residual stream into the layer; attn, mlp, norm1, norm2:
    the layer's own attention, FFN and two RMSNorms, each a function [B, T, D] -> [B, T, D].
    -> the stream out of the layer, [B, T, D]."""
    h = x + attn(norm1(x))  # [B, T, D]
    return h + mlp(norm2(h))  # [B, T, D]


def lm_head(x: torch.Tensor, norm_weight: torch.Tensor, head: torch.Tensor,
            eps: float) -> torch.Tensor:
    """The end of the forward pass. x [B, T, D]: the stream out of the last layer; norm_weight
    [D]: the final RMSNorm's weight (Gemma's gain, 1 + weight); head [V, D]; eps
    -> logits [B, T, V]."""
    mean_sq = x.pow(2).mean(-1, keepdim=True)  # [B, T, 1]
    x = norm_weight * x * torch.rsqrt(mean_sq + eps)  # [B, T, D]
    return x @ head.T  # [B, T, V]


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k filtering. logits [V] (one position), k -> [V]: the k largest logits as they are,
    every other one set to -inf (its probability becomes 0)."""
    kth = logits.topk(k).values[-1]  # the k-th largest logit
    return logits.masked_fill(logits < kth, float("-inf"))  # [V]


def top_p(logits: torch.Tensor, temperature: float, k: int, p: float) -> torch.Tensor:
    """The distribution a sampler draws from, in HF transformers' order. logits [V], temperature,
    k, p -> probabilities [V] in vocabulary order, zero for removed tokens, summing to 1:
    1. divide the logits by the temperature; 2. keep the top k (`top_k`); 3. softmax;
    4. top-p: in order of probability, remove a token once the mass of the tokens before it
    reaches p (the most likely token always stays); 5. renormalize what is kept."""
    probs = top_k(logits / temperature, k).softmax(-1)  # [V]: zero outside the top k
    sorted_probs, order = probs.sort(descending=True)  # [V] each
    before = sorted_probs.cumsum(-1) - sorted_probs  # [V]: the mass ahead of each token
    sorted_probs = sorted_probs.masked_fill(before >= p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)  # [V], vocabulary order
    return kept / kept.sum()


def decode_loop(step: Callable, prompt_ids: torch.Tensor, n_new: int) -> list[int]:
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


def patch_country(stream: torch.Tensor, other: torch.Tensor, pos: int) -> torch.Tensor:
    """An activation patch. stream [1, T, D]: the residual stream of the France prompt as it
    flows through the model; other [1, T, D]: the same tensor from the Germany prompt; pos: the
    country's position. -> a new tensor: `stream` with `other`'s vector at `pos`."""
    out = stream.clone()  # the trace keeps the original: do not change it in place
    out[:, pos] = other[:, pos]
    return out


def window_mask(T: int, start: int, window: int) -> torch.Tensor:
    """A sliding-window layer's mask (Mistral, Gemma 3's local layers). T queries at positions
    start .. start+T-1, over the start+T keys the cache holds, window W -> [T, start+T] float:
    0 where query p may see key j, the causal rule and the window's, p - W < j <= p (itself
    and the W - 1 keys before it); float('-inf') elsewhere."""
    p = torch.arange(start, start + T)[:, None]  # [T, 1]: absolute positions
    j = torch.arange(start + T)[None, :]  # [1, S]
    blocked = (j > p) | (j <= p - window)  # the future, and keys W or more behind
    return torch.zeros(T, start + T).masked_fill(blocked, float("-inf"))  # [T, S]


SOLUTIONS = {name: globals()[name] for name in NAMES}


def solution(name: str) -> Callable:
    """The reference function of an exercise; its docstring states the exercise."""
    if name not in SOLUTIONS:
        raise LlmTraceError(f"no exercise named {name!r}: use one of {', '.join(NAMES)}")
    return SOLUTIONS[name]


# --- the cases: what each stage received and produced, from a trace of the running model ---------

@dataclass
class Case:
    """One exercise on one model: `call(fn)` runs fn on the recorded inputs (fresh copies) and
    returns what it made; `want` is what the model made; `compare(got, want)` says how they
    differ (None: they match); `what` names what matched, for the pass line."""
    call: Callable[[Callable], Any]
    want: Any
    what: str
    compare: Callable[[Any, Any], str | None]
    mistakes: list[tuple[Callable, str]] = field(default_factory=list)
    diagnose: Callable[[Any], str | None] | None = None  # a hint read off the result itself


class _Stub(Exception):
    """The learner's function returned None: not written yet."""


def _copy(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_copy(v) for v in x)
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    return x


def _caller(*args):
    """call(fn) = fn(*fresh copies of args); None from fn means a stub."""
    def call(fn):
        out = fn(*_copy(args))
        if out is None:
            raise _Stub
        return out
    return call


def _shape(t) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _fmt(x: float) -> str:
    return f"{x:.4g}"


def tensor_diff(got, want: torch.Tensor, rtol: float) -> str | None:
    """None when got matches want to rtol of want's largest finite |value| (infinities must match
    exactly); else the first difference, in words."""
    if not isinstance(got, torch.Tensor):
        return f"wanted a tensor {_shape(want)}, got {type(got).__name__}"
    if got.shape != want.shape:
        return f"shape: wanted {_shape(want)}, got {_shape(got)}"
    if got.dtype == torch.bool and want.dtype != torch.bool:
        return "wanted numbers, got True/False (a bool tensor)"
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    finite = torch.isfinite(w)
    scale = float(w[finite].abs().max()) if finite.any() else 0.0
    tol = rtol * max(scale, 1e-6)
    # NaN in got is bad (never in a recorded output); NaN matching NaN lets a mistake be recognised
    bad = ~((g == w) | ((g - w).abs() <= tol) | (g.isnan() & w.isnan()))
    if not bad.any():
        return None
    first = int(bad.flatten().nonzero()[0])
    idx = list(torch.unravel_index(torch.tensor(first), w.shape)) if w.dim() else []
    idx = [int(i) for i in idx]
    gap = (g - w).abs().nan_to_num(nan=math.inf, posinf=math.inf)  # inf: an infinity differs
    err = float(gap[bad].max())
    where = f"at {idx}" if idx else "the value"
    return (f"{where} wanted {_fmt(w.flatten()[first])}, got {_fmt(g.flatten()[first])} "
            f"(max error {err:.2g}, tolerance {tol:.2g})")


def _tensor_compare(rtol: float):
    return _with_rtol(lambda got, want: tensor_diff(got, want, rtol), rtol)


def _with_rtol(compare, rtol: float):
    compare.rtol = rtol  # for the pass line
    return compare


def _pair_compare(labels: tuple[str, str], rtol: float):
    def compare(got, want):
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            return f"wanted a pair ({labels[0]}, {labels[1]}), got {type(got).__name__}"
        for label, g, w in zip(labels, got, want):
            d = tensor_diff(g, w, rtol)
            if d:
                return f"{label}: {d}"
        return None
    return _with_rtol(compare, rtol)


def _generic_hint(got, want) -> str | None:
    """Hints that need no list of mistakes: swapped axes, a constant factor."""
    if not (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor)):
        return None
    if got.dim() >= 2 and got.shape != want.shape and \
            got.shape == want.shape[:-2] + want.shape[-1:] + want.shape[-2:-1]:
        return "the last two axes are swapped: a transposed matrix?"
    if got.shape == want.shape and not got.dtype == torch.bool:
        g, w = got.detach().double().flatten(), want.detach().double().flatten()
        ok = torch.isfinite(w) & torch.isfinite(g)
        if ok.sum() > 1 and float((w[ok] ** 2).sum()) > 0:
            c = float((g[ok] * w[ok]).sum() / (w[ok] ** 2).sum())
            if abs(c - 1) > 1e-3 and torch.allclose(g[ok], c * w[ok], rtol=1e-4,
                                                    atol=1e-6 * float(w[ok].abs().max())):
                return f"yours is the wanted result times {c:.3g}: a scale is wrong or missing"
    return None


# --- per-model data ------------------------------------------------------------------------------

_models: dict[str, Any] = {}  # load_model() per LLMTRACE_MODEL value
_data: dict[int, tuple[Any, dict]] = {}  # id(model) -> (model, {"trace": ..., name: Case})


def _default_model():
    key = os.environ.get("LLMTRACE_MODEL", "")
    if key not in _models:
        from . import load_model

        _models[key] = load_model()
    return _models[key]


def _store(model) -> dict:
    if id(model) not in _data or _data[id(model)][0] is not model:
        _data[id(model)] = (model, {})
    return _data[id(model)][1]


def _trace(model):
    store = _store(model)
    if "trace" not in store:
        store["logits"], store["trace"] = model.run(PROMPT)  # [1, T, V], the trace
    return store["trace"]


def _layer(model, i: int):
    return model.weights.layers[i]


def _stream_into(trace, layer: int) -> torch.Tensor:
    return trace["embed"] if layer == 0 else trace[f"layers.{layer - 1}.resid_out"]


# --- one builder per exercise --------------------------------------------------------------------

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters (a space is "Ġ")."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


WORDS = ["The", " capital", " of", " France", " is", " Paris", " tokenization",
         " unbelievably", " transformers"]


def _bpe_tables(model):
    """(symbols of a word, rank of a merged pair) for the running model's tokenizer."""
    tok = model.tokenizer
    store = _store(model)
    if "bpe" in store:
        return store["bpe"]
    if hasattr(tok, "sp"):  # SentencePiece: a pair merges into a piece of the vocabulary,
        sp = tok.sp  # the piece with the higher score first
        normal = [i for i in range(sp.get_piece_size())
                  if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))]
        by_score = sorted(normal, key=lambda i: -sp.get_score(i))
        piece_rank = {sp.id_to_piece(i): r for r, i in enumerate(by_score)}

        def symbols(word):
            return list("\u2581" + word.strip())

        def rank(a, b):
            return piece_rank.get(a + b)
        text = str.strip
    elif hasattr(tok, "tok"):  # Hugging Face byte-level BPE: the order of its merges
        import json

        merges = json.loads(tok.tok.to_str())["model"]["merges"]
        pair_rank = {}
        for r, m in enumerate(merges):
            pair = tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
            pair_rank.setdefault(pair, r)
        byte_char = _bytes_to_unicode()

        def symbols(word):
            return [byte_char[b] for b in word.encode("utf-8")]

        def rank(a, b):
            return pair_rank.get((a, b))
        text = str
    else:
        raise LlmTraceError(f"the tokenizer of {model.name} is neither SentencePiece nor "
                            "a Hugging Face BPE: bpe_merge cannot be checked on it")
    store["bpe"] = symbols, rank, text
    return store["bpe"]


def _priority(ranks: dict) -> Callable[[str, str], int | None]:
    """The priority function of a table {(left, right): rank}: None for a pair not in it."""
    return lambda a, b: ranks.get((a, b))


def _case_count_parameters(model) -> Case:
    from .model import state_dict_from_weights

    c = model.config
    want = sum(t.numel() for t in state_dict_from_weights(c, model.weights).values())
    if count_parameters(c) != want:  # the reference must count what was loaded
        raise LlmTraceError(f"{model.name} holds {want:,} parameters, not what its config "
                            "gives: count_parameters cannot be checked on it")

    def call(fn):
        got = fn(c)
        if got is None:
            raise _Stub
        return got

    def compare(got, want):
        if isinstance(got, torch.Tensor) and got.numel() == 1:
            got = got.item()
        if isinstance(got, float) and got.is_integer():
            got = int(got)
        if not isinstance(got, int) or isinstance(got, bool):
            return f"wanted a whole number, got {type(got).__name__}"
        if got != want:
            return f"wanted {want:,}, got {got:,} ({got - want:+,})"
        return None

    V, D, F, L = c.vocab_size, c.hidden_size, c.ffn_size, c.n_layers
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    head = V * D if c.tied_lm_head else -V * D  # what counting the head wrongly changes
    head_hint = ("the LM head is tied to the embedding: one matrix, counted once"
                 if c.tied_lm_head else
                 "the LM head is not tied to the embedding: a [V, D] matrix of its own")
    mistakes = [(head, head_hint),
                (2 * L * (q - kv) * D, "k_proj and v_proj have n_kv_heads heads, not n_heads "
                                       "(grouped-query attention)"),
                (-(2 * L + 1) * D, "the norms have weights too: two per block and the final "
                                   "one, hidden_size each"),
                (-D, "the final norm's weight is missing: hidden_size more"),
                (-2 * L * D, "each block has two norms, hidden_size weights each"),
                (-L * F * D, "the FFN has three matrices: gate, up and down")]
    return Case(call, want, f"the {want:,} parameters loaded", compare,
                [((lambda c, off=off: count_parameters(c) + off), hint)
                 for off, hint in mistakes if off])


def _case_bpe_merge(model) -> Case:
    symbols, rank, text = _bpe_tables(model)
    tok = model.tokenizer
    words = []
    for word in WORDS:
        sym = symbols(word)
        s = "".join(sym)
        ranks = {}  # every split of every substring of the word that the tokenizer may merge
        for i in range(len(s)):
            for k in range(i + 2, len(s) + 1):
                for j in range(i + 1, k):
                    r = rank(s[i:j], s[j:k])
                    if r is not None:
                        ranks[(s[i:j], s[j:k])] = r
        pieces = [tok.id_to_piece(i) for i in tok.encode(text(word), bos=False)]
        if bpe_merge(sym, _priority(ranks)) == pieces:  # a word split by merges alone
            words.append((word, sym, ranks, pieces))
    if len(words) < 3:
        raise LlmTraceError(f"the tokenizer of {model.name} does not split words by its merges "
                            "alone: bpe_merge cannot be checked on it")

    def call(fn):
        out = []
        for _, sym, ranks, _ in words:
            got = fn(list(sym), _priority(dict(ranks)))
            if got is None:
                raise _Stub
            out.append(list(got) if isinstance(got, (list, tuple)) else got)
        return out

    def compare(got, want):
        for (word, *_), g, w in zip(words, got, want):
            if g != w:
                return f"the word {word!r}: wanted {w}, got {g}"
        return None

    def mergeable(pieces, priority):  # [(rank, index)] of the pairs that may merge
        pairs = [(priority(a, b), i) for i, (a, b) in enumerate(zip(pieces, pieces[1:]))]
        return [(r, i) for r, i in pairs if r is not None]

    def highest_first(symbols, priority):
        pieces = list(symbols)
        while True:
            pairs = mergeable(pieces, priority)
            if not pairs:
                return pieces
            _, i = max(pairs)
            pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]

    def left_to_right(symbols, priority):
        pieces = list(symbols)
        i = 0
        while i < len(pieces) - 1:
            if priority(pieces[i], pieces[i + 1]) is not None:
                pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
            else:
                i += 1
        return pieces

    def one_pass(symbols, priority):
        pieces = list(symbols)
        pairs = mergeable(pieces, priority)
        if pairs:
            _, i = min(pairs)
            pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
        return pieces

    return Case(call, [w[3] for w in words],
                f"the tokenizer's own pieces for {len(words)} words", compare, [
                    (highest_first, "the LOWEST rank merges first (rank 0 is the first merge)"),
                    (left_to_right, "merge by rank, not left to right: at each step the "
                                    "lowest-ranked adjacent pair, wherever it is"),
                    (one_pass, "one merge is not enough: repeat until no adjacent pair may "
                               "merge")])


def _case_embed(model) -> Case:
    trace = _trace(model)
    ids, table = trace["tokens"], model.weights.embed
    return Case(_caller(ids, table), trace["embed"], f"embed {_shape(trace['embed'])}",
                _tensor_compare(1e-6), [
                    (lambda ids, table: table.T[ids], "the table is [V, D], one ROW per token: "
                                                      "table[ids]"),
                    (lambda ids, table: table[ids - 1], "token ids count from 0: row `id` "
                                                        "is table[id]")])


def _case_rms_norm(model) -> Case:
    trace, c = _trace(model), model.config
    x = trace["embed.scaled"] if c.embed_scale else _stream_into(trace, 0)  # Gemma
    w = _layer(model, 0).attn_norm
    want = trace["layers.0.attn_norm"]

    def rsqrt_ms(x, eps):
        return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    eps_hint = "eps goes INSIDE the square root: x / sqrt(mean(x^2) + eps)"
    return Case(_caller(x, w, c.norm_eps), want,
                f"layers.0.attn_norm {_shape(want)}", _tensor_compare(1e-5), [
                    (lambda x, w, eps: w * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps),
                     eps_hint),
                    (lambda x, w, eps: w * x / x.pow(2).mean(-1, keepdim=True).sqrt(),
                     eps_hint + " (it is missing)"),
                    (lambda x, w, eps: x * rsqrt_ms(x, eps), "multiply by the weight at the end"),
                    (lambda x, w, eps: w * x * torch.rsqrt(x.pow(2).mean(-2, keepdim=True) + eps),
                     "the mean is over the LAST axis: each token's own vector"),
                    (lambda x, w, eps: w * x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps),
                     "the MEAN of the squares, not their sum"),
                    (lambda x, w, eps: w * (x - x.mean(-1, keepdim=True)) * rsqrt_ms(
                        x - x.mean(-1, keepdim=True), eps),
                     "RMSNorm subtracts no mean (that is LayerNorm)")])


def _rope_inputs(model):
    trace, c = _trace(model), model.config
    T = trace.shape("layers.0.attn.q")[1]
    local = c.rope_local_theta and c.layer_types and c.is_sliding(0)  # Gemma 3
    return torch.arange(T), c.head_dim, c.rope_local_theta if local else c.rope_theta


def _rope_in(model) -> torch.Tensor:
    """What layer 0 rotates: q, or q_norm where the family normalizes it (Qwen3, Gemma 3)."""
    return _trace(model)["layers.0.attn.q_norm" if model.config.qk_norm else "layers.0.attn.q"]


def _case_rope_cos_sin(model) -> Case:
    trace = _trace(model)
    positions, hd, theta = _rope_inputs(model)
    want = rope_cos_sin(positions, hd, theta)
    # the reference must turn the recorded q into the recorded rope_q, or the check is wrong
    made = rope_rotate(_rope_in(model), *want)
    problem = tensor_diff(made, trace["layers.0.attn.rope_q"], 1e-5)
    if problem:
        raise LlmTraceError(f"this model's RoPE is not the plain formula ({problem}): "
                            "rope_cos_sin cannot be checked on it")

    def interleaved(positions, hd, theta):
        freqs = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
        angles = (positions.float()[:, None] * freqs).repeat_interleave(2, -1)
        return angles.cos(), angles.sin()

    def half_only(positions, hd, theta):
        angles = positions.float()[:, None] / theta ** (torch.arange(0, hd, 2).float() / hd)
        return angles.cos(), angles.sin()

    def exponent_i(positions, hd, theta):
        freqs = 1.0 / theta ** (torch.arange(hd // 2).float() / hd)
        angles = positions.float()[:, None] * freqs
        angles = torch.cat([angles, angles], -1)
        return angles.cos(), angles.sin()

    return Case(_caller(positions, hd, theta), want,
                f"the cos, sin {_shape(want[0])} of rope_q",
                _pair_compare(("cos", "sin"), 1e-5), [
                    (interleaved, "that is the adjacent-pair layout (2i, 2i+1), repeat_interleave; "
                                  "here dimension d pairs with d + head_dim/2: "
                                  "torch.cat([angles, angles], -1)"),
                    (half_only, "one angle per pair, and each pair has two dimensions: "
                                "repeat the angles to head_dim with torch.cat([a, a], -1)"),
                    (exponent_i, "freq_i = theta^(-2i / head_dim): the exponent steps by 2"),
                    (lambda p, hd, theta: rope_cos_sin(p + 1, hd, theta),
                     "positions count from 0: the first token is not rotated")])


def _case_rope_rotate(model) -> Case:
    from .rope import rope_cos_sin as model_cos_sin  # with Llama 3's rope_scaling

    trace = _trace(model)
    cos, sin = model_cos_sin(*_rope_inputs(model), model.config.rope_scaling)
    x, want = _rope_in(model), trace["layers.0.attn.rope_q"]

    def adjacent(x, cos, sin):
        half = x.shape[-1] // 2
        c, s = cos[:, None, :half], sin[:, None, :half]
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * c - b * s, b * c + a * s], -1).flatten(-2)

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def no_minus(x, cos, sin):
        half = x.shape[-1] // 2
        r = torch.cat([x[..., half:], x[..., :half]], dim=-1)
        return x * cos[:, None] + r * sin[:, None]

    return Case(_caller(x, cos, sin), want, f"layers.0.attn.rope_q {_shape(want)}",
                _tensor_compare(1e-5), [
                    (adjacent, "that is the adjacent-pair convention (2i, 2i+1), Meta's; the "
                               "library pairs d with d + head_dim/2 (rotate-half)"),
                    (lambda x, cos, sin: x * cos[:, None] - rotate_half(x) * sin[:, None],
                     "the rotation turns the wrong way: x[d] cos - x[d+half] sin, "
                     "x[d+half] cos + x[d] sin"),
                    (no_minus, "rotate-half is (-x2, x1): the second half comes first, negated"),
                    (lambda x, cos, sin: x * cos + rotate_half(x) * sin,
                     "cos and sin are [T, head_dim]: give them a head axis, cos[:, None, :]")])


def _attn(trace):
    """Layer 0's attention tensors, heads first: q [B, H, T, hd], k and v expanded."""
    q = trace["layers.0.attn.rope_q"].transpose(1, 2)  # [B, H, T, hd]
    return q, trace["layers.0.attn.k_expanded"], trace["layers.0.attn.v_expanded"]


def _case_attn_scores(model) -> Case:
    trace = _trace(model)
    q, k, _ = _attn(trace)
    want = trace["layers.0.attn.scores"]
    return Case(_caller(q, k), want, f"layers.0.attn.scores {_shape(want)}",
                _tensor_compare(1e-5), [
                    (lambda q, k: q @ k.transpose(-2, -1),
                     "the 1/sqrt(head_dim) scale is missing"),
                    (lambda q, k: q @ k.transpose(-2, -1) / q.shape[-1],
                     "the scale is 1/sqrt(head_dim), not 1/head_dim"),
                    (lambda q, k: k @ q.transpose(-2, -1) / math.sqrt(q.shape[-1]),
                     "transposed: row i is query i, column j key j: q @ k^T, not k @ q^T")])


def _case_causal_mask(model) -> Case:
    trace = _trace(model)
    want = trace["layers.0.attn.causal_mask"]
    T = want.shape[0]
    inf = float("-inf")

    def diagnose(got):
        blocked = torch.isinf(want)
        if isinstance(got, torch.Tensor) and got.shape == want.shape and bool(
                (got[~blocked] == 0).all() and (got[blocked] <= -1e4).all()):
            return ("the right places, but the mask the model adds holds float('-inf'), "
                    "not a large negative number")
        return None
    return Case(_caller(T), want, f"layers.0.attn.causal_mask {_shape(want)}",
                _tensor_compare(1e-6), [
                    (lambda T: torch.full((T, T), inf).triu(0),
                     "a mask off by one: a token sees itself, keep the diagonal at 0 "
                     "(triu(diagonal=1))"),
                    (lambda T: torch.full((T, T), inf).triu(2),
                     "a mask off by one: the next token is visible, block from the diagonal + 1"),
                    (lambda T: torch.full((T, T), inf).tril(-1),
                     "the future is ABOVE the diagonal (key j > query i): you masked the past"),
                    (lambda T: torch.ones(T, T, dtype=torch.bool).triu(1),
                     "the mask is added to the scores: 0 where allowed, float('-inf') where "
                     "blocked, not True/False")], diagnose)


def _case_softmax(model) -> Case:
    trace = _trace(model)
    scores, want = trace["layers.0.attn.masked_scores"], trace["layers.0.attn.weights"]
    return Case(_caller(scores), want, f"layers.0.attn.weights {_shape(want)}",
                _tensor_compare(1e-5), [
                    (lambda s: s.softmax(-2), "softmax over the wrong axis: over the keys, "
                                              "the LAST axis, so that each row sums to 1"),
                    (lambda s: s.softmax(1), "softmax over the wrong axis (the heads): over the "
                                             "keys, the last axis"),
                    (lambda s: s.exp(), "divide by the sum of each row: the weights sum to 1")])


def _case_repeat_kv(model) -> Case:
    trace, c = _trace(model), model.config
    k = trace["layers.0.attn.rope_k"].transpose(1, 2)  # [B, KV, S, hd]
    want = trace["layers.0.attn.k_expanded"]
    n_rep = c.n_heads // c.n_kv_heads
    return Case(_caller(k, n_rep), want, f"layers.0.attn.k_expanded {_shape(want)}",
                _tensor_compare(1e-6), [
                    (lambda k, n: k.repeat(1, n, 1, 1),
                     "the heads are tiled (0, 1, 2, 0, 1, 2...): each KV head serves n_rep "
                     "CONSECUTIVE query heads, repeat_interleave(n_rep, dim=1)"),
                    (lambda k, n: k.repeat_interleave(n, dim=2),
                     "repeat along the heads axis (dim 1), not the positions")])


def _case_weighted_sum(model) -> Case:
    trace = _trace(model)
    _, _, v = _attn(trace)
    w, want = trace["layers.0.attn.weights"], trace["layers.0.attn.weighted_sum"]
    return Case(_caller(w, v), want, f"layers.0.attn.weighted_sum {_shape(want)}",
                _tensor_compare(1e-5), [
                    (lambda w, v: w.transpose(-2, -1) @ v,
                     "transposed weights: row i holds query i's weights over the keys: "
                     "weights @ v"),
                    (lambda w, v: (w * w.shape[-1]) @ v,
                     "the weights already sum to 1: no further scale")])


def _case_kv_cache_step(model) -> Case:
    trace, c = _trace(model), model.config
    q_all = trace["layers.0.attn.rope_q"][0]  # [T, H, hd]
    k_all, v_all = trace["layers.0.attn.rope_k"][0], trace["layers.0.attn.v"][0]  # [T, KV, hd]
    T, pos, max_len = q_all.shape[0], q_all.shape[0] - 1, q_all.shape[0] + 3
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

    def call(fn):
        q, k_new, v_new, kc, vc, p = _copy(args)
        out = fn(q, k_new, v_new, kc, vc, p)
        if out is None:
            raise _Stub
        return out, bool(torch.equal(kc[p], k_new) and torch.equal(vc[p], v_new))

    def compare(got, want):
        d = tensor_diff(got[0], want[0], 1e-5)
        if d or got[1] == want[1]:
            return d
        return ("the output is right, but the cache does not hold k_new and v_new at pos: "
                "write them there, the next step reads them")
    compare = _with_rtol(compare, 1e-5)

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

    return Case(call, (want, True), f"the step's output {_shape(want)} and the cache", compare, [
                    (step(True, lambda p: p), "read positions 0..pos INCLUDED: "
                                              "k_cache[:pos + 1] (off by one)"),
                    (step(True, lambda p: None), "read only positions 0..pos: the cache beyond "
                                                 "holds nothing yet, k_cache[:pos + 1]"),
                    (step(False, lambda p: p + 1), "write k_new and v_new at pos before reading"),
                    (step(True, lambda p: p + 1, scale=False),
                     "the 1/sqrt(head_dim) scale is missing"),
                    (step(True, lambda p: p + 1, tiled=True),
                     "each KV head serves n_rep consecutive query heads: repeat_interleave")])


def _case_swiglu(model) -> Case:
    trace = _trace(model)
    lw = _layer(model, 0)
    x, want = trace["layers.0.mlp_norm"], trace["layers.0.mlp.down"]
    return Case(_caller(x, lw.gate, lw.up, lw.down), want,
                f"layers.0.mlp.down {_shape(want)}", _tensor_compare(1e-5), [
                    (lambda x, g, u, d: F.linear(F.silu(F.linear(x, u)) * F.linear(x, g), d),
                     "SiLU goes on the GATE's output, not on up's"),
                    (lambda x, g, u, d: F.linear(F.relu(F.linear(x, g)) * F.linear(x, u), d),
                     "SwiGLU uses SiLU, silu(g) = g * sigmoid(g), not ReLU"),
                    (lambda x, g, u, d: F.linear(F.gelu(F.linear(x, g)) * F.linear(x, u), d),
                     "SwiGLU uses SiLU, silu(g) = g * sigmoid(g), not GELU"),
                    (lambda x, g, u, d: F.linear(torch.sigmoid(F.linear(x, g)) * F.linear(x, u),
                                                 d),
                     "silu(g) = g * sigmoid(g): the sigmoid alone is missing the factor g"),
                    (lambda x, g, u, d: ((x @ g) * (x @ u)) @ d,
                     "a transposed matrix: the weights are stored (out, in); use x @ W.T or "
                     "F.linear(x, W)")])


def _layer_fns(model, i: int):
    """Layer i's attention, MLP and norms as functions [B, T, D] -> [B, T, D], written with the
    reference solutions (no cache: the prompt's positions only)."""
    c, lw = model.config, _layer(model, i)
    H, KV, hd = c.n_heads, c.n_kv_heads, c.head_dim
    if not _llama2_layer(c):  # a later family: the library's sublayers
        return _library_layer_fns(model, i)

    def attn(x):  # [B, T, D]
        B, T, _ = x.shape
        cos, sin = rope_cos_sin(torch.arange(T), hd, c.rope_theta)
        q = rope_rotate(F.linear(x, lw.q_proj).view(B, T, H, hd), cos, sin)  # [B, T, H, hd]
        k = rope_rotate(F.linear(x, lw.k_proj).view(B, T, KV, hd), cos, sin)  # [B, T, KV, hd]
        v = F.linear(x, lw.v_proj).view(B, T, KV, hd)  # [B, T, KV, hd]
        k = repeat_kv(k.transpose(1, 2), H // KV)  # [B, H, T, hd]
        v = repeat_kv(v.transpose(1, 2), H // KV)  # [B, H, T, hd]
        s = attn_scores(q.transpose(1, 2), k) + causal_mask(T)  # [B, H, T, T]
        out = weighted_sum(softmax(s), v).transpose(1, 2).reshape(B, T, H * hd)
        return F.linear(out, lw.o_proj)  # [B, T, D]

    def mlp(x):
        return swiglu(x, lw.gate, lw.up, lw.down)

    def norm1(x):
        return rms_norm(x, lw.attn_norm, c.norm_eps)

    def norm2(x):
        return rms_norm(x, lw.mlp_norm, c.norm_eps)
    return attn, mlp, norm1, norm2


def _llama2_layer(c) -> bool:
    """Whether a layer is Llama 2's, as the reference solutions write it."""
    return not (c.qk_norm or c.qkv_bias or c.sliding_window or c.sandwich_norm
                or c.norm_offset or c.mlp_act != "silu" or c.rope_scaling
                or c.attn_scale)


def _library_layer_fns(model, i: int):
    """Layer i's sublayers as the library computes them, for families the reference
    solutions do not cover (QK-norm, windows, Gemma's norms...): the residual adds stay."""
    from .attention import Positions, attention
    from .mlp import swiglu as lib_swiglu
    from .norm import rms_norm as lib_norm
    c, lw = model.config, _layer(model, i)
    eps, off = c.norm_eps, c.norm_offset

    def post(h, weight):  # Gemma normalizes each sublayer's output before the add
        return lib_norm(h, weight, eps, offset=off) if c.sandwich_norm else h

    def attn(x):  # [B, T, D]
        pos = Positions.of(0, x.shape[1], c, x.device)
        pos = pos.local if pos.local and c.is_sliding(i) else pos
        h = attention(x, lw, c, pos)
        return post(h, getattr(lw, "post_attn_norm", None))

    def mlp(x):
        return post(lib_swiglu(x, lw, act=c.mlp_act), getattr(lw, "post_mlp_norm", None))

    def norm1(x):
        return lib_norm(x, lw.attn_norm, eps, offset=off)

    def norm2(x):
        return lib_norm(x, lw.mlp_norm, eps, offset=off)
    return attn, mlp, norm1, norm2


def _case_residual_block(model) -> Case:
    trace = _trace(model)
    x, want = _stream_into(trace, 0), trace["layers.0.resid_out"]
    if "embed.scaled" in trace:  # Gemma: the stream starts from the scaled rows
        x = trace["embed.scaled"]
    fns = _layer_fns(model, 0)

    def call(fn):
        out = fn(_copy(x), *fns)
        if out is None:
            raise _Stub
        return out

    # a mistake is a function of (x, attn, mlp, norm1, norm2), like the learner's
    mistakes = [
        (lambda x, a, m, n1, n2: n2((h := n1(x + a(x))) + m(h)),
         "pre-norm: the norms apply to each sublayer's INPUT, x + attn(norm1(x)); "
         "the stream itself is never normalized"),
        (lambda x, a, m, n1, n2: m(n2(a(n1(x)))),
         "the residual connections are missing: add each sublayer's output to the stream"),
        (lambda x, a, m, n1, n2: x + a(n1(x)) + m(n2(x)),
         "the MLP reads h = x + attn(norm1(x)), the stream after attention, not x"),
        (lambda x, a, m, n1, n2: x + m(n2(x + a(n1(x)))),
         "add the attention output to the stream too: h = x + attn(norm1(x)); "
         "out = h + mlp(norm2(h))")]
    return Case(call, want, f"layers.0.resid_out {_shape(want)}",
                _tensor_compare(1e-4), mistakes)


def _case_lm_head(model) -> Case:
    trace, c, w = _trace(model), model.config, model.weights
    x, want = trace[f"layers.{c.n_layers - 1}.resid_out"], trace["lm_head"]

    def norm(x, nw, eps):
        return nw * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    gain = w.final_norm + (1.0 if c.norm_offset else 0.0)  # Gemma: (1 + weight)
    return Case(_caller(x, gain, w.lm_head, c.norm_eps), want,
                f"lm_head, the logits, {_shape(want)}", _tensor_compare(1e-4), [
                    (lambda x, nw, head, eps: x @ head.T,
                     "the final norm is missing: normalize x first, then the head"),
                    (lambda x, nw, head, eps: (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                               + eps)) @ head.T,
                     "the final norm's weight is missing"),
                    (lambda x, nw, head, eps: norm(x, nw, eps) @ head,
                     "a transposed matrix: head is [V, D]: x @ head.T")])


def _sampling_inputs(model):
    """The last position's logits, and top-p's parameters: k = 10, temperature 1.5, and p near 0.9
    but halfway between two cumulative sums, so that no CPU's rounding moves the boundary."""
    trace = _trace(model)
    logits = trace["lm_head"][0, -1].detach().clone()  # [V]
    temperature, k = 1.5, 10
    probs = top_k(logits / temperature, k).softmax(-1).sort(descending=True).values
    cum = probs.cumsum(-1)[:k].tolist()
    j = next((i for i, x in enumerate(cum) if x >= 0.9), k - 1)
    p = round((cum[j] + (cum[j - 1] if j else 0.0)) / 2, 4)
    return logits, temperature, k, p


def _case_top_k(model) -> Case:
    logits, _, k, _ = _sampling_inputs(model)
    want = top_k(logits, k)
    inf = float("-inf")
    return Case(_caller(logits, k), want, f"the top-{k} of the last logits {_shape(want)}",
                _tensor_compare(1e-6), [
                    (lambda l, k: l.masked_fill(l > l.topk(k, largest=False).values[-1], inf),
                     "keep the k LARGEST logits"),
                    (lambda l, k: l.masked_fill(l < l.topk(k + 1).values[-1], inf),
                     "off by one: keep exactly k tokens"),
                    (lambda l, k: l.masked_fill(l < l.topk(k - 1).values[-1], inf),
                     "off by one: keep exactly k tokens"),
                    (lambda l, k: l.masked_fill(l < l.topk(k).values[-1], 0.0),
                     "set the others to float('-inf'), not 0 (a logit of 0 is a likely token)"),
                    (lambda l, k: top_k(l, k).softmax(-1),
                     "return the filtered LOGITS; the softmax comes later")])


def _case_top_p(model) -> Case:
    logits, temperature, k, p = _sampling_inputs(model)
    want = top_p(logits, temperature, k, p)

    def nucleus(probs, p, rule):
        sp, order = probs.sort(descending=True)
        keep = rule(sp.cumsum(-1), sp, p)
        keep[0] = True
        return torch.zeros_like(probs).scatter(-1, order, sp * keep)

    def before_reaches(cum, sp, p):
        return (cum - sp) < p

    def p_then_k(l, t, k, p):
        probs = (l / t).softmax(-1)
        kept = nucleus(probs, p, before_reaches)
        kept = kept.masked_fill(l < l.topk(k).values[-1], 0.0)
        return kept / kept.sum()

    def cum_le_p(l, t, k, p):
        kept = nucleus(top_k(l / t, k).softmax(-1), p, lambda cum, sp, p: cum <= p)
        return kept / kept.sum()

    def not_renormalized(l, t, k, p):
        return nucleus(top_k(l / t, k).softmax(-1), p, before_reaches)

    return Case(_caller(logits, temperature, k, p), want,
                f"what HF's warpers keep {_shape(want)}", _tensor_compare(1e-5), [
                    (p_then_k, "top-p was cut before top-k: HF's order is temperature, top-k, "
                               "then top-p on the RENORMALIZED top-k probabilities"),
                    (cum_le_p, "keep the token that crosses p: remove a token once the mass "
                               "BEFORE it reaches p"),
                    (not_renormalized, "renormalize: the kept probabilities must sum to 1"),
                    (lambda l, t, k, p: top_p(l * t * t, t, k, p),
                     "DIVIDE the logits by the temperature")])


class _Step:
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


N_NEW = 3  # tokens the decode loop exercise generates


def _case_decode_loop(model) -> Case:
    ids = model.encode(PROMPT)  # [1, T]
    T = ids.shape[1]
    want_calls = [(0, T)] + [(T + i, 1) for i in range(N_NEW - 1)]

    _trace(model)
    memo = {tuple(ids[0].tolist()): _store(model)["logits"]}  # the prefill has run already

    def call(fn):
        step = _Step(model, memo)
        out = fn(step, ids.clone(), N_NEW)
        if out is None:
            raise _Stub
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

    def diagnose(got):
        _, calls = got
        for i, ((s, t), (ws, wt)) in enumerate(zip(calls, want_calls)):
            if i and t == 1 and s != ws:
                return (f"step call {i} had start={s}, wanted {ws}: the decode loop forgets the "
                        f"KV cache position (start is the new token's own position: the "
                        f"prompt's length, then one more per step)")
        return None

    def from_zero(step, ids, n):
        logits = step(ids, 0)
        tokens = [int(logits[0, -1].argmax())]
        while len(tokens) < n:
            tokens.append(int(step(torch.tensor([[tokens[-1]]]), 0)[0, -1].argmax()))
        return tokens

    def first_position(step, ids, n):
        logits = step(ids, 0)
        tokens, pos = [int(logits[0, 0].argmax())], ids.shape[1]
        while len(tokens) < n:
            tokens.append(int(step(torch.tensor([[tokens[-1]]]), pos)[0, -1].argmax()))
            pos += 1
        return tokens

    want = call(decode_loop)
    return Case(call, want, f"{N_NEW} greedy tokens, each step at its cache position", compare, [
                    (from_zero, "the decode loop forgets the KV cache position: pass each new "
                                "token's own position as start"),
                    (first_position, "the next token comes from the LAST position's logits, "
                                     "logits[0, -1]")], diagnose)


def _case_patch_country(model) -> Case:
    ids, other_ids = model.encode(PROMPT), model.encode(OTHER)  # [1, T] each
    differ = (ids != other_ids).nonzero() if ids.shape == other_ids.shape else []
    if len(differ) != 1:
        raise LlmTraceError(f"{model.name}'s tokenizer does not split {PROMPT!r} and {OTHER!r} "
                            "into the same number of tokens differing in one: patch_country "
                            "cannot be checked on it")
    pos = int(differ[0, 1])
    L = model.config.n_layers
    name = f"layers.{max(L // 2 - 1, 0)}.resid_out"  # the stream entering the middle layer
    other = model.run(other_ids, names=[name])[1][name]  # [1, T, D]
    stream = _trace(model)[name]

    def call(fn):
        if fn(stream.clone(), other.clone(), pos) is None:  # a stub, before any model run
            raise _Stub
        logits, _ = model.run(ids, keep_values=False,
                              patch={name: lambda t: fn(t, other.clone(), pos)})
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
    return Case(call, want, f"the patched logits {_shape(want)}",
                _tensor_compare(1e-4), mistakes)


WINDOW = 3  # the window window_mask is checked with: shorter than any prompt here


def _case_window_mask(model) -> Case:
    """The masks the running model's layer 0 records when its config is given a window: the
    prefill of the prompt, then one decode step reading the cache."""
    from .model import Model
    from .trace import Trace

    c = model.config
    every = {"layer_types": ()} if c.layer_types else {}  # every layer slides
    first = dataclasses.replace(model.weights, layers=model.weights.layers[:1])  # layer 0 alone
    windowed = Model(c.replace(sliding_window=WINDOW, n_layers=1, **every), first,
                     model.tokenizer)
    ids = model.encode(PROMPT)  # [1, T]
    T, name = ids.shape[1], "layers.0.attn.window_mask"
    cache = windowed.new_cache(T + 1)
    prefill, step = Trace(names=[name]), Trace(names=[name])
    windowed.forward(ids, prefill, cache)
    windowed.forward(ids[:, -1:], step, cache, start=T)  # [1, 1]: any token will do
    want = (prefill[name], step[name])  # [T, T], [1, T + 1]
    inf = float("-inf")

    def relative(T, start, W):  # query i taken to sit at position i
        p, j = torch.arange(T)[:, None], torch.arange(start + T)[None, :]
        return torch.zeros(T, start + T).masked_fill((j > p) | (j <= p - W), inf)

    def causal_only(T, start, W):
        return window_mask(T, start, start + T + 1)

    def window_only(T, start, W):
        p, j = torch.arange(start, start + T)[:, None], torch.arange(start + T)[None, :]
        return torch.zeros(T, start + T).masked_fill(j <= p - W, inf)

    return Case(lambda fn: (_caller(T, 0, WINDOW)(fn), _caller(1, T, WINDOW)(fn)), want,
                f"the window masks {_shape(want[0])}, {_shape(want[1])} "
                f"(window {WINDOW})",
                _pair_compare(("prefill", "decode step"), 1e-6), [
                    (causal_only, "that is the causal mask alone: keys `window` or more "
                                  "behind the query are blocked too"),
                    (window_only, "the future is blocked too: the window adds to the "
                                  "causal mask"),
                    (lambda T, s, W: window_mask(T, s, W + 1),
                     "off by one: a query sees itself and the window - 1 keys before it, "
                     "block j <= p - window"),
                    (lambda T, s, W: window_mask(T, s, W - 1),
                     "off by one: a query sees `window` keys, itself included"),
                    (relative, "positions are absolute: query i of a pass sits at start + i, "
                               "and the cache holds keys 0 .. start + T - 1")])


BUILDERS = {name: globals()[f"_case_{name}"] for name in NAMES}


def _case(name: str, model) -> Case:
    store = _store(model)
    if name not in store:
        store[name] = BUILDERS[name](model)
    return store[name]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _same_error(a: BaseException, b: BaseException) -> bool:
    """The same message, but for the index an out-of-bounds error names: with several threads,
    the indexing kernel reports whichever bad index a thread met first."""
    def norm(e):
        return re.sub(r"index -?\d+ is out of bounds", "index is out of bounds", str(e))
    return norm(a) == norm(b)


def _mistake_hint(case: Case, got, exc: BaseException | None) -> str | None:
    """The hint of the first known mistake that gives the same result (or raises the same
    error) as the learner's function."""
    for wrong, hint in case.mistakes:
        try:
            theirs = case.call(wrong)
        except _Stub:
            continue
        except Exception as e:  # noqa: BLE001: a mistake may fail as the learner's did
            if exc is not None and type(e) is type(exc) and _same_error(e, exc):
                return hint
            continue
        if exc is None:
            try:
                if case.compare(got, theirs) is None:
                    return hint
            except Exception:  # noqa: BLE001
                continue
    return None


def check(name: str, fn: Callable, model=None) -> bool:
    """Run fn on the recorded inputs of stage `name`, compare with the recorded output, print one
    line and return True on a match. Never raises (an error becomes a False with its message)."""
    if name not in BUILDERS:
        print(f"✗ no exercise named {name!r}: use one of {', '.join(NAMES)}")
        return False
    try:
        model = model if model is not None else _default_model()
        case = _case(name, model)
    except Exception as e:  # noqa: BLE001: the notebook must go on
        print(f"✗ {name}: the check could not run on this model: {_first_line(e)}")
        return False
    try:
        got = case.call(fn)
    except (_Stub, NotImplementedError):
        print(f"… {name}: not written yet: replace the stub with your code")
        return False
    except Exception as e:  # noqa: BLE001: the learner's error, in one line
        hint = _mistake_hint(case, None, e)
        print(f"✗ {name}: your function raised {_first_line(e)}"
              + (f"; hint: {hint}" if hint else ""))
        return False
    try:
        problem = case.compare(got, case.want)
    except Exception as e:  # noqa: BLE001: an output of an unexpected kind
        problem = f"the result could not be compared ({_first_line(e)})"
    if problem is None:
        print(f"✓ {name}: matches {case.what} {_tolerance(case)}")
        return True
    try:
        hint = (case.diagnose(got) if case.diagnose else None) \
            or _mistake_hint(case, got, None) or _generic_hint(_main(got), _main(case.want))
    except Exception:  # noqa: BLE001: no hint rather than no verdict
        hint = None
    print(f"✗ {name}: {problem}" + (f"; hint: {hint}" if hint else ""))
    return False


def _main(x):
    """The tensor a generic hint looks at."""
    return x[0] if isinstance(x, tuple) and x and isinstance(x[0], torch.Tensor) else x


def _tolerance(case: Case) -> str:
    rtol = getattr(case.compare, "rtol", None)
    return "exactly" if rtol is None else f"within {rtol:.0e}"
