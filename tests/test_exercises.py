"""The exercises: every reference solution passes its check on the embedded model and on the tiny
random checkpoint; a typical wrong version of each fails with a line that names the mistake; a stub
and a crashing function give one line and False, never an exception."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

from llmtrace import load_model
from helpers import verdict
from llmtrace.exercises import CHAPTERS, NAMES, check, solution


@pytest.fixture(scope="module", params=["embedded", "tiny"])
def model(request):
    if request.param == "embedded":
        return load_model("embedded")
    return request.getfixturevalue("tiny")


def test_names_and_chapters():
    assert len(NAMES) >= 12 and len(set(CHAPTERS.values())) >= 10
    assert list(CHAPTERS) == NAMES and sorted(CHAPTERS.values()) == list(CHAPTERS.values())
    for name in NAMES:
        assert solution(name).__doc__, f"{name} has no statement"


@pytest.mark.parametrize("name", NAMES)
def test_every_solution_passes(capsys, model, name):
    ok, line = verdict(capsys, name, solution(name), model)
    assert ok and line.startswith(f"✓ {name}: matches "), line
    # a pass line prints no measured float, only shapes, names and the stated tolerance
    assert not re.search(r"\d\.\d", line), line


def _stub(*args):
    ...


def _not_implemented(*args):
    raise NotImplementedError


@pytest.mark.parametrize("stub", [_stub, _not_implemented])
def test_a_stub_is_not_written_yet(capsys, model, stub):
    for name in NAMES:
        ok, line = verdict(capsys, name, stub, model)
        assert not ok and line == f"… {name}: not written yet: replace the stub with your code"


def test_errors_become_false_with_their_message(capsys, model):
    def boom(*args):
        raise KeyError("no such thing")

    ok, line = verdict(capsys, "rms_norm", boom, model)
    assert not ok and line == "✗ rms_norm: your function raised KeyError: 'no such thing'"
    ok, line = verdict(capsys, "embed", lambda ids, table: "text", model)
    assert not ok and "wanted a tensor" in line and "got str" in line
    ok, line = verdict(capsys, "softmax", lambda s: s[..., :2], model)
    assert not ok and "shape: wanted" in line
    ok, line = verdict(capsys, "rms_norm_typo", _stub, model)
    assert not ok and "no exercise named 'rms_norm_typo'" in line


# --- typical wrong versions, each with the words its verdict must contain ------------------------

def bpe_highest_rank_first(symbols, priority):
    pieces = list(symbols)
    while True:
        pairs = [(priority(a, b), i) for i, (a, b) in enumerate(zip(pieces, pieces[1:]))]
        pairs = [(r, i) for r, i in pairs if r is not None]
        if not pairs:
            return pieces
        _, i = max(pairs)
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]


def rms_norm_eps_outside(x, weight, eps):
    return weight * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps)


def rope_cos_sin_interleaved(positions, head_dim, theta):
    freqs = theta ** -(torch.arange(0, head_dim, 2).float() / head_dim)
    angles = (positions.float()[:, None] * freqs).repeat_interleave(2, -1)
    return angles.cos(), angles.sin()


def rope_rotate_adjacent(x, cos, sin):
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * c - odd * s, odd * c + even * s], -1).flatten(-2)


def kv_cache_step_reads_one_short(q, k_new, v_new, k_cache, v_cache, pos):
    k_cache[pos], v_cache[pos] = k_new, v_new
    n_rep = q.shape[0] // k_new.shape[0]
    k = k_cache[:pos].repeat_interleave(n_rep, 1).transpose(0, 1)
    v = v_cache[:pos].repeat_interleave(n_rep, 1).transpose(0, 1)
    w = (q[:, None] @ k.transpose(1, 2) / math.sqrt(q.shape[-1])).softmax(-1)
    return (w @ v)[:, 0]


def top_p_before_top_k(logits, temperature, k, p):
    probs = (logits / temperature).softmax(-1)
    sorted_probs, order = probs.sort(descending=True)
    sorted_probs[(sorted_probs.cumsum(-1) - sorted_probs) >= p] = 0  # top-p first
    sorted_probs[k:] = 0  # then top-k
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum()


def decode_loop_forgets_position(step, prompt_ids, n_new):
    tokens = [int(step(prompt_ids, 0)[0, -1].argmax())]
    while len(tokens) < n_new:
        tokens.append(int(step(torch.tensor([[tokens[-1]]]), 0)[0, -1].argmax()))
    return tokens


def decode_loop_without_cache(step, prompt_ids, n_new):
    ids = prompt_ids[0].tolist()
    for _ in range(n_new):
        ids.append(int(step(torch.tensor([ids]), 0)[0, -1].argmax()))
    return ids[-n_new:]


def count_parameters_without_norms(c):
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    block = (2 * q + 2 * kv + 3 * c.ffn_size) * c.hidden_size
    head = 0 if c.tied_lm_head else c.vocab_size * c.hidden_size
    return c.vocab_size * c.hidden_size + c.n_layers * block + head


def window_mask_sees_one_more(T, start, window):
    p, j = torch.arange(start, start + T)[:, None], torch.arange(start + T)[None, :]
    blocked = (j > p) | (j < p - window)  # should be j <= p - window
    return torch.zeros(T, start + T).masked_fill(blocked, float("-inf"))


def window_mask_from_zero(T, start, window):
    p, j = torch.arange(T)[:, None], torch.arange(start + T)[None, :]  # forgets start
    blocked = (j > p) | (j <= p - window)
    return torch.zeros(T, start + T).masked_fill(blocked, float("-inf"))


INF = float("-inf")
WRONG = {
    "count_parameters": [(count_parameters_without_norms, "the norms have weights too")],
    "bpe_merge": [(bpe_highest_rank_first, "LOWEST rank merges first")],
    "embed": [(lambda ids, table: table.T[ids], "one ROW per token")],
    "rms_norm": [(rms_norm_eps_outside, "eps goes INSIDE the square root")],
    "rope_cos_sin": [(rope_cos_sin_interleaved, "adjacent-pair layout")],
    "rope_rotate": [(rope_rotate_adjacent, "adjacent-pair convention")],
    "attn_scores": [(lambda q, k: q @ k.transpose(-2, -1), "1/sqrt(head_dim) scale is missing"),
                    (lambda q, k: k @ q.transpose(-2, -1) / math.sqrt(q.shape[-1]),
                     "transposed")],
    "causal_mask": [(lambda T: torch.full((T, T), INF).triu(0), "a mask off by one")],
    "softmax": [(lambda s: torch.softmax(s, dim=-2), "softmax over the wrong axis")],
    "repeat_kv": [(lambda k, n: k.repeat(1, n, 1, 1), "tiled")],
    "weighted_sum": [(lambda w, v: w.transpose(-2, -1) @ v, "transposed")],
    "kv_cache_step": [(kv_cache_step_reads_one_short, "off by one")],
    "swiglu": [(lambda x, g, u, d: ((x @ g) * (x @ u)) @ d, "a transposed matrix"),
               (lambda x, g, u, d: F.linear(F.linear(x, g) * F.silu(F.linear(x, u)), d),
                "SiLU goes on the GATE")],
    "residual_block": [(lambda x, attn, mlp, n1, n2: n2((h := n1(x + attn(x))) + mlp(h)),
                        "pre-norm")],
    "lm_head": [(lambda x, w, head, eps: x @ head.T, "the final norm is missing"),
                (lambda x, w, head, eps: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                             + eps) @ head,
                 "a transposed matrix")],
    "top_k": [(lambda l, k: l.masked_fill(l < l.topk(k + 1).values[-1], INF), "off by one")],
    "top_p": [(top_p_before_top_k, "top-p was cut before top-k")],
    "decode_loop": [(decode_loop_forgets_position, "forgets the KV cache position"),
                    (decode_loop_without_cache, "feed only the new token")],
    "patch_country": [(lambda stream, other, pos: other, "only the country's position")],
    "window_mask": [(window_mask_sees_one_more, "off by one"),
                    (window_mask_from_zero, "positions are absolute")],
}


def test_every_exercise_has_a_wrong_version():
    assert set(WRONG) == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_wrong_version_fails_and_names_the_mistake(capsys, model, name):
    for wrong, words in WRONG[name]:
        ok, line = verdict(capsys, name, wrong, model)
        assert not ok and line.startswith(f"✗ {name}: "), line
        assert words in line, f"{name}: {line!r} does not say {words!r}"


def test_failure_names_the_first_difference(capsys, model):
    """wanted, got and the largest error, at the first element that differs."""
    ok, line = verdict(capsys, "rms_norm", rms_norm_eps_outside, model)
    assert re.search(r"at \[0, \d+, \d+\] wanted -?[\d.e+-]+, got -?[\d.e+-]+ "
                     r"\(max error [\d.e+-]+, tolerance [\d.e+-]+\)", line), line


def test_a_learner_cannot_change_the_model(capsys, model):
    """Inputs are copies: a function that writes into them leaves the next check intact."""
    def vandal(x, weight, eps):
        weight.zero_()
        x.zero_()
        return x

    assert not verdict(capsys, "rms_norm", vandal, model)[0]
    assert verdict(capsys, "rms_norm", solution("rms_norm"), model)[0]
    assert verdict(capsys, "residual_block", solution("residual_block"), model)[0]


def test_the_exercises_page_lists_every_exercise_with_its_chapter():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    page = (root / "book" / "exercises.md").read_text()
    chapters = {p.stem[:2]: p.name for p in (root / "notebooks").glob("*.ipynb")}
    rows = re.findall(r"^\| \[(\d+)\]\(\.\./notebooks/([\w.]+)\) \| `(\w+)\(", page, re.M)
    assert [name for _, _, name in rows] == NAMES
    for chapter, notebook, name in rows:
        assert int(chapter) == CHAPTERS[name], name
        assert chapters[f"{CHAPTERS[name]:02d}"] == notebook, name
    assert "book/exercises" in (root / "_toc.yml").read_text()


def test_without_model_check_loads_the_model_of_llmtrace_model(capsys, monkeypatch, tiny_dir):
    monkeypatch.setenv("LLMTRACE_MODEL", str(tiny_dir))
    assert check("embed", solution("embed"))
    assert "[1, 6, 64]" in capsys.readouterr().out  # the tiny checkpoint's shapes


def test_a_large_negative_mask_gets_its_own_hint(capsys, model):
    ok, line = verdict(capsys, "causal_mask", lambda T: torch.full((T, T), -1e9).triu(1), model)
    assert not ok and "float('-inf')" in line, line


def test_an_out_of_bounds_index_is_the_same_error_whichever_index_a_thread_met():
    from llmtrace.exercises import _same_error

    def oob(i):
        return IndexError(f"index {i} is out of bounds for dimension 0 with size 64")

    assert _same_error(oob(450), oob(7483))
    assert not _same_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied (5x576 and "
                                        "1536x576)"),
                           RuntimeError("mat1 and mat2 shapes cannot be multiplied (5x1536 and "
                                        "576x1536)"))


def test_count_parameters_names_the_head_counted_wrongly(capsys, model):
    c = model.config
    extra = c.vocab_size * c.hidden_size * (1 if c.tied_lm_head else -1)
    ok, line = verdict(capsys, "count_parameters",
                       lambda cfg: solution("count_parameters")(cfg) + extra, model)
    assert not ok and f"({extra:+,})" in line and "LM head" in line, line
