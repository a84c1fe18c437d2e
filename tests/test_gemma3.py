"""Gemma 3 (text) against transformers' own Gemma3ForCausalLM, on a tiny random checkpoint made
at test time from Gemma3TextConfig (`tiny_checkpoint.ROWS`): local (sliding-window) and global layers with two RoPE bases,
a window shorter than the prompt, head_dim != hidden / heads, query_pre_attn_scalar != head_dim.
Then the Gemma-3-270M preset's parameter count against HF's class on the meta device."""

import time

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from llmtrace_book import generate, load_model
from llmtrace_book.config import Config
from llmtrace_book.weights.names import expected_shapes
from llmtrace_book.cost import parameter_count
from llmtrace_book.errors import LlmTraceError
from llmtrace_book.model import Model, estimate_trace_bytes, trace_bytes, trace_shapes
from llmtrace_book.trace import Trace
from tiny_checkpoint import make_tiny_checkpoint

PROMPT_LEN = 11  # past the window of 4


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    d = make_tiny_checkpoint(tmp_path_factory.mktemp("gemma3") / "tiny", family="gemma3_text")
    hf = Gemma3ForCausalLM.from_pretrained(d, attn_implementation="eager",
                                           dtype=torch.float32).eval()
    return load_model(str(d)), hf


def prompt_ids(n=PROMPT_LEN, seed=1):
    return torch.randint(3, 32000, (1, n), generator=torch.Generator().manual_seed(seed))


def test_config_read_from_hf(gemma):
    c = gemma[0].config
    assert c.head_dim == 24 != c.hidden_size // c.n_heads
    assert c.attn_scale == 20**-0.5
    assert c.layer_types == ("sliding", "full", "sliding", "full")
    assert (c.rope_theta, c.rope_local_theta) == (1e6, 1e4)
    assert (c.norm_offset, c.sandwich_norm, c.embed_scale, c.mlp_act) == (
        True, True, True, "gelu_tanh")
    assert c.tied_lm_head and c.norm_eps == 1e-6 and c.sliding_window == 4 and c.qk_norm
    assert Config.from_hf(c.to_hf(), name=c.name) == c  # written back, read the same


def test_every_end_id_ends_a_generation(gemma):
    """Gemma 3 lists two ends, eos_token_id [1, 106] (<eos>, <end_of_turn>): read, written back
    as HF reads it, and each one stops `generate`."""
    model = gemma[0]
    assert Config.from_name("gemma-3-270m").end_ids == (1, 106)
    hf = model.config.replace(eos_id=1, stop_ids=(106,)).to_hf()
    assert hf["eos_token_id"] == [1, 106]
    assert Gemma3TextConfig(**hf).eos_token_id == [1, 106]
    c = Config.from_hf(hf, name="x")
    assert (c.eos_id, c.stop_ids, c.end_ids) == (1, (106,), (1, 106))
    with pytest.raises(LlmTraceError, match=r"stop_ids=\(32000,\) must be token ids below"):
        c.replace(stop_ids=(32000,))
    free = generate(model, prompt_ids(), max_new_tokens=5, trace=False, stop_at_eos=False)
    ends = (model.config.eos_id, free.new_ids[2])  # the third token made an end
    stopper = Model(model.config.replace(stop_ids=ends[1:]), model.weights, model.tokenizer)
    g = generate(stopper, prompt_ids(), max_new_tokens=5, trace=False)
    k = next(i for i, t in enumerate(free.new_ids) if t in ends)
    assert g.stop_reason == "eos" and g.new_ids == free.new_ids[:k + 1] and k < 4


@torch.inference_mode()
def test_prefill_logits_match_hf(gemma):
    model, hf = gemma
    ids = prompt_ids()
    ours, trace = model.run(ids)
    theirs = hf(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4
    # each switch has its own record; only the sliding layers see the window
    for name in ("embed.scaled", "layers.0.attn_post_norm", "layers.0.mlp_post_norm"):
        assert name in trace
    assert "layers.0.attn.window_mask" in trace and "layers.1.attn.window_mask" not in trace
    assert "gelu_tanh" in trace.get("layers.0.mlp.act").op
    # the table folds layers 1..3 without calling them the same ops
    table = " ".join(trace.table(layers=1).split())  # its op column wraps
    assert "3 more layers; attn.window_mask in some only" in table


@torch.inference_mode()
def test_decode_with_cache_matches_hf(gemma):
    """Greedy decode reading the KV cache, positions 11..17 with a window of 4, against HF's
    forward over the whole sequence at once, and against HF's own cached decode."""
    model, hf = gemma
    g = generate(model, prompt_ids(), max_new_tokens=7, trace=False, stop_at_eos=False)
    theirs = hf(torch.tensor([g.ids[:-1]])).logits[0]  # [T + 6, V]
    for step, ours in enumerate(g.step_logits):
        row = theirs[PROMPT_LEN - 1 + step]
        assert (ours - row).abs().max().item() < 1e-4, f"step {step}"
        assert g.new_ids[step] == int(row.argmax())
    # and HF's own greedy decode, through its cache (a sliding one on the local layers)
    out = hf.generate(prompt_ids(), max_new_tokens=7, do_sample=False)
    assert out[0, PROMPT_LEN:].tolist() == g.new_ids


def test_trace_size_estimate_counts_gemma_records(gemma):
    """The closed form, the meta pass (one layer of each kind) and a real trace agree."""
    model = gemma[0]
    _, trace = model.run(prompt_ids())
    kept = sum(r.tensor.numel() * r.tensor.element_size() for r in trace if r.tensor is not None)
    T = PROMPT_LEN
    assert estimate_trace_bytes(model.config, T) == trace_bytes(
        model.config, Trace(names="*"), T) == kept
    only_windows = Trace(names="layers.*.attn.window_mask")
    assert trace_bytes(model.config, only_windows, T) == 2 * 4 * T * T  # 2 sliding layers


# each Gemma switch back to Llama's default (layer_types=(): the window on every layer, as Mistral)
SWITCHES_OFF = dict(norm_offset=False, sandwich_norm=False, mlp_act="silu", embed_scale=False,
                    attn_scale=0.0, layer_types=(), rope_local_theta=0.0, qk_norm=False)


@pytest.mark.parametrize("switch", SWITCHES_OFF)
@torch.inference_mode()
def test_each_switch_matters(gemma, switch):
    """Turn one switch back to Llama's default: the logits leave HF's by far more than the
    tolerance (measured: 0.08 for GeGLU to 1.5 for the sandwich norms, logits up to 0.9)."""
    model, hf = gemma
    c = model.config.replace(**{switch: SWITCHES_OFF[switch]})
    ids = prompt_ids()
    ours = Model(c, model.weights).forward(ids)
    assert (ours - hf(ids).logits).abs().max().item() > 100 * 1e-4


def test_gemma_3_270m_parameters_match_hf_meta():
    c = Config.from_name("gemma-3-270m")
    hf_config = {k: v for k, v in c.to_hf().items()
                 if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        hf = Gemma3ForCausalLM(Gemma3TextConfig(**hf_config))
    hf_count = sum(p.numel() for p in hf.parameters())  # the tied head counted once
    assert parameter_count(c) == hf_count == 268_098_176  # the published total
    # the same tensors under the same names (HF's state dict names the tied head too)
    assert expected_shapes(c) == {k: tuple(t.shape) for k, t in hf.state_dict().items()
                                  if k != "lm_head.weight"}


def test_gemma_3_270m_traces_on_meta():
    """Prefill of 6 tokens and one decode step, every layer, well under a second a layer; the
    window mask only where the published config puts a sliding layer."""
    c = Config.from_name("gemma-3-270m")
    began = time.perf_counter()
    prefill, step = trace_shapes(c, 6, decode_steps=1)
    assert time.perf_counter() - began < 0.5 * c.n_layers
    assert prefill.shape("layers.0.attn.q") == (1, 6, 4, 256)  # 4 x 256 = 1024 != hidden 640
    assert step.shape("layers.5.attn.scores") == (1, 4, 1, 7)
    kinds = ["sliding" if f"layers.{i}.attn.window_mask" in prefill else "full"
             for i in range(c.n_layers)]
    assert tuple(kinds) == c.layer_types


def test_published_config_json_reads_as_the_preset():
    """google/gemma-3-270m's config.json is in the older format (rope_theta and
    rope_local_base_freq, no rope_parameters): it must read as the preset."""
    published = {**Config.from_name("gemma-3-270m").to_hf(), "rope_theta": 1_000_000.0,
                 "rope_local_base_freq": 10_000.0, "rope_scaling": None}
    del published["rope_parameters"]
    assert Config.from_hf(published, name="gemma-3-270m") == Config.from_name("gemma-3-270m")


def test_window_pattern_without_layer_types():
    """Older files give `sliding_window_pattern` (every 6th layer global) instead of
    layer_types: llmtrace reads it as Gemma3TextConfig does."""
    hf = {**Config.from_name("gemma-3-270m").to_hf(), "num_hidden_layers": 8}
    del hf["layer_types"]
    ours = Config.from_hf(hf).layer_types
    theirs = Gemma3TextConfig(**{k: v for k, v in hf.items() if k != "model_type"}).layer_types
    assert ours == tuple(t.split("_")[0] for t in theirs)
    assert ours.count("full") == 1


@pytest.mark.parametrize("change, says", [
    ({"model_type": "gemma3"}, "vision tower"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0,
                                             "rope_theta": 1e6}}}, "rope_type 'linear'"),
])
def test_what_is_not_computed_is_refused(change, says):
    hf = {**Config.from_name("gemma-3-270m").to_hf(), **change}
    with pytest.raises(LlmTraceError, match=says):
        Config.from_hf(hf)


@pytest.mark.parametrize("preset, change, says", [
    ("tinyllama", {"norm_offset": True}, "norm_offset=True set with family 'llama'"),
    ("gemma-3-270m", {"embed_scale": False}, "Gemma3ForCausalLM always computes"),
])
def test_to_hf_writes_gemma_switches_only_as_gemma(preset, change, says):
    with pytest.raises(LlmTraceError, match=says):
        Config.from_name(preset).replace(**change).to_hf()


@torch.inference_mode()
def test_written_back_hf_reads_the_same_model(gemma, tmp_path):
    """save_hf writes Gemma's names (pre_feedforward_layernorm...) and config.json: HF's class
    loads them and computes the same logits."""
    from llmtrace_book.model import state_dict_from_weights
    from llmtrace_book.weights.hf import save_hf

    model, hf = gemma
    save_hf(tmp_path, model.config, state_dict_from_weights(model.config, model.weights))
    again = Gemma3ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager",
                                              dtype=torch.float32).eval()
    ids = prompt_ids()
    assert torch.equal(again(ids).logits, hf(ids).logits)
