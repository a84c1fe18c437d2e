"""OLMo 3 and SmolLM3 as HF's own config classes read them, and what is refused by key: the kinds
of layer and the RoPE base of each (OLMo 3), which layers have no RoPE and which slide (SmolLM3),
checked against transformers' Olmo3Config and SmolLM3Config on the same settings; the trace
says which layers turn q and k. Parity with HF's models is tests/test_families.py's (one row
each in tiny_checkpoint.ROWS)."""

import pytest
import torch
import transformers

from llmtrace_book import Config, LlmTraceError, generate, load_model, trace_shapes
from llmtrace_book.model import Model
from tiny_checkpoint import ROWS, make_tiny_checkpoint

SHAPES = dict(vocab_size=128256, hidden_size=64, intermediate_size=96, num_attention_heads=4)


def smol(**settings) -> dict:
    return {"model_type": "smollm3", **SHAPES, **settings}


@pytest.mark.parametrize("n, every", [(4, 4), (36, 4), (7, 3), (5, 1), (6, 2)])
def test_no_rope_layers_derived_as_hfs(n, every):
    ours = Config.from_hf(smol(num_hidden_layers=n, no_rope_layer_interval=every))
    hf = transformers.SmolLM3Config(num_hidden_layers=n, no_rope_layer_interval=every)
    assert [int(ours.has_rope(i)) for i in range(n)] == hf.no_rope_layers
    assert ours.no_rope_layers == (() if all(hf.no_rope_layers) else tuple(hf.no_rope_layers))


def test_no_rope_layers_as_written_win_over_the_interval():
    c = Config.from_hf(smol(num_hidden_layers=4, no_rope_layers=[0, 1, 0, 1],
                            no_rope_layer_interval=2))
    assert c.no_rope_layers == (0, 1, 0, 1)


@pytest.mark.parametrize("flags, said", [
    ([1, 1, 0], r"no_rope_layers must list 1 \(RoPE\) or 0 \(none\) for each of the 4 layers"),
    ([1, 1, 0, 1, 1], "for each of the 4 layers"), ([1, 2, 1, 0], "got \\[1, 2, 1, 0\\]"),
    ([True, 1, 1, 0], "no_rope_layers must list"), ("1110", "no_rope_layers must list")])
def test_a_wrong_no_rope_layers_is_refused_by_key(flags, said):
    with pytest.raises(LlmTraceError, match=said):
        Config.from_hf(smol(num_hidden_layers=4, no_rope_layers=flags))


def test_sliding_window_slides_the_nope_layers_as_hfs():
    settings = dict(num_hidden_layers=8, use_sliding_window=True, sliding_window=16)
    c, hf = Config.from_hf(smol(**settings)), transformers.SmolLM3Config(**settings)
    assert c.layer_types == tuple(t.split("_")[0] for t in hf.layer_types)
    assert [i for i in range(8) if c.is_sliding(i)] == [3, 7] == [
        i for i in range(8) if not c.has_rope(i)]
    assert c.sliding_window == 16
    off = Config.from_hf(smol(num_hidden_layers=8, sliding_window=16))  # use_sliding_window off
    assert off.layer_types == () and off.sliding_window == 0


@pytest.mark.parametrize("settings, said", [
    (dict(use_sliding_window=True), "use_sliding_window=true with sliding_window null"),
    (dict(sliding_window=8, layer_types=["full_attention"] * 3 + ["sliding_attention"]),
     "layer_types names sliding_attention layers but use_sliding_window is false"),
    (dict(layer_types=["full_attention"] * 3), "for each of the 4 layers"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0,
                        "original_max_position_embeddings": 64}), "rope_scaling of type 'yarn'")])
def test_smollm3_settings_not_computed_are_refused_by_key(settings, said):
    with pytest.raises(LlmTraceError, match=said):
        Config.from_hf(smol(num_hidden_layers=4, **settings))


def test_smollm3_without_a_window_matches_hf(tmp_path):
    """SmolLM3-3B's own setting (no window): prefill and decode match HF's model; RoPE on the
    NoPE layer moves the logits far more than the tolerance."""
    d = make_tiny_checkpoint(tmp_path / "smol", family="smollm3", use_sliding_window=False,
                             sliding_window=None)
    model = load_model(d)
    assert model.config.no_rope_layers == (1, 1, 1, 0) and model.config.layer_types == ()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32).eval()
    ids = torch.randint(3, 32000, (1, 11), generator=torch.Generator().manual_seed(5))
    g = generate(model, ids, 4, stop_at_eos=False, trace=False)
    with torch.inference_mode():
        ref = hf(torch.tensor([g.ids])).logits[0]  # [T + 4, V]
    ours = model.run(ids, keep_values=False)[0][0]  # [T, V]
    assert (ours - ref[:11]).abs().max().item() < 1e-4
    assert (torch.stack(g.step_logits) - ref[10:-1]).abs().max().item() < 1e-4
    roped = Model(model.config.replace(no_rope_layers=()), model.weights)
    assert (roped.run(ids, keep_values=False)[0][0] - ref[:11]).abs().max().item() > 1e-2


def test_the_trace_says_which_layers_of_smollm3_3b_have_no_rope():
    c = Config.from_name("smollm3-3b")
    hf = transformers.SmolLM3Config(**{k: v for k, v in c.to_hf().items()
                                       if k not in ("architectures", "model_type")})
    trace = trace_shapes(c, 4, 0)[0]
    unturned = [i for i in range(c.n_layers)
                if trace.get(f"layers.{i}.attn.rope_q").op.startswith("no RoPE")]
    assert unturned == [i for i, f in enumerate(hf.no_rope_layers) if f == 0] == list(
        range(3, 36, 4))
    q = trace.get("layers.3.attn.q")  # the record before it: the same shape, unturned
    assert trace.get("layers.3.attn.rope_q").shape == q.shape


def olmo3(**settings) -> dict:
    return {"model_type": "olmo3", **SHAPES, "num_hidden_layers": 8, **settings}


def test_olmo3_kinds_and_bases_as_hfs():
    for settings in ({}, {"layer_types": ["full_attention", "sliding_attention"] * 4},
                     {"rope_parameters": {"full_attention": {"rope_theta": 1e4},
                                          "sliding_attention": {"rope_theta": 1e6}}}):
        c = Config.from_hf(olmo3(**settings))
        hf = transformers.Olmo3Config(num_hidden_layers=8, **settings)
        assert c.layer_types == tuple(t.split("_")[0] for t in hf.layer_types)
        rope = hf.rope_parameters
        assert c.rope_theta == rope["full_attention"]["rope_theta"]
        assert (c.rope_local_theta or c.rope_theta) == rope["sliding_attention"]["rope_theta"]
    preset = Config.from_name("olmo-3-7b")
    assert preset.layer_types == tuple(
        t.split("_")[0] for t in transformers.Olmo3Config(num_hidden_layers=32).layer_types)


YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
        "attention_factor": 1.2079441541679836, "beta_fast": 32.0, "beta_slow": 1.0}


@pytest.mark.parametrize("settings, said", [
    (dict(rope_scaling=YARN), "rope_scaling of type 'yarn'"),  # Olmo-3-1025-7B's own
    (dict(rope_parameters={"full_attention": {"rope_theta": 5e5, **YARN},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}),
     r"rope_parameters.full_attention \{'rope_theta'.* is not implemented for OLMo 3"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
     "OLMo 3's rope_parameters are keyed by layer kind"),
    (dict(rope_theta=1e4), r"rope_theta=10000 reaches only the full layers in Olmo3Config"),
    (dict(layer_types=["sliding_attention"] * 7), "layer_types names 7 layers"),
    (dict(layer_types=["local"] * 8), "layer_types must list 'full_attention' or"),
    (dict(sliding_window=None), "layer_types has sliding layers but sliding_window=0"),
    (dict(attention_bias=True), "attention_bias=true")])
def test_olmo3_settings_not_computed_are_refused_by_key(settings, said):
    with pytest.raises(LlmTraceError, match=said):
        Config.from_hf(olmo3(**settings))


def test_the_window_of_olmo3_is_what_its_sliding_layers_see():
    """A sliding layer records its window mask, the full layer (3) none."""
    c = Config.from_hf({**ROWS["olmo3"].config, "model_type": "olmo3"})
    trace = trace_shapes(c, 9, 0)[0]
    assert trace.get("layers.0.attn.window_mask") is not None
    assert "layers.3.attn.window_mask" not in [r.name for r in trace]
