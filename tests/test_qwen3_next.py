"""Qwen3-Next as a whole model against HF transformers' Qwen3NextForCausalLM, on the tiny random
checkpoint of `tiny_checkpoint.ROWS["qwen3_next"]` (three Gated DeltaNet layers, then a full one):
a prefill of 70 tokens, past DeltaNet's chunk of 64, then greedy decode steps that read each
linear layer's state and the full layer's KV cache, within 1e-4; the chunked prefill and the
token-by-token steps agree; each switch, turned off, moves the logits; the state keeps its shape
while the KV cache grows; the config is written back as HF's class reads it."""

import pytest
import torch
import transformers

from llmtrace_book import Config, LlmTraceError, generate, load_model, trace_shapes
from llmtrace_book import cost
from llmtrace_book.cost import parameter_count
from llmtrace_book.mechanisms.deltanet import DeltaNetState
from llmtrace_book.kv_cache import KVCache
from llmtrace_book.model import Model
from tiny_checkpoint import ROWS, make_tiny_checkpoint

TOL = 1e-4
T, STEPS = 70, 4  # past the chunk of 64: a full chunk and a short one
FULL = 3  # the tiny model's full-attention layer


FAMILIES = ["qwen3_next", "qwen3_5_text"]  # Qwen3.5's text model: the same layers


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    f = request.param
    d = make_tiny_checkpoint(tmp_path_factory.mktemp(f) / f"tiny-{f}", family=f)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32).eval()
    ids = torch.randint(3, 32000, (1, T), generator=torch.Generator().manual_seed(5))
    return load_model(d), hf, ids


def hf_logits(hf, ids) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.as_tensor(ids).reshape(1, -1)).logits[0]  # [T, V]


def test_the_layers_are_three_linear_to_one_full(pair):
    model, hf, _ = pair
    c = model.config
    assert c.layer_types == ("linear", "linear", "linear", "full")
    assert type(hf).__name__ == ROWS[c.family].model_class
    assert [t.split("_")[0] for t in hf.config.layer_types] == list(c.layer_types)
    assert (c.attn_output_gate, c.qk_norm, c.norm_offset) == (True, True, True)
    assert c.rotary_dim == 4 and c.linear_attn == (2, 4, 16, 16, 4)
    cache = model.new_cache(8)
    assert [type(x) for x in cache] == [DeltaNetState] * 3 + [KVCache]


def test_prefill_past_the_chunk_then_decode_match_hf(pair):
    model, hf, ids = pair
    ours, _ = model.run(ids, keep_values=False)  # [1, T, V]
    ref = hf_logits(hf, ids)
    assert (ours[0] - ref).abs().max().item() < TOL
    g = generate(model, ids, STEPS, stop_at_eos=False, trace=False)
    ref = hf_logits(hf, g.ids)[T - 1:-1]  # [STEPS, V]
    assert (torch.stack(g.step_logits) - ref).abs().max().item() < TOL
    assert g.new_ids == ref.argmax(-1).tolist()


def test_the_experts_chosen_differ_and_the_shared_one_is_gated(pair):
    model, _, ids = pair
    if not model.config.n_experts:
        pytest.skip("Qwen3.5's text model: a dense MLP in every layer")
    assert model.config.mlp_types == ("moe", "moe", "dense", "moe")  # mlp_only_layers [2]
    _, tr = model.run(ids)
    chosen = tr["layers.0.mlp.experts_chosen"]  # [1, T, 2]
    assert len(chosen.unique()) >= 2 and tr.shape("layers.0.mlp.shared_gate") == (1, T, 1)
    gate, shared = tr["layers.0.mlp.shared_gate"], tr["layers.0.mlp.shared.down"]
    assert torch.allclose(tr["layers.0.mlp.shared_gated"], gate * shared)
    assert torch.allclose(tr["layers.0.mlp.out"], tr["layers.0.mlp.routed"] + gate * shared)
    assert 0.05 < gate.min() and gate.max() < 0.95  # a gate, not a switch held open
    assert "layers.2.mlp.down" in tr and "layers.2.mlp.router" not in tr


def test_chunked_prefill_equals_token_by_token_steps(pair):
    """The same tokens through the chunked rule (one pass) and the recurrent step (one token
    per pass, reading the state): the same logits."""
    model, _, ids = pair
    n = 20
    with torch.inference_mode():
        whole = model.forward(ids[:, :n], cache=model.new_cache(n))[0]  # [n, V]
        cache = model.new_cache(n)
        steps = torch.cat([model.forward(ids[:, t:t + 1], cache=cache, start=t)[0]
                           for t in range(n)])  # [n, V]
    assert (whole - steps).abs().max().item() < TOL


def logits_with(model, ids, config=None, patch=None):
    m = model if config is None else Model(config, model.weights)
    return m.run(ids, keep_values=False, patch=patch)[0][0]  # [T, V]


@pytest.mark.parametrize("control", ["output gate", "partial RoPE", "(1 + w) norms", "QK-norm",
                                     "the shared expert's gate", "the state carried"])
def test_each_switch_matters(pair, control):
    model, hf, ids = pair
    ref, c = hf_logits(hf, ids), model.config
    if control == "output gate":  # sigmoid(50) = 1: every head's output passes whole
        got = logits_with(model, ids, patch={f"layers.{FULL}.attn.gate":
                                             lambda t: torch.full_like(t, 50.0)})
    elif control == "partial RoPE":
        got = logits_with(model, ids, c.replace(partial_rotary_factor=1.0))
    elif control == "(1 + w) norms":
        got = logits_with(model, ids, c.replace(norm_offset=False))
    elif control == "QK-norm":
        got = logits_with(model, ids, c.replace(qk_norm=False))
    elif control == "the shared expert's gate":  # 1: the shared expert whole
        if not c.n_experts:
            pytest.skip("Qwen3.5's text model has no experts")
        got = logits_with(model, ids, patch={"layers.*.mlp.shared_gate":
                                             lambda t: torch.ones_like(t)})
    else:  # each linear layer's state emptied after the prompt: the next token forgets it
        cache = model.new_cache(T + 1)
        with torch.inference_mode():
            model.forward(ids, cache=cache)
            for state in cache[:FULL]:
                state.recurrent.zero_()
            got = model.forward(ids[:, -1:], cache=cache, start=T)[0]
        ref = hf_logits(hf, torch.cat([ids, ids[:, -1:]], 1))[-1:]
    moved = (got - ref).abs().max().item()
    assert moved > 100 * TOL, f"{control}: moved {moved:.1e}"


def test_the_state_keeps_its_shape_while_the_kv_cache_grows():
    """The records of a prefill and each decode step: a linear layer's state and conv state
    have one shape throughout, the full layer's K cache one more position each step."""
    c = Config.from_hf(ROWS["qwen3_next"].config | {"model_type": "qwen3_next"}, name="q3n")
    traces = trace_shapes(c, T, decode_steps=3)
    d = c.deltanet_dims
    for tr in traces:
        assert tr.shape("layers.0.attn.state") == (1, d.n_v_heads, d.k_head_dim, d.v_head_dim)
        assert tr.shape("layers.0.attn.conv_state") == (1, d.conv_dim, d.conv_kernel - 1)
    grown = [tr.shape(f"layers.{FULL}.attn.kv_cache.k")[1] for tr in traces]
    assert grown == [T, T + 1, T + 2, T + 3]
    assert "layers.0.attn.kv_cache.k" not in traces[0]


@pytest.mark.parametrize("f", FAMILIES)
def test_the_config_goes_back_to_hfs_class(f):
    """to_hf writes what HF's config class reads back to the same Config, and HF's model class
    built from it on the meta device holds as many parameters as llmtrace counts."""
    row = ROWS[f]
    c = Config.from_hf(row.config | {"model_type": f}, name="q3n")
    hf_cfg = getattr(transformers, row.config_class)(**{k: v for k, v in c.to_hf().items()
                                                       if k != "architectures"})
    assert Config.from_hf(hf_cfg.to_dict(), name="q3n") == c
    assert c.to_hf()["architectures"] == [row.model_class]
    with torch.device("meta"):
        hf = getattr(transformers, row.model_class)(hf_cfg)
    assert sum(p.numel() for p in hf.parameters()) == parameter_count(c)


def test_the_layer_pattern_is_hfs_when_layer_types_is_left_out():
    base = {**ROWS["qwen3_next"].config, "model_type": "qwen3_next", "num_hidden_layers": 8}
    assert Config.from_hf(base).layer_types == ("linear",) * 3 + ("full",) + ("linear",) * 3 \
        + ("full",)
    assert Config.from_hf({**base, "full_attention_interval": 2}).layer_types == \
        ("linear", "full") * 4
    assert Config.from_hf({**base, "rope_parameters": {"rope_type": "default"}}) \
        .partial_rotary_factor == 0.25  # Qwen3NextConfig's default


@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "rope_scaling of type 'yarn'"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"partial_rotary_factor": 0.5},  # beside rope_parameters' 0.25
     r"rope_parameters.partial_rotary_factor=0.25 and partial_rotary_factor=0.5 disagree"),
    ({"layer_types": ["linear_attention", "sliding_attention"] * 2},
     "layer_types must list 'linear_attention' or 'full_attention'"),
    ({"linear_num_value_heads": 3}, "linear_num_value_heads=3 must be a multiple of "
                                    "linear_num_key_heads=2"),
    ({"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim=0 must be at least 1"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.1}},
     "partial_rotary_factor=0.1 turns 1 of 16 dims"),
])
def test_what_is_not_computed_is_refused_by_its_key(change, message):
    base = {**ROWS["qwen3_next"].config, "model_type": "qwen3_next"}
    with pytest.raises(LlmTraceError, match=message):
        Config.from_hf({**base, **change})


def test_qwen35_with_vision_or_experts_is_refused():
    text = {**ROWS["qwen3_5_text"].config, "model_type": "qwen3_5_text"}
    with pytest.raises(LlmTraceError, match="model_type 'qwen3_5' .Qwen3.5 with its vision"):
        Config.from_hf({**text, "model_type": "qwen3_5"})
    with pytest.raises(LlmTraceError, match="num_experts=4"):
        Config.from_hf({**text, "num_experts": 4})
    mrope = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
             "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    assert Config.from_hf({**text, "rope_parameters": mrope}).rotary_dim == 4


def test_the_switches_are_refused_on_other_families():
    with pytest.raises(LlmTraceError, match="attn_output_gate=True set with family 'llama'"):
        Config.from_name("tinyllama").replace(attn_output_gate=True).to_hf()
    with pytest.raises(LlmTraceError, match="layer_types has linear layers but no linear_attn"):
        Config.from_name("tinyllama").replace(layer_types=("linear",) * 22)


def test_the_80b_preset_counts_as_hfs_class_and_its_card():
    """qwen3-next-80b-a3b on the meta device: as many parameters as Qwen3NextForCausalLM built
    from the config.json llmtrace writes, and the model card's 80B total, 3B activated (its
    card counts the activated without the embedding and head tables, as here)."""
    c = Config.from_name("qwen3-next-80b-a3b")
    hf_cfg = transformers.Qwen3NextConfig(**{k: v for k, v in c.to_hf().items()
                                            if k != "architectures"})
    with torch.device("meta"):
        hf = transformers.Qwen3NextForCausalLM(hf_cfg)
    total, active = parameter_count(c), parameter_count(c, active=True)
    assert total == sum(p.numel() for p in hf.parameters())
    tables = 2 * c.vocab_size * c.hidden_size  # untied: embedding and LM head
    print(f"qwen3-next-80b-a3b: {total:,} parameters, {active:,} active per token")
    assert round(total / 1e9) == 80 and round((active - tables) / 1e9) == 3
    assert Config.from_hf(c.to_hf(), name=c.name) == c
    prefill, decode = trace_shapes(c, 6, 1)
    assert decode.shape("layers.0.attn.state") == prefill.shape("layers.0.attn.state") == \
        (1, 32, 128, 128)
    assert decode.shape("layers.3.attn.kv_cache.k") == (1, 7, 2, 256)
    assert prefill.shape("layers.3.attn.q_proj") == (1, 6, 2 * 16 * 256)  # query and gate
    assert prefill.shape("layers.0.mlp.experts_chosen") == (1, 6, 10)


def test_the_cache_bytes_count_a_state_that_does_not_grow():
    """cost.cache_bytes: each DeltaNet layer holds its state whatever the context (the bytes of
    a DeltaNetState in bf16), each full layer K and V of every position."""
    c = Config.from_name("qwen3-next-80b-a3b")
    state = DeltaNetState(c.deltanet_dims, device="meta", dtype=torch.bfloat16).nbytes()
    per_token = 2 * c.n_kv_heads * c.head_dim * 2  # K and V, bf16
    assert (state, per_token) == (1_097_728, 2048)
    linear, full = c.layer_types.count("linear"), c.layer_types.count("full")
    for n in (1, 4096, 32768):
        assert cost.cache_bytes(c, n) == linear * state + full * n * per_token
    dense = c.replace(layer_types=("full",) * c.n_layers)  # every layer attending, for scale
    grows = [cost.cache_bytes(m, 8192) - cost.cache_bytes(m, 4096) for m in (c, dense)]
    assert grows[1] == 4 * grows[0]  # one layer in four grows


# Qwen/Qwen3-Next-80B-A3B-Instruct's config.json: the keys that fix what it computes, as
# published (its model card gives the same counts: 16 Q / 2 KV heads of 256 with RoPE on 64,
# DeltaNet 16 QK / 32 V heads of 128, 512 experts of 512, 10 routed + 1 shared)
PUBLISHED_80B = {
    "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128,
    "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_next",
    "moe_intermediate_size": 512, "norm_topk_prob": True, "num_attention_heads": 16,
    "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
    "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 10000000, "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False, "vocab_size": 151936}


def test_the_published_config_json_reads_as_the_preset():
    c = Config.from_hf(PUBLISHED_80B, name="qwen3-next-80b-a3b")
    assert c == Config.from_name("qwen3-next-80b-a3b")


def test_the_weights_go_back_under_hfs_names(pair, tmp_path):
    """state_dict_from_weights undoes the loader: the fused projections regrouped per key head
    (Qwen3-Next) or split apart (Qwen3.5), the experts and the shared one under their names,
    every tensor as the checkpoint holds it; HF's class loads what save_hf writes."""
    from pathlib import Path

    from safetensors.torch import load_file

    from llmtrace_book.model import state_dict_from_weights
    from llmtrace_book.weights.hf import save_hf

    model, hf, ids = pair
    original = load_file(str(Path(model.source) / "model.safetensors"))
    back = state_dict_from_weights(model.config, model.weights)
    assert set(back) == set(original)
    assert all(torch.equal(back[n], original[n]) for n in original)
    save_hf(tmp_path / "back", model.config, back, model.tokenizer)
    again = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "back", attn_implementation="eager", dtype=torch.float32).eval()
    assert torch.equal(hf_logits(again, ids), hf_logits(hf, ids))
