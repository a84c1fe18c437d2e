"""Qwen3-Next's layers against HF transformers' own classes on tiny random weights: the Gated
DeltaNet layer (mechanisms/deltanet.py) against Qwen3NextGatedDeltaNet and its torch fallbacks,
prefill in chunks then decode token by token; the chunked and recurrent forms against each other;
the state that does not grow; a negative control for each piece; the full-attention layer's
output gate and partial RoPE (deltanet.GatedAttention, deltanet.partial_rope, as the Qwen3-Next
model builds them) against Qwen3NextAttention; Qwen3.5's text layers; the names on disk; and the
appendix's toy delta rule."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5GatedDeltaNet,
                                                          Qwen3_5TextRotaryEmbedding)
from transformers.models.qwen3_next import modeling_qwen3_next as hf
from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextAttention,
                                                                Qwen3NextGatedDeltaNet,
                                                                Qwen3NextRotaryEmbedding,
                                                                Qwen3NextSparseMoeBlock)

from llmtrace_book.attention import Attention, causal_mask
from llmtrace_book.config import Config
from llmtrace_book.errors import LlmTraceError
from llmtrace_book.kv_cache import KVCache, bytes_per_token
from llmtrace_book.mechanisms import deltanet
from llmtrace_book.mechanisms.deltanet import (DeltaNetDims, DeltaNetState, DeltaNetWeights,
                                          GatedAttention, chunked_delta_rule, delta_rule_step,
                                          gated_deltanet, hf_deltanet_weights, partial_rope,
                                          recurrent_delta_rule, state_bytes)
from llmtrace_book.mechanisms.moe import MoeWeights, moe_mlp
from llmtrace_book.mlp import swiglu
from llmtrace_book.model import Model
from llmtrace_book.rope import apply_rope, rope_cos_sin
from llmtrace_book.trace import Patched, Trace

TOL = 1e-5
B, D, PROMPT, STEPS, CHUNK = 2, 64, 9, 3, 4
HK, HV, DK, DV, KERNEL = 2, 4, 16, 16, 4
H, KV, HD = 4, 2, 16  # the full-attention layer


def toy_delta_rule(q, k, v, beta, fade):
    """A state S [dk, dv] absorbing one token at a time, in plain PyTorch. q, k [T, dk],
    v [T, dv], beta and fade [T] (fade = exp(g), between 0 and 1)."""
    S = torch.zeros(k.shape[1], v.shape[1])
    out = []
    for t in range(len(k)):
        S = fade[t] * S  # forget a little of everything
        error = v[t] - S.T @ k[t]  # what S recalls for k_t, against v_t
        S = S + beta[t] * torch.outer(k[t], error)  # write the correction along k_t
        out.append(S.T @ q[t])  # read with the query
    return torch.stack(out)  # [T, dv]


def hf_config(**extra):
    return Qwen3NextConfig(
        hidden_size=D, linear_num_key_heads=HK, linear_num_value_heads=HV,
        linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=KERNEL,
        num_hidden_layers=4, num_attention_heads=H, num_key_value_heads=KV, head_dim=HD,
        vocab_size=128, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, shared_expert_intermediate_size=48,
        attn_implementation="eager", **extra)


DIMS = DeltaNetDims(HK, HV, DK, DV, KERNEL, 1e-6)


def randomize(module, seed):
    """Seeded weights of the size a trained layer has: decay rates exp(A_log) in 0.4 .. 2.7,
    gains around 1 (the (1 + w) norms around 0)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for n, p in module.named_parameters():
            if n.endswith("A_log"):
                p.uniform_(-1, 1)
            elif n.endswith("dt_bias"):
                p.normal_(0, 1)
            elif n == "norm.weight":  # the gated RMSNorm: a plain gain
                p.normal_(1, 0.3)
            elif "norm" in n:  # Qwen3NextRMSNorm: (1 + weight)
                p.normal_(0, 0.3)
            else:
                p.normal_(0, 0.15)
    return module.eval()


@pytest.fixture(scope="module")
def hf_layer():
    return randomize(Qwen3NextGatedDeltaNet(hf_config(), 0), 0)


def ours(layer):
    sd = {f"model.layers.0.linear_attn.{k}": v for k, v in layer.state_dict().items()}
    return hf_deltanet_weights(sd.__getitem__, "model.layers.0", DIMS)


def inputs(T=PROMPT + STEPS, seed=1):
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


def hf_run(layer, x, monkeypatch=None):
    """HF's layer through its DynamicCache: the prompt in chunks of CHUNK, then one token at a
    time. Returns (outputs [B, T, D], the cache, the chunk sizes its chunked rule ran)."""
    cache, sizes = DynamicCache(config=hf_config()), []
    chunked = hf.torch_chunk_gated_delta_rule
    if monkeypatch is not None:  # see which form HF runs, and with which chunk
        def spy(*a, chunk_size=64, **kw):
            sizes.append(chunk_size)
            return chunked(*a, chunk_size=chunk_size, **kw)
        monkeypatch.setattr(hf, "torch_chunk_gated_delta_rule", spy)
    with torch.no_grad():
        outs = [layer(x[:, :PROMPT], cache=cache, chunk_size=CHUNK)]
        outs += [layer(x[:, t:t + 1], cache=cache) for t in range(PROMPT, x.shape[1])]
    return torch.cat(outs, 1), cache, sizes


def our_run(w, x, patch=None):
    """Ours with a DeltaNetState: the prompt chunked, then recurrent steps. Returns (outputs,
    state, the traces of every pass)."""
    state, traces, outs = DeltaNetState(DIMS, B), [], []
    with torch.no_grad():
        for part in [x[:, :PROMPT]] + [x[:, t:t + 1] for t in range(PROMPT, x.shape[1])]:
            tr = Trace()
            run = Patched(patch, tr) if patch else tr
            outs.append(gated_deltanet(part, w, DIMS, state, run, "layers.0.attn",
                                       chunk=CHUNK))
            traces.append(tr)
    return torch.cat(outs, 1), state, traces


def test_prefill_then_decode_matches_hf(hf_layer, monkeypatch):
    x = inputs()
    want, cache, sizes = hf_run(hf_layer, x, monkeypatch)
    assert sizes == [CHUNK], "HF's prefill ran its chunked torch fallback, chunks of 4"
    got, state, traces = our_run(ours(hf_layer), x)
    for t in range(x.shape[1]):  # the prompt's positions, then each decode step
        err = (got[:, t] - want[:, t]).abs().max().item()
        assert err < TOL, f"position {t}: max |ours - HF| = {err:.2e}"
    assert want.abs().max() > 0.5  # outputs of the size a layer gives
    assert (state.recurrent - cache.layers[0].recurrent_states[0]).abs().max() < TOL
    # HF keeps the last K conv inputs, the convolution reads K-1 of them
    assert (state.conv - cache.layers[0].conv_states[0][..., 1:]).abs().max() < 1e-6
    assert "in chunks of 4" in traces[0].get("layers.0.attn.core").op
    assert "token by token" in traces[1].get("layers.0.attn.core").op


def test_the_rule_matches_hfs_torch_fallbacks():
    """chunked_delta_rule and recurrent_delta_rule against HF's functions themselves, on
    prompts that do and do not fill their last chunk, from a state already written."""
    g = torch.Generator().manual_seed(2)
    T = 11
    q, k = (F.normalize(torch.randn(B, T, HV, DK, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(B, T, HV, DV, generator=g)
    decay, beta = -torch.rand(B, T, HV, generator=g), torch.rand(B, T, HV, generator=g)
    S0 = torch.randn(B, HV, DK, DV, generator=g)
    args = dict(initial_state=S0, output_final_state=True)
    ref_rec, ref_S = hf.torch_recurrent_gated_delta_rule(q, k, v, decay, beta, **args)
    heads = [t.transpose(1, 2) for t in (q / math.sqrt(DK), k, v, decay, beta)]
    out, S = recurrent_delta_rule(*heads, S0)
    assert (out.transpose(1, 2) - ref_rec).abs().max() < TOL
    assert (S - ref_S).abs().max() < TOL
    for chunk in (3, 4, 11, 64):
        ref, ref_S = hf.torch_chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=chunk,
                                                     **args)
        out, S = chunked_delta_rule(*heads, S0, chunk)
        assert (out.transpose(1, 2) - ref).abs().max() < TOL, chunk
        assert (S - ref_S).abs().max() < TOL, chunk


@pytest.mark.parametrize("chunk", [1, 4, 5, 64])
def test_chunked_equals_recurrent_on_the_same_tokens(hf_layer, chunk):
    x, w = inputs(), ours(hf_layer)
    a, b = Trace(), Trace()
    with torch.no_grad():
        rec = gated_deltanet(x, w, DIMS, None, a, mode="recurrent")
        chk = gated_deltanet(x, w, DIMS, None, b, mode="chunked", chunk=chunk)
    assert (rec - chk).abs().max().item() < TOL
    assert (a["attn.state"] - b["attn.state"]).abs().max().item() < TOL
    assert a.names == b.names  # the same records, whichever form ran


def test_the_state_keeps_its_shape_over_the_steps(hf_layer):
    """Records of the prompt and of each decode step: the recurrent state and the conv's
    inputs keep one shape, where a KV cache gains a position per token."""
    _, state, traces = our_run(ours(hf_layer), inputs())
    shapes = {tr.shape("layers.0.attn.state") for tr in traces}
    assert shapes == {(B, HV, DK, DV)}
    assert {tr.shape("layers.0.attn.conv_state") for tr in traces} == {
        (B, DIMS.conv_dim, KERNEL - 1)}
    assert [tr.shape("layers.0.attn.core")[1] for tr in traces] == [PROMPT] + [1] * STEPS
    assert state.nbytes() == state_bytes(DIMS, B) == B * 4 * (
        DIMS.conv_dim * (KERNEL - 1) + HV * DK * DV)
    kv = KVCache(PROMPT + STEPS, KV, HD, B)
    assert kv.nbytes() == (PROMPT + STEPS) * bytes_per_token(KV, HD, B)


CONTROLS = {  # name -> a patch of one piece, or new weights
    "no decay (g = 0)": {"layers.0.attn.g": torch.zeros_like},
    "beta = 1": {"layers.0.attn.beta": torch.ones_like},
    "no conv (kernel: the current position only)": "conv",
    "no z gate": "z",
}


@pytest.mark.parametrize("control", CONTROLS)
def test_each_piece_matters(hf_layer, control):
    x, w = inputs(), ours(hf_layer)
    want, _, _ = hf_run(hf_layer, x)
    patch = CONTROLS[control]
    if patch == "conv":
        only_now = torch.zeros_like(w.conv)
        only_now[:, -1] = 1
        w, patch = DeltaNetWeights(**{**w.__dict__, "conv": only_now}), None
    if patch == "z":
        holder = {}

        def patch_fn(t, name):  # the norm's output, not times silu(z)
            return holder["tr"]["layers.0.attn.core_norm"]
        state, outs = DeltaNetState(DIMS, B), []
        with torch.no_grad():
            for part in [x[:, :PROMPT]] + [x[:, t:t + 1] for t in range(PROMPT, x.shape[1])]:
                holder["tr"] = Trace()
                run = Patched({"layers.0.attn.gated_norm": patch_fn}, holder["tr"])
                outs.append(gated_deltanet(part, w, DIMS, state, run, "layers.0.attn",
                                           chunk=CHUNK))
        got = torch.cat(outs, 1)
    else:
        got, _, _ = our_run(w, x, patch)
    moved = (got - want).abs().max().item()
    assert moved > 100 * TOL, f"{control}: moved {moved:.1e}"


def test_records_on_meta_match_the_real_run(hf_layer):
    x, w = inputs(), ours(hf_layer)
    real, meta = Trace(), Trace(keep_values=False)
    with torch.no_grad():
        gated_deltanet(x, w, DIMS, DeltaNetState(DIMS, B), real, chunk=CHUNK)
        mw = DeltaNetWeights(**{k: v.to("meta") for k, v in w.__dict__.items()})
        out = gated_deltanet(x.to("meta"), mw, DIMS, DeltaNetState(DIMS, B, "meta"), meta,
                             chunk=CHUNK)
    assert out.shape == (B, PROMPT + STEPS, D) and out.device.type == "meta"
    assert [(r.name, r.shape, r.macs) for r in meta] == [(r.name, r.shape, r.macs)
                                                          for r in real]
    assert real.shape("attn.qkvz") == (B, 12, 2 * HK * DK + 2 * HV * DV)
    assert real.shape("attn.q") == (B, 12, HK, DK) and real.shape("attn.v") == (B, 12, HV, DV)
    assert real.shape("attn.g") == real.shape("attn.beta") == (B, 12, HV)
    # the rule's cost by hand: 3 chunks of 4 (k k^T, q k^T; the solve; (D q k^T) u; k S,
    # q S, k^T u), and one token's S^T k, k delta^T, S^T q
    per_chunk = 2 * 16 * DK + 6 * DV + 16 * DV + 3 * 4 * DK * DV
    assert real.get("attn.core").macs == B * HV * 3 * per_chunk
    step = Trace()
    with torch.no_grad():
        gated_deltanet(x[:, :1], w, DIMS, None, step)
    assert step.get("attn.core").macs == B * HV * 3 * DK * DV
    assert step.get("attn.qkvz").macs == B * D * (2 * HK * DK + 2 * HV * DV)


def test_bad_input_is_refused_by_name(hf_layer):
    with pytest.raises(LlmTraceError, match="mode must be one of chunked, recurrent"):
        gated_deltanet(inputs(), ours(hf_layer), DIMS, mode="parallel")
    with pytest.raises(LlmTraceError, match="chunk .* must be a whole number of 1 or more"):
        gated_deltanet(inputs(), ours(hf_layer), DIMS, chunk=0)
    with pytest.raises(LlmTraceError, match=r"linear_num_value_heads \(3\) must be a multiple"):
        DeltaNetDims(2, 3, 16, 16, 4).check()
    with pytest.raises(LlmTraceError, match="no Gated DeltaNet weight names for model_type"):
        hf_deltanet_weights({}.__getitem__, "model.layers.0", DIMS, "mamba")


# --- the toy of the appendix ---------------------------------------------------------------------

def test_toy_delta_rule_is_the_librarys_step():
    g = torch.Generator().manual_seed(3)
    q, k = (F.normalize(torch.randn(4, DK, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(4, DV, generator=g)
    beta, fade = torch.rand(4, generator=g), 0.5 + 0.5 * torch.rand(4, generator=g)
    S, outs = torch.zeros(1, 1, DK, DV), []
    for t in range(4):
        S, o = delta_rule_step(S, q[None, None, t], k[None, None, t], v[None, None, t],
                               fade[None, None, t].log(), beta[None, None, t])
        outs.append(o[0, 0])
    assert (toy_delta_rule(q, k, v, beta, fade) - torch.stack(outs)).abs().max() < 1e-6


def test_toy_state_recalls_four_tokens_where_attention_blends():
    """With 4 orthogonal keys, beta = 1 and no fade, the 4 x dv state recalls each token's
    value exactly from its key; softmax attention over the same 4 keys returns a blend."""
    g = torch.Generator().manual_seed(4)
    k = torch.linalg.qr(torch.randn(4, 4, generator=g))[0]  # [4, dk=4], orthonormal rows
    v = torch.randn(4, 3, generator=g)
    recalled = toy_delta_rule(k, k, v, torch.ones(4), torch.ones(4))  # query = key
    assert (recalled[-1] - v[-1]).abs().max() < 1e-5  # the last token sees its own value
    state_read = torch.stack([toy_delta_rule(k[[*range(4), j]], k[[*range(4), j]],
                                             v[[*range(4), j]], torch.ones(5),
                                             torch.ones(5))[-1] for j in range(4)])
    assert (state_read - v).abs().max() < 1e-5  # each key recalls its value again
    attended = torch.softmax(k @ k.T, dim=-1) @ v  # [4, 3]
    assert (attended - v).abs().max() > 0.1


# --- the full-attention layer --------------------------------------------------------------------

ROT = int(HD * 0.25)  # partial_rotary_factor 0.25: 4 of each head's 16 dims turn


def qwen3_next_config() -> Config:
    return Config("tiny-qwen3-next", vocab_size=128, hidden_size=D, n_layers=4, n_heads=H,
                  n_kv_heads=KV, ffn_size=96, max_positions=64, head_dim=HD, norm_eps=1e-6,
                  family="qwen3_next", qk_norm=True, norm_offset=True,
                  attn_output_gate=True, partial_rotary_factor=0.25)


def family_attention(config, layer=3):
    """Layer `layer`'s attention as the Qwen3-Next model builds it from the config
    (`families/qwen3_next.py`: `Qwen3Next.attention`)."""
    return Model.families["qwen3_next"].attention(SimpleNamespace(config=config), layer)


def family_positions(config, start, T):
    """The pass's positions as the Qwen3-Next model makes them (`Qwen3Next.positions`): RoPE's
    tables rotary_dim wide."""
    stub = SimpleNamespace(config=config, device=torch.device("cpu"))
    return Model.families["qwen3_next"].positions(stub, start, T)


@pytest.fixture(scope="module")
def hf_attention():
    return randomize(Qwen3NextAttention(hf_config(), 3), 5)


def attn_weights(layer):
    return SimpleNamespace(sinks=None, o_bias=None, **{n: getattr(layer, n).weight for n in (
        "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")})


def hf_attention_run(layer, x):
    cfg = hf_config()
    assert cfg.rope_parameters["partial_rotary_factor"] == 0.25
    rotary, cache, outs = Qwen3NextRotaryEmbedding(cfg), DynamicCache(config=cfg), []
    for start, T in [(0, PROMPT)] + [(t, 1) for t in range(PROMPT, PROMPT + STEPS)]:
        pid = torch.arange(start, start + T)[None]
        mask = causal_mask(T, start + T, start)[None, None]
        with torch.no_grad():
            outs.append(layer(x[:, start:start + T], rotary(x, pid), mask, cache)[0])
    return torch.cat(outs, 1)


def our_attention_run(w, x, rotary_dim=ROT, config=None, patch=None):
    config, cache, outs, traces = config or qwen3_next_config(), KVCache(16, KV, HD, B), [], []
    attn = family_attention(config)
    assert isinstance(attn, GatedAttention) and attn.rotary_dim == (
        rotary_dim if rotary_dim < HD else None)
    for start, T in [(0, PROMPT)] + [(t, 1) for t in range(PROMPT, PROMPT + STEPS)]:
        tr, pos = Trace(), family_positions(config, start, T)
        assert pos.cos.shape == (T, rotary_dim)  # [T, rotary_dim]: the tables of the turned dims
        with torch.no_grad():
            outs.append(attn(x[:, start:start + T], w, pos, cache,
                             Patched(patch, tr) if patch else tr))
        traces.append(tr)
    return torch.cat(outs, 1), traces


def test_gated_attention_with_partial_rope_matches_hf(hf_attention):
    x = inputs(seed=6)
    want = hf_attention_run(hf_attention, x)
    got, traces = our_attention_run(attn_weights(hf_attention), x)
    err = (got - want).abs().max().item()
    assert err < TOL, f"max |ours - HF| = {err:.2e}"
    tr = traces[0]
    assert tr.shape("attn.q_proj") == (B, PROMPT, 2 * H * HD)
    assert tr.shape("attn.gate") == (B, PROMPT, H, HD)
    assert tr.shape("attn.output_gate") == (B, H, PROMPT, HD)
    assert tr.get("attn.q_proj").macs == B * PROMPT * D * 2 * H * HD
    assert "first 4 dims" in tr.get("attn.rope_q").op and "other 12 unturned" in \
        tr.get("attn.rope_q").op
    # the unturned dims are the normed q's own
    assert torch.equal(tr["attn.rope_q"][..., ROT:], tr["attn.q_norm"][..., ROT:])


@pytest.mark.parametrize("control", ["no output gate", "RoPE on the whole head",
                                     "QK-norm without the 1 +"])
def test_each_attention_piece_matters(hf_attention, control):
    x, w = inputs(seed=6), attn_weights(hf_attention)
    want = hf_attention_run(hf_attention, x)
    if control == "no output gate":  # sigmoid(gate) = 1
        got, _ = our_attention_run(w, x, patch={"attn.gate": lambda t: torch.full_like(t, 50)})
    elif control == "RoPE on the whole head":
        got, _ = our_attention_run(w, x, rotary_dim=HD, config=qwen3_next_config().replace(
            partial_rotary_factor=1.0))
    else:
        got, _ = our_attention_run(w, x, config=qwen3_next_config().replace(norm_offset=False))
    moved = (got - want).abs().max().item()
    assert moved > 100 * TOL, f"{control}: moved {moved:.1e}"


def test_partial_rope_is_hfs_apply_rotary_pos_emb():
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(B, 5, H, HD, generator=g), torch.randn(B, 5, KV, HD, generator=g)
    cos, sin = rope_cos_sin(torch.arange(5), ROT, 10000.0)  # [5, ROT] each
    ref_q, ref_k = hf.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos[None],
                                           sin[None])
    assert (partial_rope(q, cos, sin, ROT) - ref_q.transpose(1, 2)).abs().max() < 1e-6
    assert (partial_rope(k, cos, sin, ROT) - ref_k.transpose(1, 2)).abs().max() < 1e-6
    full_cos, full_sin = rope_cos_sin(torch.arange(5), HD, 10000.0)
    assert torch.equal(partial_rope(q, full_cos, full_sin, HD),
                       apply_rope(q, full_cos, full_sin))  # the whole head: as before


@pytest.fixture(scope="module")
def embedded():
    from llmtrace_book import load_model
    return load_model("embedded")


def test_by_default_attention_records_what_it_did(embedded):
    """A Llama's layer is Llama's `Attention`, none of Qwen3-Next's steps mixed in (no output
    gate, RoPE on the whole head): the model's own part computes the same records, ops, costs
    and values as `Attention(config)` called alone."""
    m = embedded
    ids = m.encode("The capital of France is")
    x = F.embedding(ids, m.weights.embed)  # [1, T, D]
    pos = m.positions(0, ids.shape[1])
    lw = m.weights.layers[0]
    assert type(m.blocks[0].attn) is Attention and m.config.rotary_dim is None
    a, b = Trace(), Trace()
    out_a = Attention(m.config)(x, lw, pos, None, a)
    out_b = m.blocks[0].attn(x, lw, pos, None, b)
    assert pos.more == {} and pos.cos.shape[-1] == m.config.head_dim
    assert torch.equal(out_a, out_b)
    assert [(r.name, r.op, r.shape, r.macs) for r in a] == [(r.name, r.op, r.shape, r.macs)
                                                            for r in b]
    assert all(torch.equal(a[n], b[n]) for n in a.names)
    assert "attn.gate" not in a and "attn.output_gate" not in a
    assert a.get("attn.rope_q").op == "rotate pairs (d, d+head_dim/2) by position * freq"
    assert a.get("attn.q_proj").macs == x.shape[1] * m.config.hidden_size * m.config.n_heads \
        * m.config.head_dim


# --- Qwen3-Next's MoE, Qwen3.5, the names on disk -----------------------------------------------

def test_qwen3_next_moe_is_moe_mlp_plus_a_gated_shared_expert():
    """Qwen3NextSparseMoeBlock = moe_mlp (softmax top-k, renormalized as norm_topk_prob says)
    + sigmoid(x @ w_shared_gate^T) * the shared expert's SwiGLU."""
    block = randomize(Qwen3NextSparseMoeBlock(hf_config()), 8)
    x = inputs(5, seed=9)
    ex, E, Fm = block.experts, 4, 32
    w = MoeWeights(router=block.gate.weight, gate=ex.gate_up_proj[:, :Fm],
                   up=ex.gate_up_proj[:, Fm:], down=ex.down_proj)
    se = block.shared_expert
    shared_w = SimpleNamespace(gate=se.gate_proj.weight, up=se.up_proj.weight,
                               down=se.down_proj.weight)
    with torch.no_grad():
        want = block(x)
        routed = moe_mlp(x, w, 2, "softmax_topk", renormalize=True)
        shared = torch.sigmoid(F.linear(x, block.shared_expert_gate.weight)) * swiglu(
            x, shared_w)
    assert ((routed + shared) - want).abs().max() < TOL
    assert (routed - want).abs().max() > 100 * TOL  # the shared expert counts


def test_qwen3_5_text_runs_the_same_mechanism():
    """Qwen3.5's Gated DeltaNet computes the same layer from four unfused projections
    (in_proj_qkv flat, in_proj_z, in_proj_b, in_proj_a), and its text rotary (M-RoPE, all
    three position ids equal) the same partial RoPE tables as Qwen3-Next's."""
    cfg = Qwen3_5TextConfig(hidden_size=D, linear_num_key_heads=HK, linear_num_value_heads=HV,
                            linear_key_head_dim=DK, linear_value_head_dim=DV,
                            linear_conv_kernel_dim=KERNEL, num_hidden_layers=4,
                            num_attention_heads=H, num_key_value_heads=KV, head_dim=HD,
                            vocab_size=128, intermediate_size=96)
    layer = randomize(Qwen3_5GatedDeltaNet(cfg, 0), 10)
    sd = {f"model.layers.0.linear_attn.{k}": v for k, v in layer.state_dict().items()}
    w = hf_deltanet_weights(sd.__getitem__, "model.layers.0", DIMS, "qwen3_5_text")
    x = inputs(seed=11)
    with torch.no_grad():
        assert (gated_deltanet(x, w, DIMS) - layer(x)).abs().max() < TOL
    p = torch.arange(20)
    cos, sin = Qwen3_5TextRotaryEmbedding(cfg)(x, p.view(1, 1, -1).expand(3, 1, -1))
    ours_cos, ours_sin = rope_cos_sin(p, int(HD * cfg.rope_parameters["partial_rotary_factor"]),
                                      cfg.rope_parameters["rope_theta"])
    assert (cos[0] - ours_cos).abs().max() < 1e-6 and (sin[0] - ours_sin).abs().max() < 1e-6


LINEAR_NAMES = {"A_log": (HV,), "dt_bias": (HV,), "conv1d.weight": (DIMS.conv_dim, 1, KERNEL),
                "in_proj_qkvz.weight": (2 * HK * DK + 2 * HV * DV, D),
                "in_proj_ba.weight": (2 * HV, D), "norm.weight": (DV,),
                "out_proj.weight": (D, HV * DV)}
FULL_NAMES = {"q_proj.weight": (2 * H * HD, D), "k_proj.weight": (KV * HD, D),
              "v_proj.weight": (KV * HD, D), "o_proj.weight": (D, H * HD),
              "q_norm.weight": (HD,), "k_norm.weight": (HD,)}


def test_the_names_on_disk(tmp_path):
    """save_pretrained of a tiny Qwen3NextForCausalLM: layers 0-2 linear_attn, layer 3
    self_attn (full_attention_interval 4); hf_deltanet_weights reads the file."""
    torch.manual_seed(12)
    model = Qwen3NextForCausalLM(hf_config()).eval()
    model.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    for i in range(3):
        p = f"model.layers.{i}.linear_attn."
        assert {n[len(p):]: tuple(t.shape) for n, t in sd.items() if n.startswith(p)} == \
            LINEAR_NAMES
    p = "model.layers.3.self_attn."
    assert {n[len(p):]: tuple(t.shape) for n, t in sd.items() if n.startswith(p)} == FULL_NAMES
    moe = {n.split("mlp.", 1)[1] for n in sd if n.startswith("model.layers.3.mlp.")}
    assert {"gate.weight", "shared_expert_gate.weight", "shared_expert.gate_proj.weight",
            "experts.0.gate_proj.weight", "experts.3.down_proj.weight"} <= moe
    w = hf_deltanet_weights(sd.__getitem__, "model.layers.1", DIMS)
    x = inputs(seed=13)
    with torch.no_grad():
        assert (gated_deltanet(x, w, DIMS) - model.model.layers[1].linear_attn(x)).abs().max() \
            < TOL


def test_the_layers_of_the_grouped_projection():
    """grouped_to_flat: Qwen3-Next's rows per key head become every head's q, then k, v, z."""
    r = HV // HK
    sizes = [DK, DK, r * DV, r * DV]
    rows = torch.arange(HK * sum(sizes), dtype=torch.float32)[:, None]  # row i holds i
    flat = deltanet.grouped_to_flat(rows, HK, sizes)[:, 0].long()
    group = sum(sizes)
    q_rows = flat[:HK * DK].view(HK, DK)
    assert q_rows[1, 0] == group  # key head 1's q starts the second group
    v_rows = flat[2 * HK * DK:2 * HK * DK + HV * DV].view(HV, DV)
    assert v_rows[r, 0] == group + 2 * DK  # value head r: the first of group 1's


def test_a_prompt_in_two_passes_is_the_prompt_in_one(hf_layer):
    """The state carries the conv's inputs and S across passes: 5 then 4 tokens (chunked,
    each from the state the last left) give the 9 tokens' outputs and state of one pass."""
    x, w = inputs(PROMPT), ours(hf_layer)
    one, two = DeltaNetState(DIMS, B), DeltaNetState(DIMS, B)
    with torch.no_grad():
        whole = gated_deltanet(x, w, DIMS, one, chunk=CHUNK)
        parts = torch.cat([gated_deltanet(x[:, :5], w, DIMS, two, chunk=CHUNK),
                           gated_deltanet(x[:, 5:], w, DIMS, two, chunk=CHUNK)], 1)
    assert (whole - parts).abs().max() < TOL
    assert (one.recurrent - two.recurrent).abs().max() < TOL
    assert (one.conv - two.conv).abs().max() < 1e-6  # the last 3 inputs, either way
