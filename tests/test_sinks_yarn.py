"""gpt-oss's attention pieces and SmolLM3's NoPE layers, each against Hugging Face transformers'
own code: learned attention sinks (the `mix` step of an attention part with `Sinks`, and
`Windowed` for a sliding layer) against gpt-oss's `eager_attention_forward`, YaRN RoPE scaling
(`mechanisms.yarn`: `yarn_frequencies`, `yarn_cos_sin`) against `_compute_yarn_parameters` and
gpt-oss's rotary embedding, and a layer without RoPE (the `Unturned` part) that leaves q and k
as projected."""

import math
from types import SimpleNamespace

import pytest
import torch
from transformers.modeling_rope_utils import _compute_yarn_parameters
from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
from transformers.models.gpt_oss.modeling_gpt_oss import (GptOssRotaryEmbedding,
                                                          eager_attention_forward)

from llmtrace_book import Config, LlmTraceError, load_model
from llmtrace_book.attention import Attention, Positions, causal_mask, repeat_kv
from llmtrace_book.mechanisms import part
from llmtrace_book.mechanisms.attention_steps import Sinks, Unturned, Windowed, window_mask
from llmtrace_book.mechanisms.yarn import rope_attention_factor, yarn_cos_sin, yarn_frequencies
from llmtrace_book.rope import rope_cos_sin, rope_frequencies
from llmtrace_book.trace import Trace

TOL = 1e-6
B, H, KV, T, HD = 2, 4, 2, 9, 16


def random_attention(seed=0, start=0):
    """q [B, H, T, hd], k and v [B, KV, S, hd] (S = start + T), sinks [H], from one seed."""
    g = torch.Generator().manual_seed(seed)
    S = start + T
    q = torch.randn(B, H, T, HD, generator=g)
    k, v = torch.randn(B, KV, S, HD, generator=g), torch.randn(B, KV, S, HD, generator=g)
    sinks = 2 * torch.randn(H, generator=g)  # logits of the size scores have
    return q, k, v, sinks


def hf_sink_attention(q, k, v, sinks, mask):
    """HF's gpt-oss eager attention: (output [B, T, H, hd], weights [B, H, T, S])."""
    module = SimpleNamespace(num_key_value_groups=H // KV, sinks=sinks, training=False)
    return eager_attention_forward(module, q, k, v, mask[None, None], HD**-0.5)


def config(window=0):
    """A one-layer config of these heads; window: a sliding window of that width."""
    return Config("sinks-test", vocab_size=8, hidden_size=H * HD, n_layers=1, n_heads=H,
                  n_kv_heads=KV, ffn_size=8, max_positions=64, head_dim=HD,
                  sliding_window=window, attn_sinks=True)


def pass_at(start, device=None):
    """The pass's positions: T queries after `start` cached ones, its causal mask [T, S]."""
    return Positions.of(start, T, config(), device)


def ours(q, k, v, sinks, window=0, start=0):
    """gpt-oss's attention steps from the scores on (`mix`: its Sinks, a Windowed part if the
    layer slides) over k, v expanded to every query head."""
    trace = Trace()
    attn = part(Sinks, window and Windowed, Attention)(config(window))
    out = attn.mix(q, repeat_kv(k, H // KV), repeat_kv(v, H // KV), SimpleNamespace(sinks=sinks),
                   pass_at(start), trace, "attn")  # [B, H, T, hd]
    return out, trace


MASKS = {  # name -> (start, window): causal over a prefill, a window of 3, a decode step
    "causal": (0, None),
    "window": (0, 3),
    "window, 6 cached": (6, 3),
}


@pytest.mark.parametrize("kind", MASKS)
def test_sinks_match_hf(kind):
    start, W = MASKS[kind]
    q, k, v, sinks = random_attention(1, start)
    S = start + T
    causal = causal_mask(T, S, start)  # [T, S]
    window = window_mask(T, S, start, W) if W else None
    full = causal + window if W else causal
    ref_out, ref_w = hf_sink_attention(q, k, v, sinks, full)
    out, trace = ours(q, k, v, sinks, W or 0, start)
    assert torch.equal(trace["attn.causal_mask"], causal)  # the mask HF was given
    assert (trace["attn.weights"] - ref_w).abs().max().item() < TOL
    assert (out.transpose(1, 2) - ref_out).abs().max().item() < TOL
    assert trace.shape("attn.scores_with_sink") == (B, H, T, S + 1)
    assert trace.shape("attn.weights_with_sink") == (B, H, T, S + 1)
    assert trace.shape("attn.weights") == (B, H, T, S)
    if W:  # the window's keys get no weight, and the sink keeps its share
        assert torch.equal(trace["attn.window_mask"], full)
        assert torch.all(trace["attn.weights"][..., full == float("-inf")] == 0)


def test_rows_sum_below_one_by_the_sink_column():
    q, k, v, sinks = random_attention(2)
    _, trace = ours(q, k, v, sinks)
    rows = trace["attn.weights"].sum(-1)  # [B, H, T]
    sink = trace["attn.weights_with_sink"][..., -1]  # [B, H, T]
    assert torch.all(rows < 1) and torch.all(sink > 0)
    assert (1 - rows - sink).abs().max().item() < TOL  # the missing mass is the sink's
    assert "rows sum below 1" in trace.get("attn.weights").op


def test_ignoring_the_sinks_moves_the_weights():
    """Negative control: the same scores without the sink column are far from HF's."""
    q, k, v, sinks = random_attention(3)
    mask = causal_mask(T, T, 0)
    _, ref_w = hf_sink_attention(q, k, v, sinks, mask)
    trace = Trace()
    Attention(config()).mix(q, repeat_kv(k, H // KV), repeat_kv(v, H // KV),
                            SimpleNamespace(sinks=sinks), pass_at(0), trace, "attn")
    assert (trace["attn.weights"] - ref_w).abs().max().item() > 100 * TOL
    assert "attn.weights_with_sink" not in trace.names


def test_without_sinks_the_attention_records_what_it_did():
    """attn_sinks off: no Sinks in the part, and its steps are Llama's: the same record
    names and ops, and the values of softmax(q k^T / sqrt(hd) + mask) v."""
    assert part(config().replace(attn_sinks=False).attn_sinks and Sinks, Attention) is Attention
    q, k, v, _ = random_attention(4)
    k, v = k[:, :1].expand(B, H, T, HD), v[:, :1].expand(B, H, T, HD)
    mask = causal_mask(T, T, 0)
    a = Trace()
    out = Attention(config()).mix(q, k, v, SimpleNamespace(sinks=None), pass_at(0), a, "attn")
    assert a.names == ["attn.scores", "attn.causal_mask", "attn.masked_scores",
                       "attn.weights", "attn.weighted_sum"]
    assert [r.op for r in a.records] == [
        f"q @ k^T / sqrt({HD})", "0 where key <= query position, -inf after (0 cached)",
        "scores + causal_mask", "softmax over keys (rows sum to 1)", "weights @ v"]
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(HD) + mask, dim=-1)
    assert (a["attn.weights"] - weights).abs().max().item() < TOL
    assert (out - weights @ v).abs().max().item() < TOL


def test_sinks_on_the_meta_device():
    q, k, v, sinks = (t.to("meta") for t in random_attention(5))
    trace = Trace(keep_values=False)
    out = part(Sinks, Attention)(config()).mix(
        q, repeat_kv(k, H // KV), repeat_kv(v, H // KV), SimpleNamespace(sinks=sinks),
        pass_at(0, "meta"), trace, "attn")
    assert out.shape == (B, H, T, HD) and out.device.type == "meta"
    assert trace.shape("attn.weights_with_sink") == (B, H, T, T + 1)
    assert trace.shape("attn.weights") == (B, H, T, T)


# --- YaRN ---------------------------------------------------------------------------------------

GPT_OSS_20B = {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,  # its config.json
               "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False}
YARN = {  # name -> (head_dim, rope_theta, rope_scaling)
    "gpt-oss-20b": (64, 150_000.0, GPT_OSS_20B),
    "truncated (HF's default)": (64, 10_000.0, {"rope_type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 2048}),
    "mscale and mscale_all_dim": (128, 10_000.0, {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.5}),
    "attention_factor given": (32, 500_000.0, {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024,
        "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.5, "truncate": True}),
}


def hf_config(head_dim, theta, s):
    return GptOssConfig(head_dim=head_dim, num_attention_heads=4, hidden_size=4 * head_dim,
                        max_position_embeddings=int(s["factor"] * s[
                            "original_max_position_embeddings"]),
                        rope_parameters={**s, "rope_theta": theta})


def positions():
    return torch.tensor([0, 1, 7, 100, 1000, 4095, 4096, 20_000, 131_071])


@pytest.mark.parametrize("name", YARN)
def test_yarn_matches_hf(name):
    head_dim, theta, s = YARN[name]
    pairs = tuple(sorted(s.items()))
    config = hf_config(head_dim, theta, s)
    inv_freq, factor = _compute_yarn_parameters(config)
    assert (yarn_frequencies(head_dim, theta, dict(pairs)) - inv_freq).abs().max() < TOL
    assert rope_attention_factor(dict(pairs)) == pytest.approx(factor, abs=TOL)
    p = positions()
    cos, sin = yarn_cos_sin(p, head_dim, theta, pairs)  # [T, hd] each
    ref_cos, ref_sin = GptOssRotaryEmbedding(config)(torch.zeros(1), p[None])  # [1, T, hd/2]
    half = head_dim // 2
    for ours_, ref in ((cos, ref_cos[0]), (sin, ref_sin[0])):
        assert ours_.shape == (len(p), head_dim)
        assert (ours_[:, :half] - ref).abs().max().item() < TOL
        assert torch.equal(ours_[:, :half], ours_[:, half:])  # each pair shares its angle
    plain_cos, plain_sin = rope_cos_sin(p, head_dim, theta)  # the scaling removed
    assert (plain_cos[:, :half] - ref_cos[0]).abs().max().item() > 100 * TOL
    assert (plain_sin[:, :half] - ref_sin[0]).abs().max().item() > 100 * TOL


def test_yarn_blends_between_interpolated_and_extrapolated():
    """gpt-oss-20b's frequencies: the fastest pairs as plain RoPE, the slowest 32x slower,
    and its attention factor 0.1 ln 32 + 1 on both tables."""
    head_dim, theta, s = YARN["gpt-oss-20b"]
    plain = rope_frequencies(head_dim, theta)
    yarn = yarn_frequencies(head_dim, theta, s)
    assert yarn[0] == plain[0] and (yarn[-1] / (plain[-1] / 32) - 1).abs() < 1e-6
    assert torch.all(yarn <= plain) and torch.all(yarn >= plain / 32 * (1 - 1e-6))
    assert rope_attention_factor(s) == pytest.approx(0.1 * math.log(32) + 1)


def test_yarn_on_the_meta_device():
    head_dim, theta, s = YARN["gpt-oss-20b"]
    cos, sin = yarn_cos_sin(torch.arange(5, device="meta"), head_dim, theta,
                            tuple(sorted(s.items())))
    assert cos.shape == sin.shape == (5, head_dim) and cos.device.type == "meta"


@pytest.mark.parametrize("extra, says", [
    ({"partial_rotary_factor": 0.5}, "rope_scaling partial_rotary_factor=0.5 is not computed"),
    ({"finetuned": True}, "rope_scaling finetuned=True is not computed"),
    ({"factor": None}, "needs a positive factor"),
    ({"rope_theta": 10_000.0}, "rope_theta=10000.0 differs from the RoPE base 150000.0"),
])
def test_a_yarn_setting_not_computed_is_refused_by_its_key(extra, says):
    pairs = tuple(sorted({**GPT_OSS_20B, **extra}.items()))
    with pytest.raises(LlmTraceError, match=says) as e:
        yarn_cos_sin(positions(), 64, 150_000.0, pairs)
    assert "\n" not in str(e.value)


# --- NoPE ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def embedded():
    return load_model("embedded")


def test_a_layer_without_rope_leaves_q_and_k_as_projected(embedded):
    """SmolLM3's NoPE layers: with the Unturned part, the q and k the attention scores are the
    projections' heads, and the rope records say so; with RoPE (Llama's part), they are
    turned."""
    m = embedded
    ids = m.encode("The capital of France is")
    x = torch.nn.functional.embedding(ids, m.weights.embed)  # [1, T, D]
    pos = m.positions(0, ids.shape[1])
    lw = m.weights.layers[0]
    nope, rope = Trace(), Trace()
    out = part(Unturned, Attention)(m.config, 0)(x, lw, pos, None, nope)
    Attention(m.config, 0)(x, lw, pos, None, rope)
    for qk in ("q", "k"):
        assert torch.equal(nope[f"attn.rope_{qk}"], nope[f"attn.{qk}"])
        assert nope.get(f"attn.rope_{qk}").op == f"no RoPE on this layer: {qk} unturned"
        assert (rope[f"attn.rope_{qk}"] - rope[f"attn.{qk}"]).abs().max() > 1e-2
    assert nope.names == rope.names  # the same records on every layer
    # the scores are the unturned heads' dot products
    hd = m.config.head_dim
    q = nope["attn.q"].transpose(1, 2)  # [1, H, T, hd]
    k = repeat_kv(nope["attn.k"].transpose(1, 2), m.config.n_rep)  # [1, H, T, hd]
    assert (nope["attn.scores"] - q @ k.transpose(-2, -1) / math.sqrt(hd)).abs().max() < 1e-5
    assert out.shape == x.shape
