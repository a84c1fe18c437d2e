"""Our logits against Hugging Face transformers' LlamaForCausalLM (eager) on the same fp32 weights."""

import pytest
import torch

from llmtrace import generate
from llmtrace.rope import adjacent_to_half_split, half_split_to_adjacent

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return", "1 + 1 = 2, 2 + 2 =",
           "Once upon a time, in a small village by the sea, there lived"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_prefill_logits_match_hf(embedded, hf_reference, prompt):
    ids = embedded.encode(prompt)
    ours, _ = embedded.run(ids, keep_values=False)
    with torch.inference_mode():
        theirs = hf_reference(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4


def test_decode_steps_match_hf(embedded, hf_reference):
    """Decode with the KV cache, step by step, against HF on the whole sequence at once."""
    g = generate(embedded, PROMPTS[0], max_new_tokens=8, trace=False)
    full = torch.tensor([g.ids[:-1]])  # every position whose next-token logits were sampled
    with torch.inference_mode():
        theirs = hf_reference(full).logits[0]
    T = len(g.prompt_ids)
    for step, ours in enumerate(g.step_logits):
        assert (ours - theirs[T - 1 + step]).abs().max().item() < 1e-4, f"step {step}"


def test_without_the_unpermute_logits_drift(embedded, hf_reference):
    """What parity guards against: skipping the Q/K un-permute keeps the shapes and changes the logits."""
    from llmtrace.model import Model, state_dict_from_weights, weights_from_state_dict

    c = embedded.config
    sd = dict(state_dict_from_weights(c, embedded.weights))
    for i in range(c.n_layers):
        p = f"model.layers.{i}.self_attn."
        sd[p + "q_proj.weight"] = half_split_to_adjacent(sd[p + "q_proj.weight"], c.n_heads)
        sd[p + "k_proj.weight"] = half_split_to_adjacent(sd[p + "k_proj.weight"], c.n_kv_heads)
    wrong = Model(c, weights_from_state_dict(c, sd), embedded.tokenizer)
    ids = embedded.encode(PROMPTS[0])
    bad, _ = wrong.run(ids, keep_values=False)
    good, _ = embedded.run(ids, keep_values=False)
    assert (bad - good).abs().max().item() > 1.0


def test_permutations_are_inverse():
    w = torch.randn(3 * 64, 10)
    assert torch.equal(adjacent_to_half_split(half_split_to_adjacent(w, 3), 3), w)
    assert not torch.equal(half_split_to_adjacent(w, 3), w)
