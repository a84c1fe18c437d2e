"""Gemma 4's text model (gemma4.py) against HF transformers' own classes on tiny random
weights: its rotary tables, per-layer inputs, attention of each kind (a sliding layer, a full
layer whose V is K's projection, a layer reading another's K and V), a decoder layer, and the
whole Gemma4ForCausalLM composed from llmtrace_book's stages, prefill past the window and decode
with the cache. Each piece has a negative control; the shapes come out the same on meta.
The parts are the library's (`Gemma4Attention` with `Scaled` and, on sliding layers, `Windowed`;
`SandwichBlock`, `Gemma4Block`, `GeGLU`), built from the `Config` the library reads from HF's
config.json. The MoE variant (enable_moe_block) is refused by its key: nothing computes it."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import Gemma4ForCausalLM, Gemma4TextConfig
from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

from llmtrace_book import Config, meta_model
from llmtrace_book.attention import Positions, causal_mask
from llmtrace_book.errors import LlmTraceError
from llmtrace_book.mechanisms import part
from llmtrace_book.mechanisms.attention_steps import Scaled, Windowed, window_mask
from llmtrace_book.mechanisms.gemma import GeGLU, SandwichBlock, offset_rms_norm, scaled_embed
from llmtrace_book.mechanisms.gemma4 import (Gemma4Attention, Gemma4Block, PleWeights,
                                        config_layer_shapes, kv_bytes_per_token, kv_sources,
                                        layer_scaled, layer_shapes, params_of_shapes,
                                        per_layer_inputs, per_layer_residual,
                                        proportional_cos_sin, proportional_frequencies,
                                        refuse_unsupported, rope_settings, softcap)
from llmtrace_book.kv_cache import KVCache
from llmtrace_book.norm import rms_norm
from llmtrace_book.rope import apply_rope, rope_cos_sin
from llmtrace_book.trace import NO_TRACE, Trace

TOL = 1e-5
KINDS = ["sliding_attention", "sliding_attention", "full_attention"] * 2
TINY = dict(
    vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True,
    sliding_window=4, max_position_embeddings=64, vocab_size_per_layer_input=300,
    hidden_size_per_layer_input=8, num_kv_shared_layers=2, use_double_wide_mlp=True,
    layer_types=KINDS, final_logit_softcapping=3.0,  # small: the cap bites on tiny logits
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     # a base of 100: even the slowest pairs turn within 11 positions
                     "full_attention": {"rope_type": "proportional", "rope_theta": 100.0,
                                        "partial_rotary_factor": 0.5}})
EPS = 1e-6
PROMPT_LEN = 11  # past the window of 4


def tiny_hf(seed=0, **overrides):
    """HF's model on seeded random weights: norms and layer scalars away from 1, so that
    a norm's weight and the scalar count."""
    torch.manual_seed(seed)
    hf = Gemma4ForCausalLM(Gemma4TextConfig(**{**TINY, **overrides})).eval()
    hf.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "embed" in name:
                p.normal_(0, 0.5)
        for name, b in hf.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    return hf


@pytest.fixture(scope="module")
def hf():
    return tiny_hf()


def hf_dict(hf):
    return hf.config.to_dict()


def config_of(hf) -> Config:
    """The library's config of HF's model, read from its config.json's keys."""
    return Config.from_hf(hf_dict(hf), name="g4")


def ids_of(n=PROMPT_LEN, seed=1):
    return torch.randint(3, 300, (1, n), generator=torch.Generator().manual_seed(seed))


# --- the layers' shapes and who reads whose K, V ------------------------------------------------
def test_kv_sources_match_hf_sharing_modes(hf):
    """Layers 4 (sliding) and 5 (full) compute no K, V: 4 reads layer 3's, 5 reads layer 2's,
    the last earlier layer of its kind, which HF marks "store"."""
    assert kv_sources(KINDS, 2) == (0, 1, 2, 3, 3, 2)
    assert hf.config.kv_sharing_modes == [None, None, "store", "store", "reuse", "reuse"]
    for n_layers, shared in ((30, 20), (12, 5), (35, 15)):
        c = Gemma4TextConfig(num_hidden_layers=n_layers, num_kv_shared_layers=shared)
        src = kv_sources(c.layer_types, shared)
        modes = c.kv_sharing_modes
        assert [m == "reuse" for m in modes] == [s != i for i, s in enumerate(src)]
        assert {s for i, s in enumerate(src) if s != i} <= {
            i for i, m in enumerate(modes) if m == "store"}
    assert kv_sources(KINDS, 0) == tuple(range(6))


def test_kv_sources_refused():
    with pytest.raises(LlmTraceError, match=r"num_kv_shared_layers=6 must be .* below the 6"):
        kv_sources(KINDS, 6)
    with pytest.raises(LlmTraceError, match=r"a shared full layer has no earlier full layer"):
        kv_sources(["sliding"] * 5 + ["full"], 1)


def test_layer_shapes_match_hf_modules(hf):
    shapes = layer_shapes(hf_dict(hf))
    for i, (s, layer) in enumerate(zip(shapes, hf.model.layers)):
        a = layer.self_attn
        assert s.head_dim == a.head_dim
        assert s.n_kv_heads == 4 // a.num_key_value_groups
        assert s.ffn_size == layer.mlp.intermediate_size
        assert a.is_kv_shared_layer == (s.kv_source != i)
        if s.kv_source == i:  # a shared layer has no projection of its own to test
            assert s.k_eq_v == (a.v_proj is None)
    assert [(s.head_dim, s.n_kv_heads, s.ffn_size) for s in shapes] == [
        (8, 2, 48), (8, 2, 48), (16, 1, 48), (8, 2, 48), (8, 2, 96), (16, 1, 96)]
    # the published form of the keys: global_head_dim, no per_layer_config
    assert layer_shapes(TINY) == shapes


def test_kv_bytes_and_params_from_shapes(hf):
    """Only layers 0-3 hold a cache: 3 sliding layers of 2 x 8 and one full layer of 1 x 16,
    K and V each, in bf16; and the layers' parameters equal HF's count of the same tensors."""
    shapes = layer_shapes(hf_dict(hf))
    assert kv_bytes_per_token(shapes) == 2 * 2 * (3 * 2 * 8 + 1 * 16)
    unshared = [dataclasses.replace(s, kv_source=i) for i, s in enumerate(shapes)]
    assert kv_bytes_per_token(unshared) > kv_bytes_per_token(shapes)
    hf_count = sum(p.numel() for n, p in hf.model.layers.named_parameters()
                   if n.endswith("proj.weight") and "per_layer" not in n)
    assert params_of_shapes(shapes, 32, 4) == hf_count


def test_refusals():
    for key in ("vision_config", "audio_config"):
        with pytest.raises(LlmTraceError, match=rf"^cfg: {key} \(the .* tower .*\) is not "
                                                r"implemented for Gemma 4, only its text model"):
            refuse_unsupported({"text_config": TINY, key: {"hidden_size": 8}}, "cfg")
    with pytest.raises(LlmTraceError, match=r"^cfg: use_bidirectional_attention='all' "):
        refuse_unsupported({**TINY, "use_bidirectional_attention": "all"}, "cfg")
    # computed: 'vision', which leaves a text prompt causal (HF's Gemma4Model)
    refuse_unsupported({**TINY, "vision_config": None,
                        "use_bidirectional_attention": "vision"}, "cfg")


def test_moe_variant_is_refused_by_its_key():
    """Experts beside the dense MLP (enable_moe_block): computed nowhere, refused by the key
    when the config is read, as HF's Gemma4TextConfig writes it."""
    moe = Gemma4TextConfig(**{**TINY, "enable_moe_block": True, "num_experts": 6,
                              "top_k_experts": 2, "moe_intermediate_size": 12}).to_dict()
    with pytest.raises(LlmTraceError, match=r"enable_moe_block=true \(experts beside each "
                       r"layer's MLP\) is not implemented for Gemma 4: only its dense models"):
        Config.from_hf(moe, name="g4")


def test_bidirectional_vision_leaves_text_causal(model):
    """use_bidirectional_attention='vision' changes nothing for text: HF's model with it
    gives the library's logits, computed causally."""
    _, sd, _, c = model
    ids = ids_of()
    with torch.no_grad():
        ref = hf_logits(tiny_hf(use_bidirectional_attention="vision"), ids)
        assert (lib_logits(c, sd, ids) - ref).abs().max() < 1e-4


# --- RoPE on part of each head ----------------------------------------------------------------
def test_proportional_rope_matches_hf(hf):
    """Full layers: 4 of the 8 pairs of a 16-wide head turn, at theta^(-2i/16) (counted over
    the whole head), the other 4 stand still; sliding layers: plain RoPE of their 8 dims."""
    rot = Gemma4TextRotaryEmbedding(hf.config)
    pos = torch.arange(PROMPT_LEN)
    x = torch.zeros(1, PROMPT_LEN, 32)
    cos, sin = rot(x, pos[None], "full_attention")
    mine = proportional_cos_sin(pos, 16, 100.0, 0.5)
    assert (mine[0] - cos[0]).abs().max() < TOL and (mine[1] - sin[0]).abs().max() < TOL
    f = proportional_frequencies(16, 100.0, 0.5)
    assert (f[4:] == 0).all() and (f[:4] > 0).all()
    assert torch.allclose(f[:4], 100.0 ** -(torch.arange(0, 8, 2) / 16))
    whole = rope_cos_sin(pos, 16, 100.0)  # every pair turning: the control
    assert (whole[1] - sin[0]).abs().max() > 100 * TOL
    cos, sin = rot(x, pos[None], "sliding_attention")
    plain = rope_cos_sin(pos, 8, 1e4)
    assert (plain[0] - cos[0]).abs().max() < TOL and (plain[1] - sin[0]).abs().max() < TOL


def test_proportional_rope_is_not_the_first_dims_turning():
    """Gemma 4 turns dims 0..3 with 8..11 of a 16-wide head (pairs across the whole head,
    frequencies over 16) and leaves 4..7, 12..15 as they are; turning the first 8 dims as a
    head of their own (pairs (d, d+4), frequencies over 8: Qwen3-Next's partial RoPE)
    moves other dims by other angles."""
    torch.manual_seed(6)
    x, pos = torch.randn(1, 5, 2, 16), torch.arange(5)
    gemma = apply_rope(x, *proportional_cos_sin(pos, 16, 100.0, 0.5))
    moved = (gemma - x).abs().amax(dim=(0, 1, 2)) > 0  # [16]
    assert moved.tolist() == ([True] * 4 + [False] * 4) * 2
    first = torch.cat([apply_rope(x[..., :8], *rope_cos_sin(pos, 8, 100.0)), x[..., 8:]], -1)
    assert (first - gemma).abs().max() > 100 * TOL


def test_rope_settings_read_and_refused(hf):
    assert rope_settings(hf_dict(hf)) == {"sliding": (1e4, 1.0), "full": (100.0, 0.5)}
    assert rope_settings(E2B_SHAPE) == {"sliding": (1e4, 1.0), "full": (1e6, 0.25)}
    full = TINY["rope_parameters"]["full_attention"]
    for bad, match in (({**full, "factor": 8.0}, r"full_attention\.factor=8\.0 is not"),
                       ({**full, "rope_type": "yarn"}, r"full_attention\.rope_type='yarn'"),
                       ({"rope_type": "default", "rope_theta": 1e4,
                         "partial_rotary_factor": 0.5}, r"full_attention\.partial_rotary")):
        c = {**TINY, "rope_parameters": {**TINY["rope_parameters"], "full_attention": bad}}
        with pytest.raises(LlmTraceError, match=match):
            rope_settings(c)
    with pytest.raises(LlmTraceError, match=r"layer_types must list .* got 'chunked'"):
        layer_shapes({**TINY, "layer_types": ["chunked_attention"] * 6})


# --- the library's composition ----------------------------------------------------------------
def layer_weights(sd, i):
    """One layer's tensors by the library's field names, from HF's names."""
    p = f"model.layers.{i}."
    names = dict(attn_norm="input_layernorm.weight", post_attn_norm="post_attention_layernorm"
                 ".weight", mlp_norm="pre_feedforward_layernorm.weight",
                 post_mlp_norm="post_feedforward_layernorm.weight",
                 q_proj="self_attn.q_proj.weight", k_proj="self_attn.k_proj.weight",
                 v_proj="self_attn.v_proj.weight", o_proj="self_attn.o_proj.weight",
                 q_norm="self_attn.q_norm.weight", k_norm="self_attn.k_norm.weight",
                 gate="mlp.gate_proj.weight", up="mlp.up_proj.weight",
                 down="mlp.down_proj.weight", ple_gate="per_layer_input_gate.weight",
                 ple_proj="per_layer_projection.weight",
                 ple_norm="post_per_layer_input_norm.weight", layer_scalar="layer_scalar")
    return SimpleNamespace(**{f: sd.get(p + n) for f, n in names.items()})


def positions(start, T, fraction=0.5, device=None, dims=(8, 16), full_theta=100.0):
    """One pass's Positions: the full layers' tables (16-wide heads, RoPE on `fraction` of the
    pairs, base 100) and the causal mask; the sliding layers' own tables (8-wide heads, base
    1e4) in `more["local"]`. The window is the sliding layers' part's own (`Windowed`, from
    the config's sliding_window: 4)."""
    local, wide = dims
    p = torch.arange(start, start + T, device=device)
    causal = causal_mask(T, start + T, start, device)
    full = (proportional_cos_sin(p, wide, full_theta, fraction) if fraction < 1
            else rope_cos_sin(p, wide, full_theta))
    pos = Positions(start, *full, causal)
    pos.more["local"] = Positions(start, *rope_cos_sin(p, local, 1e4), causal, pos.more)
    return pos


def tables(pos, kind):
    """The Positions whose cos, sin a layer of this kind turns by."""
    return pos.more["local"] if kind == "sliding" else pos


def attention(c, i):
    """Layer i's attention part: Gemma 4's, its scores times attn_scale (1), a window on the
    sliding layers."""
    return part(c.attn_scale and Scaled, Windowed if c.is_sliding(i) else None,
                Gemma4Attention)(c, i)


def lib_logits(c, sd, ids, start=0, caches=None, trace=NO_TRACE, off=(), fraction=0.5,
               cap=3.0, **where):
    """Gemma4ForCausalLM from llmtrace_book's stages, each layer's attention its part of config c.
    off: pieces left out (or Gemma 3's form in their place), for the controls; cap:
    final_logit_softcapping (None: none)."""
    if "attn_scale" in off:  # no Scaled: scores / sqrt(hd), in place of * 1
        c = c.replace(attn_scale=0.0)
    if "v_norm" in off:  # V as projected, not normalized
        c = c.replace(v_norm=False)
    norm = offset_rms_norm if "norm_weight" in off else rms_norm  # Gemma 3's (1 + weight)
    L = c.n_layers
    pos = positions(start, ids.shape[1], fraction=fraction, device=ids.device, **where)
    x = scaled_embed(ids, sd["model.embed_tokens.weight"], trace)  # [B, T, D]
    if "model.embed_tokens_per_layer.weight" in sd:  # hidden_size_per_layer_input > 0
        ple = per_layer_inputs(ids, x, PleWeights(
            sd["model.embed_tokens_per_layer.weight"],
            sd["model.per_layer_model_projection.weight"],
            sd["model.per_layer_projection_norm.weight"]), L, EPS, trace)  # [B, T, L, P]
    else:
        off = (*off, "ple")
    for i in range(L):
        w, name = layer_weights(sd, i), f"layers.{i}"
        attn = attention(c, i)
        if "kv_source" in off and i == 4:  # layer 4 reads layer 1's K, V, not layer 3's
            attn.shape = dataclasses.replace(attn.shape, kv_source=1)
        h = norm(x, w.attn_norm, EPS, trace, f"{name}.attn_norm")
        cache = caches[i] if caches is not None else None
        h = attn(h, w, pos, cache, trace, f"{name}.attn")  # [B, T, D]
        h = norm(h, w.post_attn_norm, EPS, trace, f"{name}.attn_post_norm")
        x = trace.record(f"{name}.resid_mid", "x + attn", x + h)  # [B, T, D]
        h = norm(x, w.mlp_norm, EPS, trace, f"{name}.mlp_norm")
        h = GeGLU(c.hidden_size, w.gate.shape[0])(h, w, trace, f"{name}.mlp")  # [B, T, D]
        h = norm(h, w.post_mlp_norm, EPS, trace, f"{name}.mlp_post_norm")
        x = trace.record(f"{name}.resid_out", "h + mlp", x + h)  # [B, T, D]
        if "ple" not in off:
            x = per_layer_residual(x, ple[:, :, i], w, EPS, trace, name)  # [B, T, D]
        if "layer_scalar" not in off:
            x = layer_scaled(x, w.layer_scalar, trace, name)  # [B, T, D]
    x = norm(x, sd["model.norm.weight"], EPS, trace, "final_norm")
    logits = trace.record("lm_head", "x @ W^T (tied)",
                          F.linear(x, sd["model.embed_tokens.weight"]))  # [B, T, V]
    return logits if "softcap" in off or cap is None else softcap(logits, cap, trace)


def new_caches(shapes, max_len, device="cpu"):
    """A cache for each layer that computes its own K, V; None for the layers that share."""
    return [KVCache(max_len, s.n_kv_heads, s.head_dim, 1, device) if s.kv_source == i
            else None for i, s in enumerate(shapes)]


@pytest.fixture(scope="module")
def model(hf):
    """HF's model, its tensors, each layer's shape read from its config.json, and the library's
    config: whose parts have those same shapes, and are the family's own."""
    shapes, c = layer_shapes(hf_dict(hf)), config_of(hf)
    assert config_layer_shapes(c) == shapes
    # the library's Gemma 4 builds the same attention parts (`part` makes a new class each
    # call: compare their bases)
    family = meta_model(c).blocks
    assert [type(b.attn).__mro__[1:] for b in family] == [
        type(attention(c, i)).__mro__[1:] for i in range(c.n_layers)]
    return hf, dict(hf.state_dict()), shapes, c


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits  # [1, T, V]


def test_whole_model_prefill_matches_hf(model):
    hf, sd, _, c = model
    ids = ids_of()
    ref = hf_logits(hf, ids)
    with torch.no_grad():
        mine = lib_logits(c, sd, ids)
    assert (mine - ref).abs().max() < 1e-4
    assert ref.abs().max() > 0.5  # the cap of 3 bites on these logits


def test_whole_model_decode_with_cache_matches_hf(model):
    """Prefill 11 tokens, then 3 greedy steps each reading the cache: the shared layers read
    their sources' caches, which hold every position (the window is the mask's)."""
    hf, sd, shapes, c = model
    ids = ids_of()
    caches = new_caches(shapes, PROMPT_LEN + 3)
    with torch.no_grad():
        out = hf(ids, use_cache=True)
        mine = lib_logits(c, sd, ids, 0, caches)
        assert (mine - out.logits).abs().max() < 1e-4
        cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
        for step in range(3):
            out = hf(nxt, cache=cache, use_cache=True)
            cache = out.cache
            mine = lib_logits(c, sd, nxt, PROMPT_LEN + step, caches)
            assert (mine - out.logits).abs().max() < 1e-4, step
            nxt = out.logits[:, -1:].argmax(-1)


@pytest.mark.parametrize("piece", ["ple", "layer_scalar", "softcap", "norm_weight",
                                   "proportional_rope", "v_norm", "attn_scale", "kv_source"])
def test_each_piece_off_moves_the_logits(model, piece):
    """The negative controls: each piece left out (or Gemma 3's form in its place) moves the
    logits by more than 100x the tolerance of the parity above. v_norm and attn_scale are
    switched off in the config the parts are built from; kv_source: layer 4's part reads
    layer 1's K, V, not layer 3's."""
    hf, sd, _, c = model
    ids = ids_of()
    ref = hf_logits(hf, ids)
    fraction = 1.0 if piece == "proportional_rope" else 0.5
    t = Trace(keep_values=False)
    with torch.no_grad():
        off = lib_logits(c, sd, ids, trace=t, off=(piece,), fraction=fraction)
    assert (off - ref).abs().max() > 100 * 1e-4, piece
    if piece == "v_norm":  # the switch took: no V was normalized
        assert not any(n.endswith(".attn.v_norm") for n in t.names)
    if piece == "attn_scale":
        assert t.get("layers.0.attn.scores").op == "q @ k^T / sqrt(8)"
    if piece == "kv_source":
        assert t.get("layers.4.attn.kv_cache.k").op == "K cache: shared: layers.1's, read 0:11"


# --- each piece against HF's own submodule ------------------------------------------------------
def hf_mask(T, start, window=None):
    m = causal_mask(T, start + T, start)
    return (m + window_mask(T, start + T, start, window) if window else m)[None, None]


@pytest.mark.parametrize("layer", [0, 2])
def test_attention_with_own_kv_matches_hf(model, layer):
    """Layer 0 (sliding, its own V projection) and layer 2 (full, 16-wide heads, one KV head,
    V from K's projection): HF's Gemma4TextAttention on the same input."""
    hf, sd, shapes, c = model
    s, a = shapes[layer], hf.model.layers[layer].self_attn
    torch.manual_seed(3)
    x = torch.randn(1, PROMPT_LEN, 32)
    pos = positions(0, PROMPT_LEN)
    turn = tables(pos, s.kind)
    store = {}
    with torch.no_grad():
        ref, _ = a(x, (turn.cos[None], turn.sin[None]),
                   hf_mask(PROMPT_LEN, 0, 4 if s.kind == "sliding" else None), store)
        t = Trace()
        mine = attention(c, layer)(x, layer_weights(sd, layer), pos, trace=t, name="attn")
        k, v = pos.more["kv", layer]  # what it read, left for the layers that share it
    assert (mine - ref).abs().max() < TOL
    assert t.get("attn.v_proj").op.startswith("k_proj" if layer == 2 else "x @ W_v")
    assert t.get("attn.scores").op == "q @ k^T * 1"
    if layer == 2:  # HF stores what the layers sharing it will read
        assert (store["full_attention"][0].transpose(1, 2) - k).abs().max() < TOL
        assert (store["full_attention"][1].transpose(1, 2) - v).abs().max() < TOL


def test_shared_attention_matches_hf(model):
    """Layer 4 computes only its query and reads layer 3's K, V, as HF's attention does
    from shared_kv_states; it has no k_proj, v_proj, k_norm on disk."""
    hf, sd, shapes, c = model
    assert shapes[4].kv_source == 3
    torch.manual_seed(4)
    x, x3 = torch.randn(1, PROMPT_LEN, 32), torch.randn(1, PROMPT_LEN, 32)
    pos = positions(0, PROMPT_LEN)
    turn = tables(pos, "sliding")
    mask = hf_mask(PROMPT_LEN, 0, 4)
    with torch.no_grad():
        attention(c, 3)(x3, layer_weights(sd, 3), pos)  # leaves its K, V in pos.more
        kv3 = pos.more["kv", 3]
        store = {"sliding_attention": tuple(t.transpose(1, 2) for t in kv3)}
        ref, _ = hf.model.layers[4].self_attn(x, (turn.cos[None], turn.sin[None]), mask, store)
        t = Trace()
        mine = attention(c, 4)(x, layer_weights(sd, 4), pos, trace=t, name="layers.4.attn")
    assert (mine - ref).abs().max() < TOL
    assert "layers.4.attn.k_proj" not in t.names
    assert t.get("layers.4.attn.kv_cache.k").op == "K cache: shared: layers.3's, read 0:11"
    assert not any(f"layers.4.self_attn.{n}" in " ".join(sd) for n in ("k_proj", "v_norm"))


def test_per_layer_inputs_match_hf(model):
    hf, sd, _, _ = model
    ids = ids_of()
    with torch.no_grad():
        x = hf.model.embed_tokens(ids)
        ref = hf.model.project_per_layer_inputs(x, hf.model.get_per_layer_inputs(ids))
        t = Trace()
        mine = per_layer_inputs(ids, x, PleWeights(
            sd["model.embed_tokens_per_layer.weight"],
            sd["model.per_layer_model_projection.weight"],
            sd["model.per_layer_projection_norm.weight"]), 6, EPS, t)
    assert mine.shape == ref.shape == (1, PROMPT_LEN, 6, 8)
    assert (mine - ref).abs().max() < TOL
    assert (t["ple.proj_norm"] * 2**-0.5 - ref).abs().max() > 100 * TOL  # rows count


def test_decoder_layer_matches_hf(model):
    """Layer 5: shared (reads layer 2), double-wide MLP (96), its per-layer input and its
    scalar: HF's Gemma4TextDecoderLayer against the library's block, a `Gemma4Block` around
    Gemma's `SandwichBlock` (the layer without its per-layer input and scalar)."""
    hf, sd, shapes, c = model
    assert shapes[5].kv_source == 2 and shapes[5].ffn_size == 96
    torch.manual_seed(5)
    x, x2 = torch.randn(1, PROMPT_LEN, 32), torch.randn(1, PROMPT_LEN, 32)
    ple = torch.randn(1, PROMPT_LEN, 8)
    pos = positions(0, PROMPT_LEN)
    # every layer's per-layer input: the block reads its own, layer 5's
    pos.more["ple"] = torch.randn(1, PROMPT_LEN, 6, 8).index_copy(2, torch.tensor([5]),
                                                                 ple[:, :, None])
    with torch.no_grad():
        attention(c, 2)(x2, layer_weights(sd, 2), pos)  # leaves its K, V in pos.more
        store = {"full_attention": tuple(t.transpose(1, 2) for t in pos.more["kv", 2])}
        ref = hf.model.layers[5](x, ple, store, (pos.cos[None], pos.sin[None]),
                                 hf_mask(PROMPT_LEN, 0))
        w = layer_weights(sd, 5)
        inner = SandwichBlock(attention(c, 5), GeGLU(c.hidden_size, 96), c, rms_norm)
        h = inner(x, w, pos)  # [1, T, D]
        t = Trace()
        mine = Gemma4Block(inner, 5, ple=8, scalar=True)(x, w, pos, trace=t,
                                                          name="layers.5")
    assert (mine - ref).abs().max() < TOL
    assert t["layers.5.ple_gate"].shape == (1, PROMPT_LEN, 8)
    assert (h - ref).abs().max() > 100 * TOL  # without the per-layer input and the scalar


# --- names on disk, shapes on meta ------------------------------------------------------------
def test_names_on_disk(tmp_path, hf):
    """save_pretrained writes a shared layer without K, V tensors, a k_eq_v layer without
    v_proj, one layer_scalar [1] per layer and the three PLE tensors of the model."""
    hf.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    assert sd["model.embed_tokens_per_layer.weight"].shape == (300, 6 * 8)
    assert sd["model.per_layer_model_projection.weight"].shape == (48, 32)
    assert sd["model.per_layer_projection_norm.weight"].shape == (8,)
    assert sd["model.layers.0.layer_scalar"].shape == (1,)
    assert sd["model.layers.0.per_layer_input_gate.weight"].shape == (8, 32)
    assert sd["model.layers.0.per_layer_projection.weight"].shape == (32, 8)
    assert "model.layers.2.self_attn.v_proj.weight" not in sd  # V is K's projection
    assert sd["model.layers.2.self_attn.k_proj.weight"].shape == (16, 32)  # 1 KV head of 16
    assert sd["model.layers.2.self_attn.q_proj.weight"].shape == (64, 32)  # 4 heads of 16
    for i in (4, 5):  # shared: a query and its output only
        attn = {n.split(".")[4] for n in sd if n.startswith(f"model.layers.{i}.self_attn.")}
        assert attn == {"q_proj", "q_norm", "o_proj"}
        assert sd[f"model.layers.{i}.mlp.gate_proj.weight"].shape == (96, 32)
    assert "lm_head.weight" not in sd  # tied


def test_meta_shapes_equal_real_ones(model):
    """A prefill and a decode step on the meta device make the records a real pass makes,
    with the same shapes (the full layers' 16-wide heads, the shared layers' S)."""
    hf, sd, shapes, c = model
    ids = ids_of()
    real, meta = Trace(keep_values=False), Trace(keep_values=False)
    meta_sd = {k: torch.empty(v.shape, device="meta") for k, v in sd.items()}
    with torch.no_grad():
        caches = new_caches(shapes, PROMPT_LEN + 1)
        lib_logits(c, sd, ids, 0, caches, real)
        lib_logits(c, sd, ids[:, :1], PROMPT_LEN, caches, real)
    meta_caches = [KVCache(PROMPT_LEN + 1, s.n_kv_heads, s.head_dim, 1, "meta")
                   if s.kv_source == i else None for i, s in enumerate(shapes)]
    lib_logits(c, meta_sd, ids.to("meta"), 0, meta_caches, meta)
    lib_logits(c, meta_sd, ids[:, :1].to("meta"), PROMPT_LEN, meta_caches, meta)
    assert [(r.name, r.shape) for r in meta] == [(r.name, r.shape) for r in real]
    by = {r.name: r.shape for r in real}  # the decode step's, the later ones
    assert by["layers.2.attn.q"] == (1, 1, 4, 16)
    assert by["layers.5.attn.kv_cache.k"] == (1, PROMPT_LEN + 1, 1, 16)
    assert by["layers.4.mlp.gate"] == (1, 1, 96)
    assert by["ple"] == (1, 1, 6, 8)
    assert "layers.4.attn.k_proj" not in by and "layers.3.attn.k_proj" in by


# A text config of the shape reported for google/gemma-4-E2B: 35 layers, every 5th full, the
# last 20 reading the K, V of layers 13 (sliding) and 14 (full); 1 KV head of 256 (sliding)
# or 512 (full); a double-wide MLP on the shared layers; per-layer inputs of 256.
E2B_SHAPE = dict(
    vocab_size=262144, hidden_size=1536, intermediate_size=6144, num_hidden_layers=35,
    num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
    attention_k_eq_v=False, sliding_window=512, hidden_size_per_layer_input=256,
    vocab_size_per_layer_input=262144, num_kv_shared_layers=20, use_double_wide_mlp=True,
    final_logit_softcapping=30.0,
    layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 7,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                        "partial_rotary_factor": 0.25}})


def test_e2b_shape_on_meta():
    """HF's class on meta with E2B's shape: the layers' parameters counted from the shapes
    are HF's, the cache holds 15 layers' K, V (18432 bytes a token in bf16, against 43008
    without sharing), and the library's pass makes its records on meta."""
    with torch.device("meta"):
        hf = Gemma4ForCausalLM(Gemma4TextConfig(**E2B_SHAPE))
    shapes = layer_shapes(hf.config.to_dict())
    assert shapes == layer_shapes(E2B_SHAPE)
    c = Config.from_hf(hf.config.to_dict(), name="e2b-shape")
    assert config_layer_shapes(c) == shapes and c.sliding_window == 512
    src = [s.kv_source for s in shapes]
    assert src[:15] == list(range(15))
    assert src[15:] == [14 if i % 5 == 4 else 13 for i in range(15, 35)]
    assert kv_bytes_per_token(shapes) == 2 * 2 * (12 * 256 + 3 * 512) == 18432
    assert kv_bytes_per_token([dataclasses.replace(s, kv_source=i)
                               for i, s in enumerate(shapes)]) == 43008
    hf_count = sum(p.numel() for n, p in hf.model.layers.named_parameters()
                   if n.endswith("proj.weight") and "per_layer" not in n)
    assert params_of_shapes(shapes, 1536, 8) == hf_count
    sd = dict(hf.state_dict())
    T = 6
    t = Trace(keep_values=False)
    caches = [KVCache(T, s.n_kv_heads, s.head_dim, 1, "meta") if s.kv_source == i else None
              for i, s in enumerate(shapes)]
    logits = lib_logits(c, sd, torch.zeros(1, T, dtype=torch.long, device="meta"), 0,
                        caches, t, fraction=0.25, cap=30.0, dims=(256, 512), full_theta=1e6)
    assert logits.shape == (1, T, 262144)
    by = {r.name: r.shape for r in t}
    assert by["ple"] == (1, T, 35, 256)
    assert by["layers.14.attn.q"] == (1, T, 8, 512) and by["layers.13.attn.k"] == (1, T, 1, 256)
    assert by["layers.34.attn.kv_cache.k"] == (1, T, 1, 512)  # layer 14's
    assert by["layers.15.mlp.gate"] == (1, T, 12288) and by["layers.14.mlp.gate"] == (1, T, 6144)
    assert sum(n.endswith(".attn.k_proj") for n in by) == 15
