"""Tiny random-weight checkpoints in Hugging Face format, made in seconds, as LLMs-from-scratch's
tests do: one row per family (`ROWS`, keyed by HF's model_type; `llama3` is Llama with Llama 3's
RoPE), each saved by HF's own config and model classes with `save_pretrained`, beside TinyLlama's
real tokenizer (32,000 pieces). Two layers (Gemma 3: four, local and global), hidden 64, GQA 4/2.
Their logits are noise; their shapes, ids and plumbing are a real checkpoint's. Each row also
says what the parity tests (tests/test_families.py) turn off to see the family's switches
matter, and which records only that family's trace has.

    python tests/tiny_checkpoint.py DIR [FAMILY]   # write one, e.g. for LLMTRACE_MODEL=DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

TINY = dict(vocab_size=32000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)


@dataclass(frozen=True)
class Row:
    config_class: str  # HF's config class
    model_class: str  # HF's model class
    config: dict  # the tiny config.json's settings
    # Config changes that each turn a switch of the family off: each must move the logits
    off: tuple = ()
    records: frozenset = frozenset()  # the names (layer 0's, without "layers.0.") only it has
    lacks: frozenset = frozenset()  # and the names of Llama's it has not
    norms: tuple = (0.5, 1.5)  # the norms' random weights: HF starts them all at 1


# The windows and the Llama 3 rope are chosen to matter at a dozen positions: a window of 4 slides
# past a prompt of 11; with head_dim 16 and original_max_position_embeddings 64, the llama3
# rule leaves pair 0 alone, blends pairs 1 and 2 and slows the rest 8 times. Weights drawn 5 times
# wider than HF's default (initializer_range 0.02) make attention sharp, so each family's switch
# moves the logits by far more than the tests' tolerance (measured: 0.7 to 5 where it would be
# 0.002 to 1 at 0.02).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
SHARP = {**TINY, "initializer_range": 0.1}
QK_NORM = frozenset({"attn.q_norm.mean_sq", "attn.q_norm", "attn.k_norm.mean_sq", "attn.k_norm"})
# a mixture of experts' records in place of the dense MLP's (mechanisms/moe.py)
MOE = frozenset({"mlp.router", "mlp.router_probs", "mlp.experts_chosen", "mlp.expert_weights",
                 "mlp.expert_out", "mlp.out"})
DENSE_MLP = frozenset({"mlp.gate", "mlp.up", "mlp.act", "mlp.gated", "mlp.down"})
# Qwen3-Next's shared expert beside the routed ones, and its sigmoid gate
SHARED = frozenset({"mlp.routed", "mlp.shared_gate", "mlp.shared_gated",
                    *(f"mlp.shared.{n}" for n in ("gate", "up", "act", "gated", "down"))})
QWEN3_MOE = {**SHARP, "head_dim": 24, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 48}
GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32}
DEEPSEEK_V3 = dict(
    vocab_size=32000, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,  # 4 x 16
    initializer_range=0.1, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                     "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
                     "mscale": 1.0, "mscale_all_dim": 0.7},  # unequal: cos, sin scaled too
    first_k_dense_replace=1, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    norm_topk_prob=True)
MLA_RECORDS = frozenset({"attn.kv_a", "attn.kv_cache.k_rope", "attn.kv_cache.latent",
                         "attn.kv_up", "attn.latent", "attn.latent_norm",
                         "attn.latent_norm.mean_sq", "attn.q_a", "attn.q_a_norm",
                         "attn.q_a_norm.mean_sq"})
GQA_ONLY = frozenset({"attn.k_expanded", "attn.k_proj", "attn.kv_cache.k", "attn.kv_cache.v",
                      "attn.v_expanded", "attn.v_proj"})
ROWS = {
    "llama": Row("LlamaConfig", "LlamaForCausalLM", TINY),
    "llama3": Row("LlamaConfig", "LlamaForCausalLM", {**SHARP, "rope_parameters": LLAMA3_ROPE},
                  off=({"rope_scaling": ()},)),
    "mistral": Row("MistralConfig", "MistralForCausalLM", {**SHARP, "sliding_window": 4},
                   off=({"sliding_window": 0},), records=frozenset({"attn.window_mask"})),
    "qwen2": Row("Qwen2Config", "Qwen2ForCausalLM", SHARP,  # the bias on Q, K, V is in the class
                 off=({"qkv_bias": False},),
                 records=frozenset({"attn.q_bias", "attn.k_bias", "attn.v_bias"})),
    "qwen3": Row("Qwen3Config", "Qwen3ForCausalLM", {**SHARP, "head_dim": 24},  # != hidden/heads
                 off=({"qk_norm": False},), records=QK_NORM),
    # local (sliding-window) and global layers with two RoPE bases, a window shorter than the
    # prompt, head_dim != hidden / heads, query_pre_attn_scalar != head_dim
    "gemma3_text": Row(
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(vocab_size=32000, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=24,  # not 64 / 4
             query_pre_attn_scalar=20,  # scores * 20^-0.5, not head_dim^-0.5
             sliding_window=4, max_position_embeddings=256,
             layer_types=["sliding_attention", "full_attention"] * 2,
             rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        off=({"norm_offset": False}, {"sandwich_norm": False}, {"embed_scale": False},
             {"mlp_act": "silu"}, {"attn_scale": 0.0}, {"qk_norm": False},
             {"rope_local_theta": 0.0}, {"layer_types": ("full",) * 4}),
        records=QK_NORM | {"attn.window_mask", "attn_post_norm.mean_sq", "attn_post_norm",
                           "mlp_post_norm.mean_sq", "mlp_post_norm", "embed.scaled"},
        # HF starts every Gemma norm at 0 (a gain of 1): random ones test (1 + w)
        norms=(-0.5, 0.5)),
    # no norm before a sublayer, one after each; QK-norm over the whole projection
    "olmo2": Row("Olmo2Config", "Olmo2ForCausalLM", SHARP,
                 off=({"qk_proj_norm": False},
                      {"pre_norm": True, "sandwich_norm": False}),  # the norms moved before
                 records=QK_NORM | {"attn_post_norm.mean_sq", "attn_post_norm",
                                    "mlp_post_norm.mean_sq", "mlp_post_norm"},
                 lacks=frozenset({"attn_norm.mean_sq", "attn_norm", "mlp_norm.mean_sq",
                                  "mlp_norm"})),
    # three Gated DeltaNet layers, then a full one with an output gate and RoPE on 4 of its 16
    # dims; layer 0 (the one the names test reads) is a DeltaNet layer
    "qwen3_next": Row(
        "Qwen3NextConfig", "Qwen3NextForCausalLM",
        {**SHARP, "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2,
         "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
         "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
         "mlp_only_layers": [2],  # layer 2 dense: the experts' rule as HF's
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.25}},
        off=({"norm_offset": False}, {"partial_rotary_factor": 1.0}, {"qk_norm": False},
             {"moe_renormalize": False}),
        records=MOE | SHARED | frozenset({f"attn.{n}" for n in (
            "qkvz", "ba", "conv", "conv_state", "z", "g", "beta", "core", "state",
            "core_norm.mean_sq", "core_norm", "gated_norm")}),
        lacks=frozenset({f"attn.{n}" for n in (
            "q_proj", "k_proj", "v_proj", "rope_q", "rope_k", "kv_cache.k", "kv_cache.v",
            "k_expanded", "v_expanded", "scores", "causal_mask", "masked_scores", "weights",
            "weighted_sum", "merged")}) | DENSE_MLP,
        norms=(-0.5, 0.5)),  # (1 + w) norms start at 0 in HF; the gated norm's gain too
    # a mixture of experts: 4 experts, 2 chosen per position, in every layer; a window of 4
    "mixtral": Row("MixtralConfig", "MixtralForCausalLM",
                   {**SHARP, "sliding_window": 4, "num_local_experts": 4,
                    "num_experts_per_tok": 2},
                   off=({"moe_renormalize": False}, {"sliding_window": 0}),
                   records=MOE | {"attn.window_mask"}, lacks=DENSE_MLP),
    # OLMoE: OLMo 2's QK-norm over the whole projection on Llama's pre-norm block, 4 experts of
    # width 48 in every layer, 2 chosen, norm_topk_prob false as OLMoE-1B-7B
    "olmoe": Row("OlmoeConfig", "OlmoeForCausalLM",
                 {**SHARP, "intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2,
                  "norm_topk_prob": False, "pad_token_id": 0},
                 off=({"qk_proj_norm": False}, {"moe_renormalize": True}),
                 records=QK_NORM | MOE, lacks=DENSE_MLP),
    # Qwen3-MoE as published: norm_topk_prob true, experts in every layer
    "qwen3_moe": Row("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {**QWEN3_MOE,
                                                               "norm_topk_prob": True},
                     off=({"moe_renormalize": False}, {"qk_norm": False}),
                     records=QK_NORM | MOE, lacks=DENSE_MLP),
    # and the class's defaults otherwise: norm_topk_prob false; layer 0 dense (every 2nd layer
    # MoE, decoder_sparse_step 2); with use_sliding_window, a window on every layer
    "qwen3_moe_sparse": Row(
        "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
        {**QWEN3_MOE, "norm_topk_prob": False, "decoder_sparse_step": 2,
         "use_sliding_window": True, "sliding_window": 4},
        off=({"moe_renormalize": True}, {"moe_router": "topk_softmax"}, {"qk_norm": False},
             {"sliding_window": 0}),
        records=QK_NORM | {"attn.window_mask"}),  # layer 0 is dense
    # OLMo 2 with three sliding layers to one full (window 4 < the prompt), a base per kind
    "olmo3": Row("Olmo3Config", "Olmo3ForCausalLM",
                 {**{k: v for k, v in SHARP.items() if k != "rope_theta"},
                  "num_hidden_layers": 4, "sliding_window": 4,
                  "rope_parameters": {"full_attention": {"rope_type": "default",
                                                         "rope_theta": 1e4},
                                      "sliding_attention": {"rope_type": "default",
                                                            "rope_theta": 5e5}}},
                 off=({"qk_proj_norm": False}, {"pre_norm": True, "sandwich_norm": False},
                      {"layer_types": ("full",) * 4}, {"rope_local_theta": 0.0}),
                 records=QK_NORM | {"attn.window_mask", "attn_post_norm.mean_sq",
                                    "attn_post_norm", "mlp_post_norm.mean_sq", "mlp_post_norm"},
                 lacks=frozenset({"attn_norm.mean_sq", "attn_norm", "mlp_norm.mean_sq",
                                  "mlp_norm"})),
    # no RoPE on layer 3 of 4 (no_rope_layer_interval's default, 4), which also slides (window 4)
    "smollm3": Row("SmolLM3Config", "SmolLM3ForCausalLM",
                   {**SHARP, "num_hidden_layers": 4, "use_sliding_window": True,
                    "sliding_window": 4, "pad_token_id": None},  # its 128004 is past 32000
                   off=({"no_rope_layers": ()}, {"layer_types": (), "sliding_window": 0})),
    # latent attention (queries through a latent of their own), YaRN stretching a 16-position
    # context 4 times, a dense first layer, then 8 experts in 4 groups: 2 groups chosen, 2
    # experts of them, sigmoid scores moved by a random bias, one shared expert
    "deepseek_v3": Row("DeepseekV3Config", "DeepseekV3ForCausalLM", DEEPSEEK_V3,
                       off=({"rope_interleave": False}, {"rope_scaling": ()},
                            {"moe_groups_chosen": 4}, {"moe_scaling": 1.0},
                            {"moe_renormalize": False}),
                       records=MLA_RECORDS, lacks=GQA_ONLY),
    # V2-Lite's form: one q_proj, a softmax router, never renormalized
    "deepseek_v2": Row("DeepseekV2Config", "DeepseekV2ForCausalLM",
                       {**DEEPSEEK_V3, "q_lora_rank": None, "n_group": None, "topk_group": None,
                        "routed_scaling_factor": 1.5, "norm_topk_prob": False},
                       off=({"rope_scaling": ()}, {"moe_scaling": 1.0},
                            {"moe_renormalize": True}),
                       records=MLA_RECORDS - {"attn.q_a", "attn.q_a_norm",
                                              "attn.q_a_norm.mean_sq"}, lacks=GQA_ONLY),
    # gpt-oss: sinks, biases on Q, K, V and O, a sliding layer (window 4) then a full one, both
    # turned by YaRN (8 times 32 positions: pairs kept, ramped and slowed within head_dim 16),
    # 4 experts with biases, 2 chosen, their clamp at 0.5 (the tiny activations reach it)
    "gpt_oss": Row("GptOssConfig", "GptOssForCausalLM",
                   {**SHARP, "head_dim": 16, "intermediate_size": 32, "sliding_window": 4,
                    "layer_types": ["sliding_attention", "full_attention"],
                    "num_local_experts": 4, "num_experts_per_tok": 2, "swiglu_limit": 0.5,
                    "rope_parameters": GPT_OSS_YARN},
                   off=({"attn_sinks": False}, {"swiglu_limit": float("inf")},
                        {"rope_scaling": ()}, {"qkv_bias": False, "o_bias": False},
                        {"layer_types": ("full", "full")}),
                   records=(MOE - {"mlp.router_probs"}) | {
                       "attn.q_bias", "attn.k_bias", "attn.v_bias", "attn.window_mask",
                       "attn.scores_with_sink", "attn.weights_with_sink"},
                   lacks=DENSE_MLP),
    # Gemma 4: sliding and full layers of different widths (16, 32), V from K's projection on
    # the full ones, the last two layers reading layers 2 and 3's K, V, per-layer inputs of 8,
    # partial RoPE at a base of 100 (the pairs left still would turn within 11 positions), a
    # soft cap of 3 that bites on the logits
    "gemma4_text": Row(
        "Gemma4TextConfig", "Gemma4ForCausalLM",
        dict(vocab_size=32000, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
             num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=4,
             max_position_embeddings=256, vocab_size_per_layer_input=32000,
             hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
             final_logit_softcapping=3.0, initializer_range=0.1,
             layer_types=["sliding_attention", "full_attention"] * 3,
             rope_parameters={
                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                 "full_attention": {"rope_type": "proportional", "rope_theta": 100.0,
                                    "partial_rotary_factor": 0.5}}),
        off=({"final_softcap": 0.0}, {"v_norm": False}, {"layer_scalar": False},
             {"ple_size": 0}, {"norm_offset": True}, {"attn_scale": 0.0},
             {"rope_partial": 1.0}, {"embed_scale": False}, {"mlp_act": "silu"}),
        records=QK_NORM | {"attn.window_mask", "attn_post_norm.mean_sq", "attn_post_norm",
                           "mlp_post_norm.mean_sq", "mlp_post_norm", "embed.scaled",
                           "attn.v_norm.mean_sq", "attn.v_norm", "ple.embed", "ple.proj",
                           "ple.proj_norm.mean_sq", "ple.proj_norm", "ple", "ple_gate",
                           "ple_act", "ple_gated", "ple_proj", "ple_norm.mean_sq", "ple_norm",
                           "resid_ple", "layer_scaled", "lm_head.softcap"}),
}
# Llama 4: layer 3 of 4 without RoPE (no_rope_layer_interval's default, 4) and its queries
# tempered (floor_scale 4: positions 3 .. 10 scaled, at a strength of 0.5); the three others
# turning adjacent pairs, QK-normed and chunked (4 positions, < the prompt's 11); experts in
# layers 0 and 2 (4 of width 32, 2 chosen, scaling their input; a shared one), dense MLPs of 96
# in layers 1 and 3
LLAMA4_MOE = (MOE - {"mlp.router_probs"}) | SHARED - {"mlp.shared_gate", "mlp.shared_gated"} | {
    "mlp.expert_in"}
ROWS["llama4_text"] = Row(
    "Llama4TextConfig", "Llama4ForCausalLM",
    {**SHARP, "num_hidden_layers": 4, "head_dim": 16, "intermediate_size": 32,
     "intermediate_size_mlp": 96, "num_local_experts": 4, "num_experts_per_tok": 2,
     "moe_layers": [0, 2], "attention_chunk_size": 4, "floor_scale": 4, "attn_scale": 0.5},
    off=({"rope_interleave": False}, {"no_rope_layers": ()}, {"qk_l2_norm": False},
         {"layer_types": ()}, {"attn_temperature": ()}, {"moe_router": "topk_softmax"},
         {"n_shared_experts": 0}),
    records=LLAMA4_MOE | {"attn.chunk_mask", "attn.q_l2_norm", "attn.q_l2_norm.mean_sq",
                          "attn.k_l2_norm", "attn.k_l2_norm.mean_sq"},
    lacks=DENSE_MLP)
# Qwen3.5's text model: the same layers, DeltaNet's projections stored apart, a dense MLP
ROWS["qwen3_5_text"] = Row(
    "Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
    {k: v for k, v in ROWS["qwen3_next"].config.items() if "expert" not in k
     and k != "mlp_only_layers"},
    off=ROWS["qwen3_next"].off[:3], records=ROWS["qwen3_next"].records - MOE - SHARED,
    lacks=ROWS["qwen3_next"].lacks - DENSE_MLP, norms=ROWS["qwen3_next"].norms)


def hf_config(family: str, **overrides):
    """HF's own config object of a row."""
    import transformers

    row = ROWS[family]
    return getattr(transformers, row.config_class)(**{**row.config, **overrides})


def make_tiny_checkpoint(directory: str | Path, seed: int = 0, family: str = "llama",
                         dtype=None, **overrides) -> Path:
    """Write config.json, model.safetensors, tokenizer.model and tokenizer_config.json; the
    weights in fp32, or rounded to `dtype` (torch.bfloat16, torch.float16) as HF saves them."""
    import torch
    import transformers

    from llmtrace_book.weights.tokenizer_llama import build

    row = ROWS[family]
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = hf_config(family, **overrides)
    model = getattr(transformers, row.model_class)(config).eval()
    with torch.no_grad():  # random norms exercise the weight in RMSNorm too
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(*row.norms)
            elif name.endswith((".bias", "_bias")):  # HF initialises biases to 0
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's layer_scalar: HF starts it at 1
                b.uniform_(0.5, 1.5)
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's router bias, 0 in HF
                b.normal_(0.0, 0.05)  # choosing, not overriding, the scores
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(d, safe_serialization=True)
    if config.vocab_size == 32000:
        shutil.copy(build(fetch=False), d / "tokenizer.model")
        (d / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    return d


if __name__ == "__main__":
    print(make_tiny_checkpoint(*sys.argv[1:2], family=(sys.argv[2:] or ["llama"])[0]))
