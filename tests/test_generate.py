"""Generation: greedy " Paris", the KV cache against recomputation, seeded sampling, stopping."""

import pytest
import torch

from llmtrace_book import LlmTraceError, Trace, Tracing, generate, sample
from helpers import PROMPT



def test_greedy_picks_paris(embedded):
    g = generate(embedded, PROMPT, max_new_tokens=6)
    tok = embedded.tokenizer
    assert g.prompt_ids == [504, 3575, 282, 4649, 314]
    assert tok.decode(g.new_ids[:1]) == " Paris"
    p = g.steps[0]["sample.probs"][g.new_ids[0]].item()
    assert 0.75 < p < 0.80  # measured 0.7725
    assert g.text.startswith(" Paris.")
    assert [s.label for s in g.steps] == ["prefill"] + [f"decode {i}" for i in range(1, 6)]


def test_cache_gives_the_logits_of_recomputation(embedded):
    cached = generate(embedded, PROMPT, max_new_tokens=6, trace=False)
    fresh = generate(embedded, PROMPT, max_new_tokens=6, trace=False, use_cache=False)
    assert cached.new_ids == fresh.new_ids
    for a, b in zip(cached.step_logits, fresh.step_logits):
        assert (a - b).abs().max().item() < 1e-4
    T = len(cached.prompt_ids)
    assert cached.positions_processed == T + 5
    assert fresh.positions_processed == sum(range(T, T + 6))


def test_decode_step_reads_the_cache(embedded):
    g = generate(embedded, PROMPT, max_new_tokens=2,
                 trace=Tracing(keep_values=False))
    c, T = embedded.config, 5
    d = g.steps[1]
    assert d.shape("tokens") == (1, 1)
    assert d.shape("layers.0.attn.q") == (1, 1, c.n_heads, c.head_dim)
    assert d.shape("layers.0.attn.kv_cache.k") == (1, T + 1, c.n_kv_heads, c.head_dim)
    assert d.shape("layers.0.attn.scores") == (1, c.n_heads, 1, T + 1)
    assert "write 5:6, read 0:6" in d.get("layers.0.attn.kv_cache.k").op


def test_causal_mask_with_a_filled_cache():
    from llmtrace_book.attention import causal_mask

    m = causal_mask(2, 5, 3)  # two new queries at positions 3 and 4, five keys
    assert torch.equal(m == 0, torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool))
    assert torch.equal(causal_mask(1, 7, 6), torch.zeros(1, 7))


def test_traces_of_the_first_steps_only(embedded):
    g = generate(embedded, PROMPT, 4, stop_at_eos=False, trace=Tracing(keep_values=False, steps=1))
    assert [t.label for t in g.steps] == ["prefill"] and len(g.step_logits) == 1
    assert len(g.new_ids) == 4 and g.steps[0].records[0].tensor is None
    untraced = generate(embedded, PROMPT, 4, stop_at_eos=False, trace=False)
    assert untraced.steps == [] and len(untraced.step_logits) == 4
    assert untraced.new_ids == g.new_ids


def test_chunked_prefill_matches_one_pass(embedded):
    ids = embedded.encode("The capital of France is Paris, and the capital of Italy is")
    whole, _ = embedded.run(ids, keep_values=False)
    cache = embedded.new_cache(ids.shape[1])
    a = embedded.forward(ids[:, :4], cache=cache)
    b = embedded.forward(ids[:, 4:], cache=cache, start=4)
    assert (torch.cat([a, b], 1) - whole).abs().max().item() < 1e-4


def test_seeded_sampling_is_reproducible():
    logits = torch.log(torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10]))  # [V]: no token dominates

    def draws(seed, **kwargs):
        generator = torch.Generator().manual_seed(seed)
        return [sample(logits, temperature=1.0, generator=generator, **kwargs) for _ in range(20)]

    assert draws(7, top_p=0.9) == draws(7, top_p=0.9)
    assert set(draws(7, top_p=0.7)) <= {0, 1, 2}  # top-p keeps 0.30 + 0.25 + 0.20 >= 0.7
    assert len({tuple(draws(s)) for s in range(4)}) > 1  # different seeds, different draws


def test_generation_is_seeded(embedded):
    runs = [generate(embedded, PROMPT, 3, temperature=1.0, seed=7, trace=False).new_ids
            for _ in range(2)]
    assert runs[0] == runs[1]


def test_kv_cache_too_small(embedded):
    cache = embedded.new_cache(4)
    with pytest.raises(LlmTraceError, match=r"the KV cache holds 4 positions, this step needs 5: "
                                            r"make it with model.new_cache\(5\) or larger"):
        embedded.forward(embedded.encode(PROMPT), cache=cache)


def test_top_p_walk_is_recorded():
    logits = torch.log(torch.tensor([0.05, 0.80, 0.03, 0.02, 0.10]))
    t = Trace()
    token = sample(logits, temperature=1.0, top_p=0.85,
                   generator=torch.Generator().manual_seed(0), trace=t)
    assert t["sample.sorted_ids"].tolist() == [1, 4, 0, 2, 3]
    assert torch.allclose(t["sample.cumsum"][:3], torch.tensor([0.80, 0.90, 0.95]))
    assert t["sample.kept"].tolist() == [True, True, False, False, False]
    assert token in (1, 4)
    assert abs(t["sample.filtered_probs"].sum().item() - 1) < 1e-6


def test_top_k_keeps_k():
    t = Trace()
    sample(torch.randn(100), temperature=1.0, top_k=3,
           generator=torch.Generator().manual_seed(0), trace=t)
    assert t["sample.kept"].sum().item() == 3


def test_stops_at_eos(embedded):
    eos = embedded.config.eos_id
    ids = embedded.encode("<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n")
    g = generate(embedded, ids, max_new_tokens=40, trace=False)
    assert g.stop_reason == "eos" and g.new_ids[-1] == eos and len(g.new_ids) < 40
    assert g.positions_processed == ids.shape[1] + len(g.new_ids) - 1  # the EOS is never fed back
    g = generate(embedded, PROMPT, max_new_tokens=3, trace=False)
    assert g.stop_reason == "max_new_tokens" and len(g.new_ids) == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature must be >= 0"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"top_k": 0}, "top_k must be at least 1"),
    ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
])
def test_bad_sampling_arguments(embedded, kwargs, message):
    args = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(LlmTraceError, match=message):
        generate(embedded, PROMPT, **args)


def test_bad_prompts(embedded):
    with pytest.raises(LlmTraceError, match="the prompt is empty"):
        generate(embedded, "", 2)
    with pytest.raises(LlmTraceError, match="exceed smollm2-135m-instruct's context of 8192"):
        generate(embedded, torch.zeros(1, 8190, dtype=torch.long), max_new_tokens=5)
