"""Mixtral and Qwen3-MoE, the mixtures of experts llmtrace computes (moe.py, wired by the
`n_experts` fields): their tiny checkpoints route different tokens to different experts, the
dense layers Qwen3-MoE's decoder_sparse_step leaves stay dense, what `to_hf` and
`state_dict_from_weights` write is a checkpoint HF's own class loads to the same logits, the
presets' active and total parameters are the published ones, and what is not computed is
refused by its key. Parity and negative controls: tests/test_families.py (tiny_checkpoint.ROWS
rows mixtral, qwen3_moe, qwen3_moe_sparse)."""

import pytest
import torch
import transformers

from llmtrace_book import Config, LlmTraceError, load_model, trace_shapes
from llmtrace_book.cost import parameter_count, parameter_table
from llmtrace_book.model import Model, state_dict_from_weights
from llmtrace_book.weights.hf import save_hf
from tiny_checkpoint import ROWS, hf_config, make_tiny_checkpoint

MOE_ROWS = ("mixtral", "qwen3_moe", "qwen3_moe_sparse")
IDS = torch.randint(3, 32000, (1, 11), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module", params=MOE_ROWS)
def moe_model(request, tmp_path_factory):
    f = request.param
    d = make_tiny_checkpoint(tmp_path_factory.mktemp(f) / f, family=f)
    return f, d, load_model(d)


def test_tokens_go_to_different_experts(moe_model):
    """Every MoE layer sends the 11 positions to at least two distinct experts, k each, with
    weights that sum to 1 only where the config renormalizes; dense layers have no router."""
    f, _, model = moe_model
    c = model.config
    _, trace = model.run(IDS)
    for i in range(c.n_layers):
        names = {r.name for r in trace.layer(i)}
        assert (f"layers.{i}.mlp.router" in names) == c.is_moe(i)
        assert (f"layers.{i}.mlp.down" in names) != c.is_moe(i)
        if not c.is_moe(i):
            continue
        chosen = trace.get(f"layers.{i}.mlp.experts_chosen").tensor  # [1, T, k]
        assert chosen.shape == (1, 11, c.n_experts_active)
        assert len(set(chosen.flatten().tolist())) >= 2
        sums = trace.get(f"layers.{i}.mlp.expert_weights").tensor.sum(-1)  # [1, T]
        assert torch.allclose(sums, torch.ones_like(sums), atol=1e-6) == c.moe_renormalize
    assert [c.is_moe(i) for i in range(c.n_layers)] == (
        [False, True] if f == "qwen3_moe_sparse" else [True, True])  # decoder_sparse_step 2


@pytest.mark.parametrize("moe_model", ["mixtral"], indirect=True)
def test_mixtrals_softmax_before_top_k_equals_top_k_then_softmax(moe_model):
    """Renormalized, a softmax over the E logits then the top k weigh the k experts as a
    softmax over the k chosen logits does: moving Mixtral's softmax after top-k changes
    nothing (a negative control cannot be made of it). Without renormalization (Qwen3-MoE's
    norm_topk_prob false) it does: tiny_checkpoint's qwen3_moe_sparse row turns it off."""
    _, _, model = moe_model
    ours, _ = model.run(IDS, keep_values=False)
    c = model.config.replace(moe_router="topk_softmax")
    after, _ = Model(c, model.weights).run(IDS, keep_values=False)
    assert (after - ours).abs().max().item() < 1e-5


def test_written_back_hf_loads_the_same_model(moe_model, tmp_path):
    """to_hf's config.json and the weights in HF's names (each expert's own matrices, as
    save_pretrained writes them), read by HF's class: the same logits."""
    f, _, model = moe_model
    d = save_hf(tmp_path / "back", model.config,
                state_dict_from_weights(model.config, model.weights))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32).eval()
    assert type(hf).__name__ == ROWS[f].model_class
    with torch.inference_mode():
        ref = hf(IDS).logits  # [1, T, V]
    ours, _ = model.run(IDS, keep_values=False)
    assert (ours - ref).abs().max().item() < 1e-4


# the active parameters each model's publisher gives, in billions: Mistral's "12.9B active"
# (Mixtral of Experts, 2024) and Qwen's "3.3B activated" (Qwen3-30B-A3B's model card, which
# cuts 3.35 to 3.3); both count the embedding and the LM head tables
ACTIVE = {"mixtral-8x7b": 12.9, "qwen3-30b-a3b": 3.3}


@pytest.mark.parametrize("name", ACTIVE)
def test_presets_active_and_total(name, capsys):
    c = Config.from_name(name)
    total, active = parameter_count(c), parameter_count(c, active=True)
    print(f"{name}: {total:,} parameters, {active:,} active per token")
    assert abs(active / 1e9 - ACTIVE[name]) < 0.06
    E, k = c.n_experts, c.n_experts_active
    experts = sum(r.total for r in parameter_table(c) if r.component.startswith("moe.")
                  and r.component != "moe.router")
    assert total - active == experts - experts // E * k  # only the unchosen experts differ
    assert "active per token" in capsys.readouterr().out


@pytest.mark.parametrize("name", ACTIVE)
def test_presets_trace_their_experts_on_meta(name):
    c = Config.from_name(name)
    prefill, decode = trace_shapes(c, 6, 1)
    E, k, D, Fm = c.n_experts, c.n_experts_active, c.hidden_size, c.moe_ffn_size
    last = c.n_layers - 1
    for trace, T in ((prefill, 6), (decode, 1)):
        for i in (0, last):
            get = lambda op: trace.get(f"layers.{i}.mlp.{op}")  # noqa: E731
            assert get("router").shape == (1, T, E) and get("router").macs == T * D * E
            assert get("experts_chosen").shape == get("expert_weights").shape == (1, T, k)
            out = get("expert_out")
            assert out.shape == (1, T, k, D) and out.macs == T * k * 3 * D * Fm  # k of E
            assert get("out").shape == (1, T, D)
    assert not any(r.name.endswith("mlp.down") for r in prefill)


def qwen3_moe_json(**changes) -> dict:
    return {**hf_config("qwen3_moe").to_dict(), **changes}


@pytest.mark.parametrize("change, says", [
    ({"model_type": "qwen2_moe"}, "a mixture of experts (num_local_experts=4: each token"),
    ({"model_type": "qwen2_moe"}, "not for model_type 'qwen2_moe'"),
    ({"model_type": "dbrx"}, "implemented only as Mixtral, Qwen3-MoE, DeepSeek-V3, "
                             "DeepSeek-V2, gpt-oss, Qwen3-Next, OLMoE and Llama 4 compute it"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must lie in 1 .. num_experts=4"),
    ({"num_experts": 4, "num_local_experts": 8}, "num_experts=4 and num_local_experts=8 "
                                                 "disagree"),
    ({"mlp_only_layers": [2]}, "mlp_only_layers must list layer indices 0 .. 1"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be at least 1"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob must be true or false"),
    ({"attention_bias": True}, "attention_bias=true (projections with a bias"),
])
def test_what_is_not_computed_is_refused_by_its_key(change, says):
    with pytest.raises(LlmTraceError) as err:
        Config.from_hf(qwen3_moe_json(**change))
    assert says in str(err.value)


def test_switches_a_family_does_not_compute_are_refused():
    with pytest.raises(LlmTraceError, match="n_experts=8 set with family 'llama'"):
        Config.from_name("tinyllama").replace(n_experts=8, n_experts_active=2,
                                              moe_ffn_size=64).to_hf()
    mixtral = Config.from_name("mixtral-8x7b")
    with pytest.raises(LlmTraceError, match="moe_renormalize=False, but HF's MixtralForCausalLM"):
        mixtral.replace(moe_renormalize=False).to_hf()
    with pytest.raises(LlmTraceError, match="experts in every layer, each intermediate_size"):
        mixtral.replace(moe_ffn_size=1024).to_hf()
    with pytest.raises(LlmTraceError, match="mlp_types has MoE layers but n_experts=0"):
        Config.from_name("tinyllama").replace(mlp_types=("moe",) * 22)
    with pytest.raises(LlmTraceError, match="moe_router='top1' must be one of softmax_topk"):
        mixtral.replace(moe_router="top1")


def test_dense_layers_and_sliding_window_read_back():
    """decoder_sparse_step and mlp_only_layers decide the dense layers as HF's class does;
    to_hf writes them as mlp_only_layers, which HF reads back to the same layers; a window
    only with use_sliding_window, as Qwen3MoeConfig."""
    n4 = dict(num_hidden_layers=4)
    c = Config.from_hf(qwen3_moe_json(**n4, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert c.mlp_types == ("dense", "moe", "dense", "dense")
    hf = transformers.Qwen3MoeConfig(**{k: v for k, v in c.to_hf().items()
                                        if k != "architectures"})
    assert Config.from_hf(hf.to_dict(), name=c.name) == c
    assert Config.from_hf(qwen3_moe_json(**n4, mlp_only_layers=[])).mlp_types == ()
    assert Config.from_hf(qwen3_moe_json(sliding_window=4)).sliding_window == 0
    assert Config.from_hf(qwen3_moe_json(sliding_window=4, use_sliding_window=True)
                          ).sliding_window == 4


def test_gguf_experts_are_refused_by_key():
    with pytest.raises(LlmTraceError, match="llama.expert_count=8 .a mixture of experts. is "
                                            "not read from GGUF: load the Hugging Face"):
        Config.from_gguf({"general.architecture": "llama", "llama.expert_count": 8})


# The published config.json of each preset, the keys that fix its shapes and routing
# (mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B on the hub)
PUBLISHED_JSON = {
    "mixtral-8x7b": dict(
        model_type="mixtral", bos_token_id=1, eos_token_id=2, hidden_act="silu",
        hidden_size=4096, intermediate_size=14336, max_position_embeddings=32768,
        num_attention_heads=32, num_experts_per_tok=2, num_hidden_layers=32,
        num_key_value_heads=8, num_local_experts=8, rms_norm_eps=1e-05,
        rope_theta=1000000.0, router_aux_loss_coef=0.02, sliding_window=None,
        tie_word_embeddings=False, vocab_size=32000),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", attention_bias=False, bos_token_id=151643,
        decoder_sparse_step=1, eos_token_id=151645, head_dim=128, hidden_act="silu",
        hidden_size=2048, intermediate_size=6144, max_position_embeddings=40960,
        max_window_layers=48, mlp_only_layers=[], moe_intermediate_size=768,
        norm_topk_prob=True, num_attention_heads=32, num_experts=128, num_experts_per_tok=8,
        num_hidden_layers=48, num_key_value_heads=4, rms_norm_eps=1e-06, rope_scaling=None,
        rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False,
        use_sliding_window=False, vocab_size=151936),
}


@pytest.mark.parametrize("name", PUBLISHED_JSON)
def test_presets_are_the_published_config_json(name):
    assert Config.from_hf(PUBLISHED_JSON[name], name=name) == Config.from_name(name)
