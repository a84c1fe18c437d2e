"""Multi-head latent attention (mla.py's part, `LatentAttention`, built from a `Config` of the
dims under test) against HF transformers' own DeepseekV3Attention (with q_lora_rank) and
DeepseekV2Attention (V2-Lite's form: one q_proj, complex RoPE), with and without YaRN, prefill
then decode through the latent cache; DeepSeek-V3's MoE (moe.py) against
DeepseekV3MoE, with a negative control for each routing detail; records on meta; the names on
disk; the cache's bytes per token; the appendix's toy latent."""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV2Config, DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v2.modeling_deepseek_v2 import (DeepseekV2Attention,
                                                                  DeepseekV2RotaryEmbedding)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3Attention,
                                                                  DeepseekV3MoE,
                                                                  DeepseekV3RotaryEmbedding)

from llmtrace_book.mechanisms import mla
from llmtrace_book.mechanisms.moe import MlpWeights, MoeWeights, moe_mlp, moe_params
from llmtrace_book.attention import Positions, causal_mask
from llmtrace_book.config import Config
from llmtrace_book.errors import LlmTraceError
from llmtrace_book.mechanisms.mla import (LatentAttention, LatentCache, MlaDims, MlaWeights,
                                     cache_bytes_per_token, mla_params,
                                     mla_softmax_scale)
from llmtrace_book.mechanisms.yarn import yarn_cos_sin
from llmtrace_book.model import Model
from llmtrace_book.parts import LayerWeights
from llmtrace_book.rope import rope_cos_sin
from llmtrace_book.trace import Trace

TOL = 1e-5
D, H, R, RQ, DN, DR, DV = 64, 4, 16, 24, 8, 4, 8
B, PREFILL, STEPS = 2, 7, 3

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 16, "beta_fast": 32,
        "beta_slow": 1}  # DeepSeek-V3's YaRN, its original context cut to 16 positions
YARN_UNEQUAL = {**YARN, "mscale": 0.9, "mscale_all_dim": 0.7}  # cos and sin scaled too
ROPES = {"default": {"rope_type": "default", "rope_theta": 10000.0}, "yarn": YARN,
         "yarn, mscale differs": YARN_UNEQUAL}


def _hf_config(version, q_lora, rope, interleave=True):
    common = dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=H, kv_lora_rank=R,
                  q_lora_rank=RQ if q_lora else None, qk_nope_head_dim=DN,
                  qk_rope_head_dim=DR, v_head_dim=DV, max_position_embeddings=640,
                  rope_parameters=dict(ROPES[rope]), attention_bias=False,
                  rms_norm_eps=1e-5)  # not the latents' norms' eps (1e-6)
    if version == 3:
        c = DeepseekV3Config(rope_interleave=interleave, **common)
    else:
        c = DeepseekV2Config(**common)
    c._attn_implementation = "eager"
    return c


def _hf_attention(version, q_lora, rope, interleave=True, seed=0):
    """HF's attention module and its rotary embedding, random weights of order 1."""
    torch.manual_seed(seed)
    c = _hf_config(version, q_lora, rope, interleave)
    cls, rot = ((DeepseekV3Attention, DeepseekV3RotaryEmbedding) if version == 3
                else (DeepseekV2Attention, DeepseekV2RotaryEmbedding))
    attn = cls(c, layer_idx=0).eval()
    for n, p in attn.named_parameters():
        if "layernorm" in n:
            torch.nn.init.normal_(p, mean=1.0, std=0.2)
        else:
            torch.nn.init.normal_(p, std=0.6 / math.sqrt(p.shape[-1]))
    return attn, rot(c), c


def _weights(attn) -> MlaWeights:
    q = (dict(q_a=attn.q_a_proj.weight, q_a_norm=attn.q_a_layernorm.weight,
              q_b=attn.q_b_proj.weight) if attn.q_lora_rank is not None
         else dict(q_proj=attn.q_proj.weight))
    return MlaWeights(kv_a=attn.kv_a_proj_with_mqa.weight,
                      kv_a_norm=attn.kv_a_layernorm.weight, kv_b=attn.kv_b_proj.weight,
                      o_proj=attn.o_proj.weight, **q)


def _dims(c, version, interleave=True) -> MlaDims:
    return MlaDims(n_heads=H, kv_lora_rank=R, qk_nope_head_dim=DN, qk_rope_head_dim=DR,
                   v_head_dim=DV, q_lora_rank=c.q_lora_rank,
                   rope_interleave=interleave if version == 3 else True,
                   rope_scaling=tuple(sorted(c.rope_parameters.items()))
                   if c.rope_parameters["rope_type"] != "default" else ())


def _positions(start, T, d: MlaDims, device=None):
    """RoPE's tables of the rotated part (DR wide), YaRN's where the dims' scaling says so."""
    s = d.rope_scaling
    theta = 10000.0
    rope = yarn_cos_sin if dict(s).get("rope_type") == "yarn" else rope_cos_sin
    cos, sin = rope(torch.arange(start, start + T, device=device), d.qk_rope_head_dim, theta, s)
    return Positions(start, cos, sin, causal_mask(T, start + T, start, device))


def _attention(d: MlaDims, hidden=D) -> LatentAttention:
    """The latent attention part of a one-layer DeepSeek config with exactly these dims."""
    c = Config("mla-test", vocab_size=64, hidden_size=hidden, n_layers=1, n_heads=d.n_heads,
               n_kv_heads=d.n_heads, ffn_size=8, max_positions=640, family="deepseek_v3",
               head_dim=d.qk_rope_head_dim, kv_lora_rank=d.kv_lora_rank,
               q_lora_rank=d.q_lora_rank or 0, qk_nope_head_dim=d.qk_nope_head_dim,
               v_head_dim=d.v_head_dim, rope_interleave=d.rope_interleave,
               rope_scaling=d.rope_scaling)
    attn = LatentAttention(c, 0)
    assert attn.dims == d  # the config says what the dims say, nothing more
    return attn


def _layer(w: MlaWeights) -> LayerWeights:
    """A layer's weights holding these latent attention weights (the part reads `w.mla`)."""
    return LayerWeights(mla=w)


def _xs(seed=1):
    """The prefill's 7 positions and the decode steps' one each: [B, 7 + STEPS, D]."""
    return torch.randn(B, PREFILL + STEPS, D, generator=torch.Generator().manual_seed(seed))


def _run_both(version, q_lora, rope, interleave=True, dims=None, seed=0):
    """Prefill then STEPS decode steps, HF with its cache, ours with a LatentCache: the
    outputs of every step, both caches, our traces."""
    attn, rot, c = _hf_attention(version, q_lora, rope, interleave, seed)
    w, d = _weights(attn), dims or _dims(c, version, interleave)
    ours = _attention(d)
    xs = _xs()
    hf_cache, ours_cache = DynamicCache(), LatentCache(PREFILL + STEPS, R, DR, batch=B)
    steps = [(0, PREFILL)] + [(PREFILL + i, 1) for i in range(STEPS)]
    got, want, traces = [], [], []
    with torch.no_grad():
        for start, T in steps:
            x = xs[:, start:start + T]
            ids = torch.arange(start, start + T)[None]
            mask = causal_mask(T, start + T, start)[None, None]  # [1, 1, T, S]
            out, _ = attn(x, position_embeddings=rot(x, ids), attention_mask=mask,
                          cache=hf_cache)
            want.append(out)
            tr = Trace()
            got.append(ours(x, _layer(w), _positions(start, T, d), ours_cache, tr,
                            "layers.0.attn"))
            traces.append(tr)
    return got, want, hf_cache, ours_cache, traces


CASES = [  # (version, q_lora_rank given, rope_parameters, rope_interleave)
    (3, True, "default", True), (3, True, "yarn", True), (3, True, "yarn, mscale differs", True),
    (3, False, "default", True), (3, True, "default", False), (3, False, "yarn", False),
    (2, False, "default", True), (2, False, "yarn", True)]


@pytest.mark.parametrize("version,q_lora,rope,interleave", CASES)
def test_prefill_and_decode_match_hf(version, q_lora, rope, interleave):
    got, want, hf_cache, cache, traces = _run_both(version, q_lora, rope, interleave)
    for i, (a, b) in enumerate(zip(got, want)):
        err = (a - b).abs().max().item()
        assert err < TOL, f"step {i}: max |ours - HF| = {err:.2e}"
        assert b.abs().max() > 0.1  # outputs of order 1, not a vanishing signal
    # HF's cache of this class holds the same two things: the normed latent, the rotated key
    S = PREFILL + STEPS
    hf_latent, hf_rope = hf_cache.layers[0].keys[:, 0], hf_cache.layers[0].values[:, 0]
    assert hf_latent.shape == (B, S, R) and hf_rope.shape == (B, S, DR)
    torch.testing.assert_close(cache.latent, hf_latent, rtol=0, atol=1e-6)
    if version == 2:  # V2's complex RoPE keeps the pairs adjacent: ours are de-interleaved
        hf_rope = mla.deinterleave(hf_rope)
    torch.testing.assert_close(cache.k_rope, hf_rope, rtol=0, atol=1e-6)
    last = traces[-1]
    assert last.shape("layers.0.attn.kv_cache.latent") == (B, S, R)
    assert last.shape("layers.0.attn.kv_cache.k_rope") == (B, S, DR)
    assert last.shape("layers.0.attn.k") == (B, S, H, DN + DR)
    assert last.shape("layers.0.attn.scores") == (B, H, 1, S)


def _moved(version, q_lora, rope, dims_change, interleave=True):
    """max |ours with one detail changed - HF| over the steps."""
    d = _dims(_hf_config(version, q_lora, rope, interleave), version, interleave)
    got, want, *_ = _run_both(version, q_lora, rope, interleave,
                              dataclasses.replace(d, **dims_change))
    return max((a - b).abs().max().item() for a, b in zip(got, want))


@pytest.mark.parametrize("version,q_lora,rope,change", [
    (3, True, "yarn", dict(rope_scaling=())),  # no mscale on the scores, no YaRN frequencies
    (3, True, "default", dict(rope_interleave=False)),  # pairs half-split, not adjacent
    (2, False, "default", dict(rope_interleave=False)),
])
def test_each_detail_matters(version, q_lora, rope, change):
    moved = _moved(version, q_lora, rope, change)
    assert moved > 100 * TOL, f"{change}: moved {moved:.1e}"


def test_yarn_mscale_of_the_scores_matters(monkeypatch):
    """DeepSeek-V3's YaRN: mscale = mscale_all_dim, so cos and sin keep their size and only the
    scores' factor, mscale^2 = (0.1 ln 40 + 1)^2 = 1.87, carries the stretch."""
    m = 0.1 * math.log(40) + 1
    assert mla_softmax_scale(DN + DR, tuple(YARN.items())) == pytest.approx(
        m * m / math.sqrt(DN + DR), rel=1e-12)
    monkeypatch.setattr(MlaDims, "softmax_scale", property(lambda d: (DN + DR) ** -0.5))
    got, want, *_ = _run_both(3, True, "yarn")
    moved = max((a - b).abs().max().item() for a, b in zip(got, want))
    assert moved > 100 * TOL, f"without mscale^2: moved {moved:.1e}"


def test_records_and_macs():
    got, _, _, _, traces = _run_both(3, True, "default")
    prefill, step = traces[0], traces[-1]
    names = [r.name.removeprefix("layers.0.attn.") for r in prefill]
    assert names == ["q_a", "q_a_norm.mean_sq", "q_a_norm", "q_proj", "q", "rope_q", "kv_a",
                     "latent", "latent_norm.mean_sq", "latent_norm", "rope_k", "kv_cache.latent",
                     "kv_cache.k_rope", "kv_up", "k", "v", "scores", "causal_mask",
                     "masked_scores", "weights", "weighted_sum", "merged", "out"]
    S, T = PREFILL + STEPS, 1
    shapes = {r.name.removeprefix("layers.0.attn."): r.shape for r in step}
    assert shapes["q_a"] == (B, T, RQ) and shapes["q"] == (B, T, H, DN + DR)
    assert shapes["rope_q"] == (B, T, H, DR) and shapes["kv_a"] == (B, T, R + DR)
    assert shapes["latent_norm"] == (B, T, R) and shapes["rope_k"] == (B, T, DR)
    assert shapes["kv_up"] == (B, S, H * (DN + DV)) and shapes["v"] == (B, S, H, DV)
    assert shapes["weighted_sum"] == (B, H, T, DV) and shapes["out"] == (B, T, D)
    macs = {r.name.removeprefix("layers.0.attn."): r.macs for r in step if r.macs}
    assert macs == {"q_a": B * T * D * RQ, "q_proj": B * T * RQ * H * (DN + DR),
                    "kv_a": B * T * D * (R + DR),
                    "kv_up": B * S * R * H * (DN + DV),  # every cached position, each step
                    "scores": B * H * T * S * (DN + DR),
                    "weighted_sum": macs["weighted_sum"], "out": B * T * H * DV * D}
    # the rotated key part is one for all heads: every head's k holds the same k_rope
    k = step["layers.0.attn.k"]
    assert torch.equal(k[:, :, 0, DN:], k[:, :, 3, DN:])
    assert torch.equal(k[..., DN:], step["layers.0.attn.kv_cache.k_rope"][:, :, None]
                       .expand(B, S, H, DR))


def test_weighted_sum_macs_at_v_width():
    *_, traces = _run_both(3, True, "default")
    S = PREFILL + STEPS
    assert traces[-1].get("layers.0.attn.weighted_sum").macs == B * H * 1 * S * DV


def _meta(w: MlaWeights) -> MlaWeights:
    return MlaWeights(**{k: None if v is None else torch.empty_like(v, device="meta")
                         for k, v in w.__dict__.items()})


@pytest.mark.parametrize("q_lora", [True, False])
def test_meta_records_match_real(q_lora):
    attn, _, c = _hf_attention(3, q_lora, "yarn")
    w, d = _weights(attn), _dims(c, 3)
    ours = _attention(d)
    rows = {}
    for device in ("cpu", "meta"):
        weights = _layer(w if device == "cpu" else _meta(w))
        cache = LatentCache(PREFILL + 1, R, DR, batch=B, device=device)
        x = _xs().to(device)
        tr = Trace()
        with torch.no_grad():
            ours(x[:, :PREFILL], weights, _positions(0, PREFILL, d, device), cache, tr)
            ours(x[:, PREFILL:PREFILL + 1], weights, _positions(PREFILL, 1, d, device), cache,
                 tr, "step")
        rows[device] = [(r.name, r.shape, r.dtype, r.macs) for r in tr]
    assert rows["cpu"] == rows["meta"]
    assert len(rows["cpu"]) == 2 * (23 if q_lora else 20)


def test_cache_refuses_past_its_length_and_a_pass_without_it():
    attn, _, c = _hf_attention(3, True, "default")
    w, d = _layer(_weights(attn)), _dims(c, 3)
    ours = _attention(d)
    x = _xs()
    with pytest.raises(LlmTraceError, match="the latent cache holds 4 positions, this step "
                       "needs 7: make it with max_len 7 or larger"):
        ours(x[:, :PREFILL], w, _positions(0, PREFILL, d), LatentCache(4, R, DR, B))
    with pytest.raises(LlmTraceError, match="a pass starting at position 7 reads the earlier "
                       "ones from a latent cache"):
        ours(x[:, :1], w, _positions(PREFILL, 1, d))


def test_dims_refused_by_name():
    with pytest.raises(LlmTraceError, match="MLA qk_rope_head_dim must be even"):
        MlaDims(H, R, DN, 5, DV)
    with pytest.raises(LlmTraceError, match="MLA kv_lora_rank must be a positive whole number"):
        MlaDims(H, 0, DN, DR, DV)
    with pytest.raises(LlmTraceError, match="MLA q_lora_rank must be a positive whole number "
                       "or null"):
        MlaDims(H, R, DN, DR, DV, q_lora_rank=2.5)


# --- DeepSeek-V3's MoE -----------------------------------------------------------------------

E, K, FF, GROUPS, TOPK_GROUPS, SHARED, SCALE = 16, 4, 12, 4, 2, 2, 2.5


def _moe_config(**changes):
    c = DeepseekV3Config(hidden_size=D, moe_intermediate_size=FF, n_routed_experts=E,
                         num_experts_per_tok=K, n_group=GROUPS, topk_group=TOPK_GROUPS,
                         n_shared_experts=SHARED, routed_scaling_factor=SCALE,
                         norm_topk_prob=True, **changes)
    c._experts_implementation = "eager"
    return c


def _hf_moe(seed=0, **changes):
    """HF's block, seeded: logits spread (std ~2) and a bias of the size of the scores'
    differences, so that grouping and bias both change the choice."""
    torch.manual_seed(seed)
    block = DeepseekV3MoE(_moe_config(**changes)).eval()
    for n, p in block.named_parameters():
        torch.nn.init.normal_(p, std=0.25 if n == "gate.weight" else 0.1)
    block.gate.e_score_correction_bias.normal_(std=0.2)
    return block


def _moe_weights(block) -> MoeWeights:
    gate_up = block.experts.gate_up_proj  # [E, 2F, D]: gate rows, then up rows
    s = block.shared_experts
    return MoeWeights(router=block.gate.weight, gate=gate_up[:, :FF], up=gate_up[:, FF:],
                      down=block.experts.down_proj, score_bias=block.gate.e_score_correction_bias,
                      shared=MlpWeights(s.gate_proj.weight, s.up_proj.weight, s.down_proj.weight))


V3_ARGS = dict(router="sigmoid_group", renormalize=True, n_group=GROUPS, topk_group=TOPK_GROUPS,
               scaling=SCALE)


def _moe_x(seed=1):
    return torch.randn(B, PREFILL, D, generator=torch.Generator().manual_seed(seed))


def test_v3_moe_matches_hf():
    block, x = _hf_moe(), _moe_x()
    tr = Trace()
    with torch.no_grad():
        want = block(x)
        got = moe_mlp(x, _moe_weights(block), K, **V3_ARGS, trace=tr, name="layers.3.mlp")
        _, hf_weights, hf_ids = block.gate(x)
    err = (got - want).abs().max().item()
    assert err < TOL, f"max |ours - HF| = {err:.2e}"
    chosen = tr["layers.3.mlp.experts_chosen"].reshape(-1, K)
    assert len(chosen.unique()) >= 2
    # the same experts (HF's order is unsorted) with the same weights
    ours_sorted, order = chosen.sort(dim=-1)
    hf_sorted, hf_order = hf_ids.sort(dim=-1)
    assert torch.equal(ours_sorted, hf_sorted)
    weights = tr["layers.3.mlp.expert_weights"].reshape(-1, K)
    torch.testing.assert_close(weights.gather(-1, order), hf_weights.gather(-1, hf_order),
                               rtol=0, atol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.tensor(SCALE))  # renormalized, then x 2.5
    # chosen experts lie in the chosen groups only
    groups = tr["layers.3.mlp.groups_chosen"].reshape(-1, TOPK_GROUPS)
    assert all(set((c // (E // GROUPS)).tolist()) <= set(g.tolist())
               for c, g in zip(chosen, groups))


def _moe_moved(change: dict) -> float:
    block, x = _hf_moe(), _moe_x()
    w = _moe_weights(block)
    args = {**V3_ARGS, **{k: v for k, v in change.items() if k in V3_ARGS}}
    w = MoeWeights(**{**w.__dict__, **{k: v for k, v in change.items() if k in w.__dict__}})
    with torch.no_grad():
        want = block(x)
        return (moe_mlp(x, w, K, **args) - want).abs().max().item()


@pytest.mark.parametrize("change", [
    dict(n_group=1, topk_group=1),  # no grouping: the top k of all E
    dict(shared=None),  # no shared expert
    dict(scaling=1.0),  # no routed_scaling_factor
    dict(score_bias=None),  # no bias in the choice
    dict(renormalize=False),  # norm_topk_prob off
])
def test_v3_moe_each_detail_matters(change):
    moved = _moe_moved(change)
    assert moved > 100 * TOL, f"{change}: moved {moved:.1e}"


def test_v3_bias_chooses_but_does_not_weigh():
    """Weights taken from the biased scores (the bias used for weighing too) move the output:
    recombined from the same trace's experts, which reproduce the layer with the right ones."""
    block, x = _hf_moe(), _moe_x()
    tr = Trace()
    with torch.no_grad():
        want = block(x)
        got = moe_mlp(x, _moe_weights(block), K, **V3_ARGS, trace=tr)

    def recombine(scores):
        w = scores.gather(-1, tr["mlp.experts_chosen"])  # [B, T, K]
        w = w / w.sum(-1, keepdim=True) * SCALE
        return (w[..., None] * tr["mlp.expert_out"]).sum(2) + tr["mlp.shared.down"]

    assert (recombine(tr["mlp.router_scores"]) - got).abs().max() < TOL
    moved = (recombine(tr["mlp.choice_scores"]) - want).abs().max().item()
    assert moved > 100 * TOL, f"bias in the weights: moved {moved:.1e}"


def test_v3_moe_records_on_meta():
    w = _moe_weights(_hf_moe())
    rows = {}
    for device in ("cpu", "meta"):
        ww = w if device == "cpu" else MoeWeights(**{
            k: v if v is None else MlpWeights(*(torch.empty_like(t, device="meta")
                                                for t in v.__dict__.values()))
            if k == "shared" else torch.empty_like(v, device="meta")
            for k, v in w.__dict__.items()})
        tr = Trace()
        with torch.no_grad():
            out = moe_mlp(_moe_x().to(device), ww, K, **V3_ARGS, trace=tr, name="layers.3.mlp")
        assert out.shape == (B, PREFILL, D)
        rows[device] = [(r.name.removeprefix("layers.3.mlp."), r.shape, r.dtype, r.macs)
                        for r in tr]
    assert rows["cpu"] == rows["meta"]
    T = PREFILL
    assert rows["cpu"] == [
        ("router", (B, T, E), "float32", B * T * D * E),
        ("router_scores", (B, T, E), "float32", 0),
        ("choice_scores", (B, T, E), "float32", 0),
        ("group_scores", (B, T, GROUPS), "float32", 0),
        ("groups_chosen", (B, T, TOPK_GROUPS), "int64", 0),
        ("experts_chosen", (B, T, K), "int64", 0),
        ("expert_weights", (B, T, K), "float32", 0),
        ("expert_out", (B, T, K, D), "float32", B * T * K * 3 * D * FF),
        ("routed", (B, T, D), "float32", B * T * K * D),
        ("shared.gate", (B, T, SHARED * FF), "float32", B * T * D * SHARED * FF),
        ("shared.up", (B, T, SHARED * FF), "float32", B * T * D * SHARED * FF),
        ("shared.act", (B, T, SHARED * FF), "float32", 0),
        ("shared.gated", (B, T, SHARED * FF), "float32", 0),
        ("shared.down", (B, T, D), "float32", B * T * SHARED * FF * D),
        ("out", (B, T, D), "float32", 0)]


def test_v3_moe_params():
    block = _hf_moe()
    total, active = moe_params(_moe_weights(block), K)
    assert total == sum(p.numel() for p in block.parameters())  # HF's count: no buffer
    shared = 3 * D * SHARED * FF
    assert (total, active) == (E * D + E * 3 * D * FF + shared, E * D + K * 3 * D * FF + shared)


def test_groups_refused_by_name():
    w, x = _moe_weights(_hf_moe()), _moe_x()
    with pytest.raises(LlmTraceError, match="n_group=3 must divide the 16 experts into groups"):
        moe_mlp(x, w, K, **{**V3_ARGS, "n_group": 3})
    with pytest.raises(LlmTraceError, match=r"topk_group=1 must lie in 1 .. n_group=4 and its "
                       r"groups hold the k=5 experts chosen \(4 each\)"):
        moe_mlp(x, w, 5, **{**V3_ARGS, "topk_group": 1})


# --- the names on disk -----------------------------------------------------------------------

def _saved(version, tmp_path):
    """A two-layer model saved by save_pretrained, layer 0 dense (first_k_dense_replace=1),
    layer 1 MoE; V3 with q_lora_rank, V2 (V2-Lite's form) without."""
    common = dict(vocab_size=64, hidden_size=D, intermediate_size=48, moe_intermediate_size=FF,
                  num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=H,
                  n_shared_experts=SHARED, n_routed_experts=E, num_experts_per_tok=K,
                  kv_lora_rank=R, qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DV,
                  first_k_dense_replace=1)
    torch.manual_seed(0)
    if version == 3:
        c = DeepseekV3Config(q_lora_rank=RQ, n_group=GROUPS, topk_group=TOPK_GROUPS,
                             routed_scaling_factor=SCALE, norm_topk_prob=True, **common)
        model = DeepseekV3ForCausalLM(c)
    else:
        from transformers import DeepseekV2ForCausalLM
        model = DeepseekV2ForCausalLM(DeepseekV2Config(q_lora_rank=None, **common))
    for n, p in model.named_parameters():
        torch.nn.init.normal_(p, std=0.25 if "gate.weight" in n else 0.1)
    if version == 3:
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(std=0.2)
    model.eval().save_pretrained(tmp_path)
    return model, load_file(tmp_path / "model.safetensors")


def _names_on_disk(version):
    attn = ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]
    attn += ["q_a_proj", "q_a_layernorm", "q_b_proj"] if version == 3 else ["q_proj"]
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in (0, 1):
        p = f"model.layers.{i}"
        names |= {f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"}
        names |= {f"{p}.self_attn.{a}.weight" for a in attn}
    names |= {f"model.layers.0.mlp.{m}_proj.weight" for m in ("gate", "up", "down")}  # dense
    p = "model.layers.1.mlp"
    names |= {f"{p}.experts.{e}.{m}_proj.weight" for e in range(E) for m in ("gate", "up", "down")}
    names |= {f"{p}.shared_experts.{m}_proj.weight" for m in ("gate", "up", "down")}
    names |= {f"{p}.gate.weight"} | ({f"{p}.gate.e_score_correction_bias"} if version == 3
                                     else set())
    return names


@pytest.mark.parametrize("version", [3, 2])
def test_weights_from_names_on_disk(version, tmp_path):
    model, sd = _saved(version, tmp_path)
    assert set(sd) == _names_on_disk(version)
    p = "model.layers.1"
    assert tuple(sd[f"{p}.self_attn.kv_a_proj_with_mqa.weight"].shape) == (R + DR, D)
    assert tuple(sd[f"{p}.self_attn.kv_b_proj.weight"].shape) == (H * (DN + DV), R)
    assert tuple(sd[f"{p}.mlp.shared_experts.gate_proj.weight"].shape) == (SHARED * FF, D)
    assert tuple(sd[f"{p}.mlp.experts.0.gate_proj.weight"].shape) == (FF, D)
    layer, x = model.model.layers[1], _moe_x()
    # the attention, from the names on disk
    ours = Model(Config.from_hf(tmp_path)).blocks[1]  # the parts, which read their weights
    w = ours.attn.load(sd.__getitem__, p)["mla"]
    c = model.config
    d = _dims(c, version)
    ids = torch.arange(PREFILL)[None]
    mask = causal_mask(PREFILL, PREFILL, 0)[None, None]
    with torch.no_grad():
        want, _ = layer.self_attn(x, position_embeddings=model.model.rotary_emb(x, ids),
                                  attention_mask=mask)
        got = _attention(d)(x, _layer(w), _positions(0, PREFILL, d))
    assert (got - want).abs().max() < TOL
    assert mla_params(w) == sum(t.numel() for t in layer.self_attn.parameters())
    # the MoE layer, from the names on disk: V3's router, V2-Lite's (greedy softmax, no
    # renormalization, routed_scaling_factor 1)
    m = ours.mlp.load(sd.__getitem__, p)["moe"]
    args = V3_ARGS if version == 3 else dict(router="softmax_topk", renormalize=False)
    with torch.no_grad():
        got, want = moe_mlp(x, m, K, **args), layer.mlp(x)
    assert (got - want).abs().max() < TOL


# --- the cache's bytes per token ---------------------------------------------------------------

def test_cache_bytes_per_token_v3_against_llama_405b():
    """DeepSeek-V3 (671B parameters, 37B active) caches (512 + 64) numbers per position and
    layer, 61 layers; Llama-3.1-405B, a dense GQA model of the same order, caches K and V of
    8 heads of 128, 126 layers: 7.3 times as many bytes. Without its latent, DeepSeek-V3's
    128 heads would cache K and V of 128 x (192 + 128) numbers per layer: 71 times as many."""
    from llmtrace_book.config import Config
    from llmtrace_book.cost import parameter_count

    v3 = DeepseekV3Config()  # its defaults are DeepSeek-V3's published config
    ours = SimpleNamespace(n_layers=v3.num_hidden_layers, kv_lora_rank=v3.kv_lora_rank,
                           qk_rope_head_dim=v3.qk_rope_head_dim)
    llama = LlamaConfig(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                        num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
                        max_position_embeddings=131072, rope_theta=500000.0)
    gqa = Config.from_hf(llama.to_dict(), name="llama-3.1-405b")
    assert 405e9 < parameter_count(gqa) < 406e9  # Meta's 405B, from the config alone
    bf16 = 2
    mla_bytes = cache_bytes_per_token(ours, bf16)
    gqa_bytes = cache_bytes_per_token(gqa, bf16)
    assert mla_bytes == (512 + 64) * 61 * 2 == 70_272
    assert gqa_bytes == 2 * 8 * 128 * 126 * 2 == 516_096
    assert round(gqa_bytes / mla_bytes, 1) == 7.3
    per_head = v3.qk_nope_head_dim + v3.qk_rope_head_dim + v3.v_head_dim  # k and v widths
    full = v3.num_hidden_layers * v3.num_attention_heads * per_head * bf16
    assert (per_head, full) == (192 + 128, 4_997_120)
    assert round(full / mla_bytes) == 71
    # a LatentCache holds what the function says, per position and layer
    cache = LatentCache(10, 512, 64, device="meta", dtype=torch.bfloat16)
    assert cache.nbytes() * 61 / 10 == mla_bytes


# --- the appendix's toy ----------------------------------------------------------------------

def toy_compress(x, W_down):
    """Each token's vector x [T, d_model] squeezed into a latent of rank 2: c = x W_down^T."""
    return x @ W_down.T  # [T, 2]


def toy_expand(c, W_uk, W_uv):
    """Keys and values rebuilt from the latents alone: K = c W_uk^T, V = c W_uv^T."""
    return c @ W_uk.T, c @ W_uv.T  # [T, d_k], [T, d_v]


def test_toy_latent_rank_2_rebuilds_k_and_v_of_4_tokens():
    """4 tokens, a latent of rank 2: the cache holds 4 x 2 numbers where K and V take
    4 x (3 + 3); the 4 keys span a plane only. mla.py computes the same latents and the same
    keys and values from them."""
    g = torch.Generator().manual_seed(0)
    dm, dk, dv, r, dr = 5, 3, 3, 2, 2
    w = MlaWeights(kv_a=torch.randn(r + dr, dm, generator=g), kv_a_norm=torch.ones(r),
                   kv_b=torch.randn(dk + dv, r, generator=g),
                   o_proj=torch.randn(dm, dv, generator=g),
                   q_proj=torch.randn(dk + dr, dm, generator=g))
    d = MlaDims(1, r, dk, dr, dv)
    x = torch.randn(1, 4, dm, generator=g)
    tr = Trace()
    pos = Positions(0, *rope_cos_sin(torch.arange(4), dr, 10000.0), causal_mask(4, 4, 0))
    _attention(d, hidden=dm)(x, _layer(w), pos, trace=tr)
    W_down, W_uk, W_uv = w.kv_a[:r], w.kv_b[:dk], w.kv_b[dk:]
    c = toy_compress(x[0], W_down)  # [4, 2]
    torch.testing.assert_close(c, tr["attn.latent"][0])
    K, V = toy_expand(tr["attn.latent_norm"][0], W_uk, W_uv)  # from mla's normed latent
    torch.testing.assert_close(K, tr["attn.k"][0, :, 0, :dk])
    torch.testing.assert_close(V, tr["attn.v"][0, :, 0])
    assert torch.linalg.matrix_rank(K) == 2 and torch.linalg.matrix_rank(V) == 2
    assert c.numel() == 8 and K.numel() + V.numel() == 24


def test_deepseek_v3_layers_on_meta():
    """DeepSeek-V3 at full size, one MLA layer and one MoE layer on meta (no memory): their
    records' shapes, and the parameters of 61 such attention layers, 3 dense MLPs, 58 MoE
    layers, the embedding and the LM head: DeepSeek's published 671B total and 37B active."""
    c = DeepseekV3Config()
    D, Hf, Rf, Rqf = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.q_lora_rank
    dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    E_, F_, k = c.n_routed_experts, c.moe_intermediate_size, c.num_experts_per_tok
    Fs = F_ * c.n_shared_experts

    def empty(*shape):
        return torch.empty(*shape, device="meta")

    w = MlaWeights(kv_a=empty(Rf + dr, D), kv_a_norm=empty(Rf), kv_b=empty(Hf * (dn + dv), Rf),
                   o_proj=empty(D, Hf * dv), q_a=empty(Rqf, D), q_a_norm=empty(Rqf),
                   q_b=empty(Hf * (dn + dr), Rqf))
    m = MoeWeights(router=empty(E_, D), gate=empty(E_, F_, D), up=empty(E_, F_, D),
                   down=empty(E_, D, F_), score_bias=empty(E_),
                   shared=MlpWeights(empty(Fs, D), empty(Fs, D), empty(D, Fs)))
    d = MlaDims(Hf, Rf, dn, dr, dv, Rqf)
    T = 6
    pos = Positions(0, *rope_cos_sin(torch.arange(T, device="meta"), dr, 10000.0),
                    causal_mask(T, T, 0, "meta"))
    tr, x = Trace(), empty(1, T, D)
    _attention(d, hidden=D)(x, _layer(w), pos, LatentCache(T, Rf, dr, device="meta"), tr,
                            "layers.3.attn")
    moe_mlp(x, m, k, router="sigmoid_group", n_group=c.n_group, topk_group=c.topk_group,
            scaling=c.routed_scaling_factor, trace=tr, name="layers.3.mlp")
    assert tr.shape("layers.3.attn.kv_cache.latent") == (1, T, 512)
    assert tr.shape("layers.3.attn.kv_cache.k_rope") == (1, T, 64)
    assert tr.shape("layers.3.attn.k") == (1, T, 128, 192)
    assert tr.shape("layers.3.attn.v") == (1, T, 128, 128)
    assert tr.shape("layers.3.mlp.group_scores") == (1, T, 8)
    assert tr.shape("layers.3.mlp.expert_out") == (1, T, 8, D)
    attn = mla_params(w)
    moe_total, moe_active = moe_params(m, k)
    L, dense = c.num_hidden_layers, c.first_k_dense_replace
    rest = 2 * c.vocab_size * D + D + L * (attn + 2 * D) + dense * 3 * D * c.intermediate_size
    total = rest + (L - dense) * moe_total
    active = rest + (L - dense) * moe_active
    assert 670.5e9 < total < 671.5e9 and 37.0e9 < active < 38.0e9, (total, active)
