"""The exercises (notebooks/exercises): every reference solution passes its check on the embedded
model and on the tiny random checkpoint; each typical wrong version fails with a line that names
the mistake; a stub, a None, an edit in place, an exception, sys.exit(), a slow function, a
wrong name or a wrong model each give one line and False, never an exception."""

import math
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import exercises
from exercises import CHAPTERS, NAMES, SIZES, check, solution
from helpers import verdict
from llmtrace_book import Config, load_model, meta_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=["embedded", "tiny"])
def model(request):
    if request.param == "embedded":
        return load_model("embedded")
    return request.getfixturevalue("tiny")


def test_names_chapters_and_the_builders():
    assert len(NAMES) >= 24 and len(set(CHAPTERS.values())) >= 13
    assert sorted(CHAPTERS.values()) == list(CHAPTERS.values())
    for name in NAMES:
        assert solution(name).__doc__, f"{name} has no statement"
    builders = {"attention_from_weights": 6, "block_from_weights": 8, "generate_with_cache": 11,
                "forward_from_weights": 13, "head_logit_attribution": 14}
    for name, chapter in builders.items():
        assert CHAPTERS[name] == chapter and SIZES[name] >= 12, (name, SIZES[name])


def test_no_exercise_shadows_a_library_function():
    """An exercise's name is no function of the library's with another signature."""
    import importlib
    import inspect
    import pkgutil

    import llmtrace_book

    functions = {}
    for info in pkgutil.walk_packages(llmtrace_book.__path__, "llmtrace_book."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for n, f in vars(module).items():
            if inspect.isfunction(f) and f.__module__ == info.name:
                functions[n] = inspect.signature(f)
    for name in NAMES:
        if name in functions:
            assert inspect.signature(solution(name)) == functions[name], name
    assert not (ROOT / "lib" / "llmtrace_book" / "exercises.py").exists()


@pytest.mark.parametrize("name", NAMES)
def test_every_solution_passes(capsys, model, name):
    ok, line = verdict(capsys, name, solution(name), model)
    assert ok and line.startswith(f"✓ {name}: matches "), line
    # a pass line prints no measured float, only shapes, names and the stated tolerance
    assert not re.search(r"\d\.\d", line), line
    assert len(line) <= 80, line  # a chapter's output within the book's column


def _stub(*args):
    ...


def _not_implemented(*args):
    """a docstring"""
    raise NotImplementedError


@pytest.mark.parametrize("stub", [_stub, _not_implemented])
def test_a_stub_is_not_written_yet(capsys, model, stub):
    for name in NAMES:
        ok, line = verdict(capsys, name, stub, model)
        assert not ok and line == f"… {name}: not written yet: replace the stub with your code"


def test_none_returned_is_not_a_stub(capsys, model):
    def forgot(x, gain, eps):
        y = gain * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # noqa: F841

    ok, line = verdict(capsys, "rms_normalize", forgot, model)
    assert not ok and line == ("✗ rms_normalize: your function returned None: did you forget "
                               "`return`?"), line


# --- an edit in place, in every exercise that takes a tensor ----------------------------------

def _editing(name):
    """The reference, after it added 1 to its first tensor input in place (in one of the weights
    where the input is a model's)."""
    ref = solution(name)

    def edit(x):
        if isinstance(x, torch.Tensor) and x.numel():
            x.add_(1)
            return True
        if isinstance(x, dict):
            return any(edit(v) for v in x.values())
        if hasattr(x, "layers"):
            return edit(x.layers[0].q_proj)
        if hasattr(x, "q_proj"):
            return edit(x.o_proj)
        return False

    def fn(*args):
        out = ref(*args)
        for a in args:
            if edit(a):
                break
        return out
    return fn


EDITABLE = [n for n in NAMES if n not in ("count_parameters", "bpe_merge", "future_mask",
                                          "sliding_window_mask", "decode_loop",
                                          "kv_source_layers", "patch_sweep")]


@pytest.mark.parametrize("name", EDITABLE)
def test_an_edit_in_place_is_caught(capsys, model, name):
    ok, line = verdict(capsys, name, _editing(name), model)
    assert not ok and "in place" in line, line
    assert verdict(capsys, name, solution(name), model)[0]  # the model is intact


def test_patch_country_writing_into_the_stream_fails(capsys, model):
    """It returns the right stream, but the one it was given is changed too."""
    def in_place(stream, other, pos):
        stream[:, pos] = other[:, pos]
        return stream

    ok, line = verdict(capsys, "patch_country", in_place, model)
    assert not ok and "`stream` in place" in line and "clone" in line, line


def test_embed_tokens_editing_the_table_fails(capsys, model):
    def vandal(ids, table):
        out = table[ids]
        table.zero_()
        return out
    ok, line = verdict(capsys, "embed_tokens", vandal, model)
    assert not ok and "`table` in place" in line, line
    assert verdict(capsys, "embed_tokens", solution("embed_tokens"), model)[0]


def test_kv_cache_step_may_write_at_pos_only(capsys, model):
    ref = solution("kv_cache_step")

    def spills(q, k_new, v_new, k_cache, v_cache, pos):
        out = ref(q, k_new, v_new, k_cache, v_cache, pos)
        k_cache[pos + 1] = k_new
        return out
    ok, line = verdict(capsys, "kv_cache_step", spills, model)
    assert not ok and "changed the cache outside position" in line, line


# --- count_parameters on every family ------------------------------------------------------------

def llama_only_count(c):
    V, D, F_, L = c.vocab_size, c.hidden_size, c.ffn_size, c.n_layers
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    head = 0 if c.tied_lm_head else V * D
    return V * D + L * (2 * D + 2 * q * D + 2 * kv * D + 3 * F_ * D) + D + head


def test_a_llama_count_passes_on_the_llamas_and_is_told_a_familys_switch(capsys, model,
                                                                          tmp_path):
    """Chapter 1 checks a count on Llamas (the running model and three presets); on a model of
    another family, the missing switch is named."""
    from llmtrace_book import load_model
    from tiny_checkpoint import make_tiny_checkpoint

    ok, line = verdict(capsys, "count_parameters", llama_only_count, model)
    assert ok, line
    for family, switch in [("qwen3", "qk_norm")]:
        other = load_model(make_tiny_checkpoint(tmp_path / family, family=family))
        ok, line = verdict(capsys, "count_parameters", llama_only_count, other)
        assert not ok and switch in line, line


def test_count_parameters_counts_each_familys_switches():
    """The reference counts what HF's own class holds: Qwen2's biases, Qwen3's and Gemma 3's
    q_norm and k_norm, Gemma 3's norms after each sublayer."""
    import transformers
    from test_exercises_families import FAMILIES
    from tiny_checkpoint import ROWS, hf_config

    for f in FAMILIES:
        config, row = hf_config(f), ROWS[f]
        hf = getattr(transformers, row.model_class)(config)
        c = Config.from_hf(config.to_dict(), name=f)
        assert solution("count_parameters")(c) == sum(p.numel() for p in hf.parameters()), f


def test_count_parameters_names_the_head_counted_wrongly(capsys, model):
    c = model.config
    extra = c.vocab_size * c.hidden_size * (1 if c.tied_lm_head else -1)
    ok, line = verdict(capsys, "count_parameters",
                       lambda cfg: solution("count_parameters")(cfg) + (
                           extra if cfg is c else 0), model)
    assert not ok and f"({extra:+,})" in line and "LM head" in line, line


# --- bpe_merge: ties, and a word-level tokenizer -------------------------------------------------

def bpe_rightmost_on_a_tie(symbols, priority):
    pieces = list(symbols)
    while True:
        pairs = [(priority(a, b), i) for i, (a, b) in enumerate(zip(pieces, pieces[1:]))]
        pairs = [(r, -i) for r, i in pairs if r is not None]
        if not pairs:
            return pieces
        _, i = min(pairs)
        pieces[-i:-i + 2] = [pieces[-i] + pieces[-i + 1]]


def test_bpe_merge_ties_go_to_the_leftmost_pair(capsys, model):
    ok, line = verdict(capsys, "bpe_merge", bpe_rightmost_on_a_tie, model)
    assert not ok and "made-up table" in line and "LEFTMOST" in line, line


def test_bpe_merge_on_a_word_level_tokenizer(capsys, tmp_path, tiny_dir):
    """A tokenizer.json with no merges: the check runs on the made-up words alone."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    d = Path(shutil.copytree(tiny_dir, tmp_path / "word-level"))
    vocab = {f"w{i}": i for i in range(32000)} | {"[UNK]": 32000}
    vocab = {k: v for k, v in vocab.items() if v < 32000}
    vocab["[UNK]"] = 0
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer.model").unlink()
    m = load_model(d)
    ok, line = verdict(capsys, "bpe_merge", solution("bpe_merge"), m)
    assert ok and "made-up table" in line, line
    assert not verdict(capsys, "bpe_merge", bpe_rightmost_on_a_tie, m)[0]


# --- the mask -------------------------------------------------------------------------------------

def test_the_classic_mask_bug_is_named(capsys, model):
    ok, line = verdict(capsys, "future_mask",
                       lambda T: torch.ones(T, T).triu(1) * float("-inf"), model)
    assert not ok and "NaN" in line and "0 * -inf" in line, line


def test_finfo_min_is_accepted_and_a_large_negative_explained(capsys, model):
    lowest = torch.finfo(torch.float32).min
    ok, line = verdict(capsys, "future_mask", lambda T: torch.zeros(T, T).masked_fill(
        torch.ones(T, T, dtype=torch.bool).triu(1), lowest), model)
    assert ok and "finfo.min" in line, line
    ok, line = verdict(capsys, "future_mask", lambda T: torch.full((T, T), -1e9).triu(1), model)
    assert not ok and "float('-inf')" in line and "finfo" in line, line


# --- typical wrong versions, each with the words its verdict must contain ------------------------

def rms_eps_outside(x, gain, eps):
    return gain * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps)


def rope_interleaved(positions, head_dim, theta, stretch):
    freqs = stretch(theta ** -(torch.arange(0, head_dim, 2).float() / head_dim))
    angles = (positions.float()[:, None] * freqs).repeat_interleave(2, -1)
    return angles.cos(), angles.sin()


def rope_rotate_adjacent(x, cos, sin):
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * c - odd * s, odd * c + even * s], -1).flatten(-2)


def kv_reads_one_short(q, k_new, v_new, k_cache, v_cache, pos):
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


def decode_forgets_position(step, prompt_ids, n_new):
    tokens = [int(step(prompt_ids, 0)[0, -1].argmax())]
    while len(tokens) < n_new:
        tokens.append(int(step(torch.tensor([[tokens[-1]]]), 0)[0, -1].argmax()))
    return tokens


def decode_without_cache(step, prompt_ids, n_new):
    ids = prompt_ids[0].tolist()
    for _ in range(n_new):
        ids.append(int(step(torch.tensor([ids]), 0)[0, -1].argmax()))
    return ids[-n_new:]


def window_sees_one_more(T, start, window):
    p, j = torch.arange(start, start + T)[:, None], torch.arange(start + T)[None, :]
    return torch.zeros(T, start + T).masked_fill((j > p) | (j < p - window), float("-inf"))


def attention_tiled(x, w, c, layer):
    from exercises.ch05_attention import attention_variant
    return attention_variant(x, w, c, layer, tiled=True)


def attention_unscaled(x, w, c, layer):
    from exercises.ch05_attention import attention_variant
    return attention_variant(x, w, c, layer, scaled=False)


def block_post_norm(x, w, c, layer):
    from exercises.ch08_stack import block_variant
    return block_variant(x, w, c, layer, "post_norm")


def forward_without_final_norm(ids, weights, c):
    from exercises.ch08_stack import block_from_weights
    x = weights.embed[ids]
    for i, w in enumerate(weights.layers):
        x = block_from_weights(x, w, c, i)
    return F.linear(x, weights.lm_head)


def generate_without_cache(prompt_ids, weights, config, n_new):
    fwd = solution("forward_from_weights")
    ids, tokens, logits = prompt_ids, [], []
    for _ in range(n_new):
        last = fwd(ids, weights, config)[0, -1]
        tokens.append(int(last.argmax()))
        logits.append(last)
        ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], 1)
    return tokens, torch.stack(logits)


def dla_own_rms(acts, weights, c, layer, head, clean, corrupt):
    from exercises.ch14_inside_the_layers import _dla_variant
    return _dla_variant("own_rms")(acts, weights, c, layer, head, clean, corrupt)


def delta_rule_without_fade(S, q, k, v, g, beta):
    return solution("delta_rule_step")(S, q, k, v, torch.zeros_like(g), beta)


INF = float("-inf")
WRONG = {
    "count_parameters": [(lambda c: llama_only_count(c) - (2 * c.n_layers + 1) * c.hidden_size,
                          "the norms have weights too")],
    "bpe_merge": [(bpe_rightmost_on_a_tie, "LEFTMOST")],
    "embed_tokens": [(lambda ids, table: table.T[ids], "one ROW per token")],
    "rms_normalize": [(rms_eps_outside, "eps goes INSIDE the square root")],
    "rope_angles": [(rope_interleaved, "adjacent-pair layout")],
    "rope_rotate": [(rope_rotate_adjacent, "adjacent-pair convention")],
    "attn_scores": [(lambda q, k, s: q @ k.transpose(-2, -1), "multiply by scale"),
                    (lambda q, k, s: q @ k.transpose(-2, -1) / s, "do not divide"),
                    (lambda q, k, s: k @ q.transpose(-2, -1) * s, "transposed")],
    "future_mask": [(lambda T: torch.full((T, T), INF).triu(0), "a mask off by one")],
    "softmax": [(lambda s: torch.softmax(s, dim=-2), "softmax over the wrong axis"),
                (lambda s: s.exp() / s.exp().sum(-1, keepdim=True), "exp overflowed")],
    "expand_kv_heads": [(lambda k, n: k.repeat(1, n, 1, 1), "tiled")],
    "weighted_sum": [(lambda w, v: w.transpose(-2, -1) @ v, "transposed")],
    "attention_from_weights": [(attention_tiled, "CONSECUTIVE query heads"),
                               (attention_unscaled, "1/sqrt(head_dim) is missing")],
    "gated_ffn": [(lambda x, g, u, d, a: ((x @ g) * (x @ u)) @ d, "a transposed matrix"),
                  (lambda x, g, u, d, a: F.linear(F.linear(x, g) * a(F.linear(x, u)), d),
                   "on the GATE")],
    "residual_block": [(lambda x, attn, mlp, n1, n2: n2((h := n1(x + attn(x))) + mlp(h)),
                        "pre-norm")],
    "block_from_weights": [(block_post_norm, "pre-norm")],
    "lm_head": [(lambda x, g, head, eps: x @ head.T, "the final norm is missing")],
    "top_k": [(lambda l, k: l.masked_fill(l < l.topk(k + 1).values[-1], INF), "off by one")],
    "top_p": [(top_p_before_top_k, "top-p was cut before top-k")],
    "kv_cache_step": [(kv_reads_one_short, "off by one")],
    "decode_loop": [(decode_forgets_position, "forgets the KV cache position"),
                    (decode_without_cache, "feed only the new token")],
    "generate_with_cache": [(generate_without_cache, "where a KV cache needs")],
    "forward_from_weights": [(forward_without_final_norm, "the final norm is missing")],
    "patch_country": [(lambda stream, other, pos: other.clone(), "only the country's position")],
    "head_logit_attribution": [(dla_own_rms, "freeze the final norm's divisor")],
    "patch_sweep": [(lambda r, n, ps: torch.tensor([[r(l, p) for l in range(n)] for p in ps]),
                     "rows are the layers")],
    "qk_terms": [(lambda q, k, s: q @ k.T, "the attention's scale")],
    "noise_head": [(lambda z, o, h: o.clone(), "ONE head's output")],
    "key_without": [(lambda x, o, m, g, eps, k: (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                                              + eps) * g - o + m) @ k.T,
                     "then normalize")],
    "keep_only": [(lambda z, m, k: m.expand_as(z).clone(), "keep the listed heads")],
    "induction_score": [(lambda w, R: w[..., torch.arange(R, 2 * R), torch.arange(0, R)]
                         .mean((0, 2)), "came NEXT, i - R + 1")],
    "sliding_window_mask": [(window_sees_one_more, "off by one")],
    "sink_share": [(lambda scores, sinks: 1 - torch.softmax(scores, -1).sum(-1),
                    "one more column")],
    "delta_rule_step": [(delta_rule_without_fade, "the state fades first")],
    "choose_experts": [(lambda logits, k: torch.topk(torch.softmax(logits, -1), k, -1)[::-1],
                        "renormalize")],
    "layers_without_rope": [(lambda acts, n: [i for i in range(n) if not torch.equal(
        acts[f"layers.{i}.attn.rope_q"], acts[f"layers.{i}.attn.q"])], "RoPE turned"),
                            (lambda acts, n: [i for i in range(n) if (i + 1) % 4 == 0],
                             "not every fourth")],
    "rebuild_kv": [(lambda lat, kv_b, H, dn: tuple(reversed(rebuild_kv(lat, kv_b, H, dn))),
                    "its key part")],
    "kv_source_layers": [(lambda types, n: list(range(len(types))), "compute no K, V"),
                         (lambda types, n: [min(j for j in range(len(types) - n)
                                                if types[j] == t) if i >= len(types) - n
                                            else i for i, t in enumerate(types)],
                          "the LAST layer of its kind")],
}


def rebuild_kv(latent, kv_b, n_heads, nope_dim):
    return solution("rebuild_kv")(latent, kv_b, n_heads, nope_dim)


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
    ok, line = verdict(capsys, "rms_normalize", rms_eps_outside, model)
    assert re.search(r"at \[0, \d+, \d+\] wanted -?[\d.e+-]+, got -?[\d.e+-]+ "
                     r"\(max error [\d.e+-]+, tolerance [\d.e+-]+\)", line), line


# --- check never raises, never hangs in silence ------------------------------------------------

class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no")


def test_check_never_raises(capsys, model):
    def boom(*args):
        raise KeyError("no such thing")

    ok, line = verdict(capsys, "rms_normalize", boom, model)
    assert not ok and line == "✗ rms_normalize: your function raised KeyError: 'no such thing'"
    ok, line = verdict(capsys, "rms_normalize", lambda *a: (_ for _ in ()).throw(Unprintable()),
                       model)
    assert not ok and "Unprintable" in line and "could not be printed" in line, line
    ok, line = verdict(capsys, "rms_normalize", lambda *a: sys.exit(3), model)
    assert not ok and "sys.exit()" in line, line
    ok, line = verdict(capsys, "embed_tokens", lambda ids, table: "text", model)
    assert not ok and "wanted a tensor" in line and "got str" in line
    ok, line = verdict(capsys, "rms_norm_typo", _stub, model)
    assert not ok and "no exercise named 'rms_norm_typo'" in line and "'rms_normalize'" in line
    ok, line = verdict(capsys, ["rms_normalize"], _stub, model)
    assert not ok and "a string" in line and "got list" in line, line
    ok, line = verdict(capsys, "rms_norm", _stub, model)
    assert not ok and "now called 'rms_normalize'" in line, line
    ok, line = verdict(capsys, "rms_normalize", solution("rms_normalize"), "embedded")
    assert not ok and "llmtrace model" in line and "got str" in line, line


def test_a_meta_device_model_is_told(capsys):
    ok, line = verdict(capsys, "rms_normalize", solution("rms_normalize"),
                       meta_model("tinyllama-1.1b"))
    assert not ok and "meta device, which holds shapes, not values" in line, line


def test_a_slow_function_is_reported(capsys, model, monkeypatch):
    monkeypatch.setattr(exercises.registry, "LIMIT_SECONDS", 0.5)

    def slow(x, gain, eps):
        while True:
            time.sleep(0.05)

    started = time.perf_counter()
    ok, line = verdict(capsys, "rms_normalize", slow, model)
    assert not ok and "still running after 0.5 s" in line, line
    assert time.perf_counter() - started < 5


def test_keyboard_interrupt_still_stops_it(model):
    def interrupted(x, gain, eps):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        check("rms_normalize", interrupted, model=model)


def test_without_model_check_loads_the_model_of_llmtrace_model(capsys, monkeypatch, tiny_dir):
    monkeypatch.setenv("LLMTRACE_MODEL", str(tiny_dir))
    assert check("embed_tokens", solution("embed_tokens"))
    assert "[1, 6, 64]" in capsys.readouterr().out  # the tiny checkpoint's shapes


def test_an_out_of_bounds_index_is_the_same_error_whichever_index_a_thread_met():
    from exercises.verdicts import same_error

    def oob(i):
        return IndexError(f"index {i} is out of bounds for dimension 0 with size 64")

    assert same_error(oob(450), oob(7483))
    assert not same_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied (5x576 and "
                                       "1536x576)"),
                          RuntimeError("mat1 and mat2 shapes cannot be multiplied (5x1536 and "
                                       "576x1536)"))


# --- the page ------------------------------------------------------------------------------------

def test_the_exercises_page_is_generated_from_the_registry():
    from exercises.page import page

    text = (ROOT / "book" / "exercises.md").read_text()
    assert text == page(), "book/exercises.md is stale: run python notebooks/exercises/page.py"
    chapters = {p.stem[:2]: p.name for p in (ROOT / "notebooks").glob("*.ipynb")}
    rows = re.findall(r"^\| \[(\d+)\]\(\.\./notebooks/([\w.]+)\) \| `(\w+)\(.*\| (\d+) \|$",
                      text, re.M)
    assert [name for _, _, name, _ in rows] == NAMES
    for chapter, notebook, name, lines in rows:
        assert int(chapter) == CHAPTERS[name] and int(lines) == SIZES[name], name
        assert chapters[f"{CHAPTERS[name]:02d}"] == notebook, name
    assert "book/exercises" in (ROOT / "_toc.yml").read_text()
