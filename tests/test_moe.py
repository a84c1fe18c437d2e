"""The mixture-of-experts layer against HF transformers' own blocks (MixtralSparseMoeBlock,
Qwen3MoeSparseMoeBlock, GptOssMLP) on tiny random weights, with a negative control for each
router and activation detail; its records on meta; its cost; the names on disk."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import (GptOssConfig, GptOssForCausalLM, MixtralConfig, MixtralForCausalLM,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from llmtrace_book.mechanisms import moe
from llmtrace_book.config import Config
from llmtrace_book.errors import LlmTraceError
from llmtrace_book.mechanisms.moe import MoeWeights, moe_mlp, moe_params
from llmtrace_book.model import Model
from llmtrace_book.parts import LayerWeights
from llmtrace_book.trace import Patched, Trace

TOL = 1e-5
D, FF, E, K = 48, 40, 8, 2
B, T = 2, 7


def toy_moe(x, W_router, experts, k=2):
    """A router choosing k of len(experts) experts per token, in plain PyTorch (Mixtral's
    rule). x [T, D]; each expert a function [D] -> [D]."""
    probs = torch.softmax(x @ W_router.T, dim=-1)  # [T, E]: how much each expert fits
    top, ids = probs.topk(k, dim=-1)  # [T, k]: the k best experts per token
    top = top / top.sum(dim=-1, keepdim=True)  # their weights, summing to 1
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            out[t] += top[t, j] * experts[ids[t, j]](x[t])
    return out


def _config(kind, impl, norm_topk_prob=True):
    common = dict(hidden_size=D, num_experts_per_tok=K, hidden_act="silu")
    if kind == "mixtral":
        c = MixtralConfig(intermediate_size=FF, num_local_experts=E, **common)
    elif kind == "qwen3_moe":
        c = Qwen3MoeConfig(moe_intermediate_size=FF, num_experts=E,
                           norm_topk_prob=norm_topk_prob, **common)
    else:
        c = GptOssConfig(intermediate_size=FF, num_local_experts=E, **common)
    c._experts_implementation = impl
    return c


BLOCKS = {"mixtral": MixtralSparseMoeBlock, "qwen3_moe": Qwen3MoeSparseMoeBlock,
          "gpt_oss": GptOssMLP}


def _hf_block(kind, impl="eager", norm_topk_prob=True, seed=0):
    """HF's block with seeded random weights: the router's logits spread wide (std ~7) so
    that tokens go to different experts; gpt-oss's experts scaled so that the clamp bites."""
    torch.manual_seed(seed)
    block = BLOCKS[kind](_config(kind, impl, norm_topk_prob)).eval()
    for n, p in block.named_parameters():
        std = 1.0 if ("gate" in n and "gate_up" not in n) or "router" in n else 0.3
        if kind == "gpt_oss" and "gate_up" in n:
            std = 1.0  # gate and up (std ~7) often pass the limit of 7
        if kind == "gpt_oss" and "down" in n:
            std = 0.05  # outputs of order 10, as the other two blocks'

        torch.nn.init.normal_(p, std=std)
    return block


def _weights(kind, block) -> MoeWeights:
    """Our layout from HF's in-memory parameters (fused, 3-D)."""
    if kind == "gpt_oss":
        ex, r = block.experts, block.router
        return MoeWeights(router=r.weight, router_bias=r.bias,
                          gate=ex.gate_up_proj[..., ::2].transpose(1, 2),  # [E, F, D]
                          up=ex.gate_up_proj[..., 1::2].transpose(1, 2),
                          down=ex.down_proj.transpose(1, 2),  # [E, D, F]
                          gate_bias=ex.gate_up_proj_bias[:, ::2],
                          up_bias=ex.gate_up_proj_bias[:, 1::2], down_bias=ex.down_proj_bias)
    gate_up = block.experts.gate_up_proj  # [E, 2F, D]: gate rows, then up rows
    return MoeWeights(router=block.gate.weight, gate=gate_up[:, :FF], up=gate_up[:, FF:],
                      down=block.experts.down_proj)


ARGS = {"mixtral": dict(router="softmax_topk", renormalize=True, act="silu"),
        "qwen3_moe": dict(router="softmax_topk", act="silu"),
        "gpt_oss": dict(router="topk_softmax", renormalize=False, act="gpt_oss")}


def _args(kind, norm_topk_prob=True):
    a = dict(ARGS[kind])
    if kind == "qwen3_moe":
        a["renormalize"] = norm_topk_prob  # the config's value, as written
    return a


def _x(seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def _hf_out(block, x):
    with torch.no_grad():
        out = block(x)
    return out[0] if isinstance(out, tuple) else out  # GptOssMLP also returns its scores


CASES = [("mixtral", True), ("qwen3_moe", True), ("qwen3_moe", False), ("gpt_oss", True)]


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("kind,norm", CASES)
def test_matches_hf_block(kind, norm, impl):
    block, x = _hf_block(kind, impl, norm), _x()
    want = _hf_out(block, x)
    tr = Trace()
    with torch.no_grad():
        got = moe_mlp(x, _weights(kind, block), K, **_args(kind, norm), trace=tr,
                      name="layers.3.mlp")
    err = (got - want).abs().max().item()
    assert err < TOL, f"{kind}: max |ours - HF| = {err:.2e}"
    chosen = tr["layers.3.mlp.experts_chosen"]
    assert chosen.shape == (B, T, K) and chosen.dtype == torch.int64
    assert len(chosen.unique()) >= 2  # tokens go to different experts
    # and the router agrees with HF's on which experts and how much
    flat = x.reshape(-1, D)
    router = block.router if kind == "gpt_oss" else block.gate
    with torch.no_grad():
        _, hf_weights, hf_ids = router(flat)
    assert torch.equal(chosen.reshape(-1, K), hf_ids)
    torch.testing.assert_close(tr["layers.3.mlp.expert_weights"].reshape(-1, K), hf_weights,
                               rtol=0, atol=1e-6)


def _moved(kind, norm, change, glu=None, monkeypatch=None):
    """max |output - output with one detail changed|, on the weights of the parity test."""
    block, x = _hf_block(kind, "eager", norm), _x()
    w = _weights(kind, block)
    args = _args(kind, norm)
    with torch.no_grad():
        base = moe_mlp(x, w, K, **args)
        assert (base - _hf_out(block, x)).abs().max() < TOL
        change = dict(change)
        if "router_bias" in change:
            w = MoeWeights(**{**w.__dict__, "router_bias": change.pop("router_bias")})
        if glu is not None:
            monkeypatch.setattr(moe, "gpt_oss_glu", glu)
        other = moe_mlp(x, w, K, **{**args, **change})
    return (other - base).abs().max().item()


def _glu_without_plus_one(gate, up, limit=7.0, alpha=1.702):
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return up * gate * torch.sigmoid(gate * alpha)


def _glu_without_alpha(gate, up, limit=7.0, alpha=1.702):
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate)


@pytest.mark.parametrize("kind,norm,change,patch_glu", [
    ("mixtral", True, dict(renormalize=False), None),
    ("qwen3_moe", True, dict(renormalize=False), None),  # norm_topk_prob flipped
    ("qwen3_moe", False, dict(renormalize=True), None),
    ("gpt_oss", True, dict(limit=float("inf")), None),  # no clamp
    ("gpt_oss", True, dict(), _glu_without_plus_one),
    ("gpt_oss", True, dict(), _glu_without_alpha),
    ("gpt_oss", True, dict(router_bias=None), None),
    ("gpt_oss", True, dict(router="softmax_topk", renormalize=False), None),
    ("gpt_oss", True, dict(act="silu"), None),  # plain SwiGLU on gpt-oss's weights
])
def test_each_detail_matters(kind, norm, change, patch_glu, monkeypatch):
    moved = _moved(kind, norm, change, patch_glu, monkeypatch)
    assert moved > 100 * TOL, f"{kind} with {change or patch_glu.__name__}: moved {moved:.1e}"


def test_gpt_oss_router_is_mixtral_rule_in_another_order():
    """top-k then softmax over the k = softmax over all E, top-k, renormalized."""
    block, x = _hf_block("gpt_oss"), _x()
    w = _weights("gpt_oss", block)
    with torch.no_grad():
        a = moe_mlp(x, w, K, router="topk_softmax", act="gpt_oss")
        b = moe_mlp(x, w, K, router="softmax_topk", renormalize=True, act="gpt_oss")
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def _trace(kind, device):
    block = _hf_block(kind)
    w = _weights(kind, block)
    x = _x()
    if device == "meta":
        w = MoeWeights(**{k: None if v is None else torch.empty_like(v, device="meta")
                          for k, v in w.__dict__.items()})
        x = x.to("meta")
    tr = Trace()
    with torch.no_grad():
        out = moe_mlp(x, w, K, **_args(kind), trace=tr, name="layers.3.mlp")
    return tr, out


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_meta_records_match_real(kind):
    real, out = _trace(kind, "cpu")
    meta, out_meta = _trace(kind, "meta")
    rows = [(r.name, r.shape, r.dtype, r.macs) for r in real]
    assert rows == [(r.name, r.shape, r.dtype, r.macs) for r in meta]
    assert out_meta.shape == out.shape == (B, T, D)
    want = ["router", "router_probs", "experts_chosen", "expert_weights", "expert_out", "out"]
    if kind == "gpt_oss":  # no softmax over all E experts
        want.remove("router_probs")
    assert [r.name for r in real] == [f"layers.3.mlp.{n}" for n in want]
    shapes = {r.name.split(".")[-1]: r.shape for r in real}
    assert shapes["router"] == (B, T, E) and shapes["expert_out"] == (B, T, K, D)
    assert shapes["experts_chosen"] == shapes["expert_weights"] == (B, T, K)


def test_expert_out_holds_each_chosen_experts_output():
    """Slot j of position t is expert experts_chosen[t, j] run on x[t], alone."""
    block, x = _hf_block("mixtral"), _x()
    w = _weights("mixtral", block)
    tr = Trace()
    with torch.no_grad():
        moe_mlp(x, w, K, trace=tr)
        for b, t, j in [(0, 0, 0), (0, 6, 1), (1, 3, 0), (1, 5, 1)]:
            e = int(tr["mlp.experts_chosen"][b, t, j])
            one = moe.expert_mlp(x[b, t][None], w, e)[0]  # [D]
            torch.testing.assert_close(tr["mlp.expert_out"][b, t, j], one)


@pytest.mark.parametrize("kind", ["mixtral", "gpt_oss"])
def test_macs_count_active_experts_only(kind):
    tr, _ = _trace(kind, "meta")
    N = B * T
    router = N * D * E
    experts = N * K * 3 * D * FF  # k experts, 3 matrices of D x F each, per position
    combine = N * K * D  # the weighted sum
    assert tr.total_macs == router + experts + combine
    assert tr.get("layers.3.mlp.expert_out").macs == experts


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_params_total_and_active(kind):
    block = _hf_block(kind)
    total, active = moe_params(_weights(kind, block), K)
    assert total == sum(p.numel() for p in block.parameters())  # HF's own count
    bias = kind == "gpt_oss"
    per_expert = 3 * D * FF + (2 * FF + D if bias else 0)
    router = E * D + (E if bias else 0)
    assert (total, active) == (router + E * per_expert, router + K * per_expert)


def test_toy_router_matches_moe_mlp():
    """3 tokens, 4 experts, 2 chosen per token."""
    g = torch.Generator().manual_seed(0)
    d, f, n = 6, 5, 4
    w = MoeWeights(router=torch.randn(n, d, generator=g) * 2,
                   gate=torch.randn(n, f, d, generator=g), up=torch.randn(n, f, d, generator=g),
                   down=torch.randn(n, d, f, generator=g))
    x = torch.randn(1, 3, d, generator=g)
    experts = [lambda v, e=e: w.down[e] @ (torch.nn.functional.silu(w.gate[e] @ v)
                                           * (w.up[e] @ v)) for e in range(n)]
    tr = Trace()
    got = moe_mlp(x, w, 2, trace=tr)
    torch.testing.assert_close(got[0], toy_moe(x[0], w.router, experts), rtol=0, atol=1e-5)
    assert len(tr["mlp.experts_chosen"].unique()) >= 2


def _saved(kind, tmp_path):
    """A one-layer model saved by save_pretrained: the safetensors hold what a checkpoint on
    disk holds."""
    common = dict(vocab_size=64, hidden_size=D, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_experts_per_tok=K)
    torch.manual_seed(0)
    if kind == "mixtral":
        m = MixtralForCausalLM(MixtralConfig(intermediate_size=FF, num_local_experts=E,
                                             **common))
    elif kind == "qwen3_moe":
        m = Qwen3MoeForCausalLM(Qwen3MoeConfig(moe_intermediate_size=FF, num_experts=E,
                                               norm_topk_prob=True, **common))
    else:
        m = GptOssForCausalLM(GptOssConfig(intermediate_size=FF, num_local_experts=E,
                                           **common))
    for n, p in m.named_parameters():
        if ".mlp." in n:
            torch.nn.init.normal_(p, std=1.0 if ("gate." in n or "router" in n) else 0.3)
    m.save_pretrained(tmp_path)
    return m, load_file(tmp_path / "model.safetensors")


ON_DISK = {  # what save_pretrained writes for layer 0's MoE, expert 0 shown
    "mixtral": {"model.layers.0.block_sparse_moe.gate.weight": (E, D),
                "model.layers.0.block_sparse_moe.experts.0.w1.weight": (FF, D),
                "model.layers.0.block_sparse_moe.experts.0.w3.weight": (FF, D),
                "model.layers.0.block_sparse_moe.experts.0.w2.weight": (D, FF)},
    "qwen3_moe": {"model.layers.0.mlp.gate.weight": (E, D),
                  "model.layers.0.mlp.experts.0.gate_proj.weight": (FF, D),
                  "model.layers.0.mlp.experts.0.up_proj.weight": (FF, D),
                  "model.layers.0.mlp.experts.0.down_proj.weight": (D, FF)},
    "gpt_oss": {"model.layers.0.mlp.router.weight": (E, D),
                "model.layers.0.mlp.router.bias": (E,),
                "model.layers.0.mlp.experts.gate_up_proj": (E, D, 2 * FF),
                "model.layers.0.mlp.experts.gate_up_proj_bias": (E, 2 * FF),
                "model.layers.0.mlp.experts.down_proj": (E, FF, D),
                "model.layers.0.mlp.experts.down_proj_bias": (E, D)},
}


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_weights_from_names_on_disk(kind, tmp_path):
    model, sd = _saved(kind, tmp_path)
    for name, shape in ON_DISK[kind].items():
        assert tuple(sd[name].shape) == shape, name
    moe_names = {n for n in sd if ".mlp." in n or "block_sparse_moe" in n}
    # per expert 3 matrices and the router (Mixtral, Qwen3-MoE), or 6 fused tensors (gpt-oss)
    assert len(moe_names) == (6 if kind == "gpt_oss" else 3 * E + 1), sorted(moe_names)
    w = _moe_part(tmp_path).load(sd.__getitem__, "model.layers.0")["moe"]
    x = _x()
    with torch.no_grad():
        want = _hf_out(model.model.layers[0].mlp, x)
        got = moe_mlp(x, w, K, **_args(kind))
    assert (got - want).abs().max() < TOL


def _moe_part(directory):
    """Layer 0's mixture of experts, as the family's model builds it from the saved config."""
    return Model(Config.from_hf(directory)).blocks[0].mlp


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_weights_saved_as_on_disk(kind, tmp_path):
    """The part writes back the tensors it read, under the same names, bit for bit."""
    _, sd = _saved(kind, tmp_path)
    part = _moe_part(tmp_path)
    back = part.save(LayerWeights(**part.load(sd.__getitem__, "model.layers.0")),
                     "model.layers.0")
    assert set(back) == {n for n in sd if ".mlp." in n or "block_sparse_moe" in n}
    assert all(torch.equal(back[n], sd[n]) for n in back)
    assert {n: tuple(t.shape) for n, t in back.items()} == {
        f"model.layers.0.{n}": s for n, s in part.on_disk().items()}


def test_bad_arguments_refused():
    w = _weights("mixtral", _hf_block("mixtral"))
    x = _x()
    with pytest.raises(LlmTraceError, match="router must be one of softmax_topk, topk_softmax"):
        moe_mlp(x, w, K, router="sigmoid")
    with pytest.raises(LlmTraceError, match="act must be one of silu, gpt_oss"):
        moe_mlp(x, w, K, act="gelu")
    with pytest.raises(LlmTraceError,
                       match=r"k \(experts per position\) must be a whole number in 1 .. 8"):
        moe_mlp(x, w, 9)


def test_patched_experts_chosen_flows_on():
    """A patch of the chosen experts routes the layer: every position to experts 0 and 1,
    with the weights the router gave its own choice."""
    block, x = _hf_block("mixtral"), _x()
    w = _weights("mixtral", block)
    forced = torch.tensor([0, 1]).expand(B, T, K)
    tr = Trace()
    with torch.no_grad():
        moe_mlp(x, w, K, trace=Patched({"mlp.experts_chosen": lambda t: forced.clone()}, tr))
        out = tr["mlp.expert_out"]
        for j in range(K):
            torch.testing.assert_close(out[:, :, j], moe.expert_mlp(x.reshape(-1, D), w, j)
                                       .reshape(B, T, D))
    with pytest.raises(LlmTraceError, match=r"expert ids must lie in 0 .. 7 \(this layer has 8"):
        moe_mlp(x, w, K, trace=Patched({"mlp.experts_chosen": lambda t: t + E}))


def test_mixtral_8x7b_layer_on_meta():
    """A full-size layer (D 4096, F 14336, 8 experts, 2 chosen) traces on meta, no memory:
    its 32 layers' experts and routers hold 45.1e9 of the published 46.7e9 parameters, and a
    position reads 11.3e9 of its 12.9e9 active ones (attention and embeddings the rest)."""
    d, f, e = 4096, 14336, 8
    meta = dict(device="meta")
    w = MoeWeights(router=torch.empty(e, d, **meta), gate=torch.empty(e, f, d, **meta),
                   up=torch.empty(e, f, d, **meta), down=torch.empty(e, d, f, **meta))
    tr = Trace()
    out = moe_mlp(torch.empty(1, 6, d, **meta), w, 2, trace=tr, name="layers.0.mlp")
    assert out.shape == (1, 6, d) and tr.shape("layers.0.mlp.expert_out") == (1, 6, 2, d)
    assert tr.get("layers.0.mlp.expert_out").macs == 6 * 2 * 3 * d * f
    total, active = moe_params(w, 2)
    assert (total, active) == (e * d + e * 3 * d * f, e * d + 2 * 3 * d * f)
    assert 45.0e9 < 32 * total < 46.7e9 and 11.2e9 < 32 * active < 12.9e9


def test_each_router_name_is_a_class():
    """The config's moe_router names (config_checks.ROUTERS) are the router classes', one each,
    and a layer's part holds the rule its config names."""
    from llmtrace_book.config_checks import ROUTERS
    from llmtrace_book.mechanisms.moe import ROUTERS_BY_NAME, SigmoidGroup, TopKSoftmax

    assert sorted(ROUTERS_BY_NAME) == sorted(ROUTERS)
    assert len(set(ROUTERS_BY_NAME.values())) == len(ROUTERS)
    parts = {name: Model(Config.from_name(name)).blocks[-1].mlp.router
             for name in ("gpt-oss-20b", "deepseek-v3")}
    assert isinstance(parts["gpt-oss-20b"], TopKSoftmax)
    assert isinstance(parts["deepseek-v3"], SigmoidGroup) and parts["deepseek-v3"].n_group == 8
