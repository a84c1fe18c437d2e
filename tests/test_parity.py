"""Our logits against Hugging Face transformers' LlamaForCausalLM (eager) on the same fp32 weights,
and each stage against HF's own function on a tiny random checkpoint."""

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.models.llama import modeling_llama as hf_llama

from llmtrace_book import generate
from llmtrace_book.attention import repeat_kv
from llmtrace_book.mlp import swiglu
from llmtrace_book.norm import rms_norm
from llmtrace_book.rope import adjacent_to_half_split, apply_rope, half_split_to_adjacent, rope_cos_sin
from helpers import PROMPT

PROMPTS = [PROMPT, "def fibonacci(n):\n    return", "1 + 1 = 2, 2 + 2 =",
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
    from llmtrace_book.model import Model, state_dict_from_weights, weights_from_state_dict

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


@pytest.fixture(scope="module")
def tiny_hf(tiny_dir):
    hf = LlamaForCausalLM.from_pretrained(tiny_dir, attn_implementation="eager", dtype=torch.float32)
    return hf.eval()


@torch.inference_mode()
def test_rope_matches_hf(tiny, tiny_hf):
    c = tiny.config
    positions = torch.arange(3, 10)  # [T]: not starting at 0, as in a decode step
    q = torch.randn(1, c.n_heads, 7, c.head_dim)  # [B, H, T, hd]: HF's layout
    k = torch.randn(1, c.n_kv_heads, 7, c.head_dim)  # [B, KV, T, hd]
    hf_cos, hf_sin = tiny_hf.model.rotary_emb(q, positions[None])  # [1, T, hd] each
    cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)  # [T, hd] each
    assert torch.allclose(cos, hf_cos[0], atol=1e-6) and torch.allclose(sin, hf_sin[0], atol=1e-6)
    hf_q, hf_k = hf_llama.apply_rotary_pos_emb(q, k, hf_cos, hf_sin)
    ours_q = apply_rope(q.transpose(1, 2), cos, sin).transpose(1, 2)  # ours takes [B, T, H, hd]
    ours_k = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2)
    assert torch.allclose(ours_q, hf_q, atol=1e-6) and torch.allclose(ours_k, hf_k, atol=1e-6)


@torch.inference_mode()
def test_rms_norm_matches_hf(tiny, tiny_hf):
    x = torch.randn(1, 5, tiny.config.hidden_size) * 3  # [B, T, D]
    hf_norm = tiny_hf.model.layers[1].post_attention_layernorm  # random weights, not ones
    ours = rms_norm(x, tiny.weights.layers[1].mlp_norm, tiny.config.norm_eps)
    assert torch.allclose(ours, hf_norm(x), atol=1e-6)


def test_repeat_kv_matches_hf(tiny):
    c = tiny.config
    kv = torch.randn(1, c.n_kv_heads, 5, c.head_dim)  # [B, KV, S, hd]
    assert torch.equal(repeat_kv(kv, c.n_rep), hf_llama.repeat_kv(kv, c.n_rep))  # [B, H, S, hd]


@torch.inference_mode()
def test_mlp_matches_hf(tiny, tiny_hf):
    x = torch.randn(1, 5, tiny.config.hidden_size)  # [B, T, D]
    ours = swiglu(x, tiny.weights.layers[0])
    assert torch.allclose(ours, tiny_hf.model.layers[0].mlp(x), atol=1e-5)


@torch.inference_mode()
def test_tiny_logits_match_hf(tiny, tiny_hf):
    ids = tiny.encode(PROMPT)
    ours, _ = tiny.run(ids, keep_values=False)
    assert (ours - tiny_hf(ids).logits).abs().max().item() < 1e-4
