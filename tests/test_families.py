"""Every family against Hugging Face transformers, on tiny random-weight checkpoints made at test
time by HF's own config and model classes, one row each (`tiny_checkpoint.ROWS`): Llama 3 (llama3
RoPE scaling), Mistral (sliding window 4), Qwen2 (bias on Q, K, V), Qwen3 (QK-norm, head_dim 24
with hidden 64 over 4 heads), Gemma 3 (local and global layers)... Each is loaded by llmtrace's own
loader; its logits must match HF's eager forward within 1e-4, for a prefill of 11 tokens (past the
window) and for greedy decode steps that read the KV cache. Each switch must matter: turned off,
the logits move far more than that."""

import dataclasses

import pytest
import torch
import transformers

from llmtrace_book import Config, LlmTraceError, generate, load_model, meta_model
from llmtrace_book.attention import causal_mask
from llmtrace_book.mechanisms.attention_steps import chunk_mask, window_mask
from llmtrace_book.mechanisms.gemma4 import proportional_frequencies
from llmtrace_book.mechanisms.yarn import yarn_frequencies
from llmtrace_book.lens import keeps_stream, lens_grid, logit_lens
from llmtrace_book.model import Model, estimate_trace_bytes, trace_bytes
from llmtrace_book.rope import rope_frequencies
from llmtrace_book.trace import Trace, TracePool
from llmtrace_book.weights.names import tensor_shapes
from tiny_checkpoint import ROWS, hf_config, make_tiny_checkpoint

TOL = 1e-4
T, STEPS = 11, 5  # prompt length (past the window of 4) and decode steps
NEW = [f for f in ROWS if f != "llama"]


@pytest.fixture(scope="module", params=NEW)
def family(request, tmp_path_factory):
    """(family, llmtrace's model, HF's model, prompt ids [1, T]) from one checkpoint."""
    f = request.param
    d = make_tiny_checkpoint(tmp_path_factory.mktemp(f) / f"tiny-{f}", family=f)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32).eval()
    assert type(hf).__name__ == ROWS[f].model_class
    ids = torch.randint(3, 32000, (1, T), generator=torch.Generator().manual_seed(5))
    return f, load_model(d), hf, ids


def weights_for(c: Config, w):
    """The weights with a gain of 1 for each norm the config `c` has and they lack (a switch
    turned off that moves OLMo 2's norms before the sublayers), and without the tensors of a
    switch turned off that the attention reads from the weights (gpt-oss's sinks, o_proj's
    bias)."""
    shapes = tensor_shapes(c)
    layers = [lw.replace(**{f: torch.ones(shapes[f]) for f in ("attn_norm", "mlp_norm")
                            if f in shapes and getattr(lw, f) is None},
                         **{f: None for f in ("sinks", "o_bias") if f not in shapes})
              for lw in w.layers]
    return dataclasses.replace(w, layers=layers)


def hf_logits(hf, ids) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.as_tensor(ids).reshape(1, -1)).logits[0]  # [T, V]


def test_prefill_matches_hf(family):
    f, model, hf, ids = family
    ours, _ = model.run(ids, keep_values=False)  # [1, T, V]
    ref = hf_logits(hf, ids)  # [T, V]
    assert (ours[0] - ref).abs().max().item() < TOL
    for change in ROWS[f].off:  # each switch is what makes them agree
        c = model.config.replace(**change)
        off, _ = Model(c, weights_for(c, model.weights)).run(ids, keep_values=False)
        assert (off[0] - ref).abs().max().item() > 100 * TOL, change


def test_decode_with_the_cache_matches_hf(family):
    """Greedy steps reading the cache (positions 11..15, all past the window) against HF's
    forward over the whole sequence: the same tokens, the same logits at each step."""
    f, model, hf, ids = family
    g = generate(model, ids, STEPS, stop_at_eos=False, trace=False)
    ref = hf_logits(hf, g.ids)[T - 1:-1]  # [STEPS, V]: the logits that chose each new token
    ours = torch.stack(g.step_logits)  # [STEPS, V]
    assert (ours - ref).abs().max().item() < TOL
    assert g.new_ids == ref.argmax(-1).tolist()


def layer_0(trace) -> set[str]:
    """The names of the records outside the layers and of layer 0's, without "layers.0."."""
    return {r.name.removeprefix("layers.0.") for r in trace
            if not r.name.startswith("layers.") or r.name.startswith("layers.0.")}


def test_trace_names_show_the_family(family, tiny):
    """A diff of the two traces' names is the family, and nothing else."""
    f, model, _, ids = family
    trace = model.run(ids, keep_values=False)[1]
    names, llama = layer_0(trace), layer_0(tiny.run(ids, keep_values=False)[1])
    assert names - llama == ROWS[f].records and llama - names == ROWS[f].lacks
    # Llama 3 adds no record: its RoPE says what turns it
    rope_q = next(r for r in trace if r.name.endswith(".attn.rope_q"))  # Qwen3-Next: layer 3
    assert ("llama3-scaled" in rope_q.op) == (f == "llama3")


def test_trace_bytes_count_the_family(family):
    f, model, _, ids = family
    _, trace = model.run(ids)
    kept = sum(r.tensor.numel() * r.tensor.element_size() for r in trace if r.tensor is not None)
    assert estimate_trace_bytes(model.config, T) == trace_bytes(model.config, Trace(names="*"),
                                                                T) == kept


def test_every_record_reads_what_its_op_made_through_the_pool(family):
    """The pool's copies and their views read, in every family, as the tensors the ops made:
    values bit for bit, dtype, shape, strides; and a second pass into returned memory too."""
    f, model, _, ids = family

    class EveryTensorKept(Trace):
        def __init__(self):
            super().__init__(pool=None)

        def record(self, name, op, tensor, macs=0, recompute=None):
            super().record(name, op, tensor.clone(), macs)  # the values at record time
            return tensor  # and what flows on is the op's own, as in the traced pass

    made = EveryTensorKept()
    model.forward(ids, made)
    pool = TracePool()
    model.forward(ids.flip(1), Trace(pool=pool))  # dropped at once: its memory goes to the pool
    trace = Trace(pool=pool)
    model.forward(ids, trace)
    assert trace.names == made.names
    for r, m in zip(trace, made):
        if r.kept:
            assert (r.tensor.dtype, r.tensor.shape) == (m.tensor.dtype, m.tensor.shape), r.name
            assert torch.equal(r.tensor, m.tensor), (f, r.name)


def test_the_lens_at_the_last_layer_is_the_models_output(family):
    """Whatever a layer adds to the stream after resid_out, and whatever follows the head, is
    in the lens: its last layer gives the model's own probabilities, at every position."""
    f, model, _, ids = family
    logits, trace = model.run(ids)
    own = logits[0].softmax(-1)  # [T, V]
    lens = logit_lens(model, trace, position=-1)  # [L, V]
    assert torch.allclose(lens[-1], own[-1], atol=1e-6), f
    grid = lens_grid(model, trace)
    assert torch.equal(grid.top_ids[-1], own.argmax(-1)), f
    # the CLI keeps only what the lens reads, and reads the same
    _, kept = model.run(ids, names=keeps_stream)
    assert torch.equal(lens_grid(model, kept).top_ids, grid.top_ids), f


def test_llama3_frequencies_match_hf(family):
    f, model, hf, _ = family
    c = model.config
    ours = rope_frequencies(c.rotary_dim or c.head_dim, c.rope_theta,
                            scaling=c.rope_scaling) if c.rope_type != "yarn" else \
        yarn_frequencies(c.head_dim, c.rope_theta,
                         dict(c.rope_scaling))  # [hd/2] (Qwen3-Next: [rotary_dim/2])
    if c.global_head_dim:  # Gemma 4: the full layers' wider heads, partly turning
        ours = proportional_frequencies(c.global_head_dim, c.rope_theta, c.rope_partial)
    rotary = hf.model.rotary_emb  # Gemma 3: one set of frequencies per kind of layer
    theirs = getattr(rotary, "inv_freq", None)
    assert torch.allclose(ours, rotary.full_attention_inv_freq if theirs is None else theirs,
                          rtol=1e-6, atol=0)
    if f == "llama3":  # the tiny config reaches all three cases: kept, blended, slowed
        plain = rope_frequencies(c.head_dim, c.rope_theta)
        ratio = (plain / ours).tolist()
        assert ratio[0] == 1.0 and 1.0 < ratio[1] < ratio[2] < 8.0
        assert ratio[3:] == pytest.approx([8.0] * (len(ratio) - 3))


def window_rule(p: int, j: int, w: int) -> bool:
    """HF's rule, from transformers.masking_utils: causal and inside the window."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    return bool(sliding_window_causal_mask_function(w)(0, 0, torch.tensor(p), torch.tensor(j)))


@pytest.mark.parametrize("start, T_, w", [(0, 11, 4), (11, 1, 4), (7, 3, 2), (0, 5, 9)])
def test_window_mask_is_hfs_rule(start, T_, w):
    S = start + T_
    mask = causal_mask(T_, S, start) + window_mask(T_, S, start, w)  # [T, S]
    seen = [[mask[i, j].item() == 0 for j in range(S)] for i in range(T_)]
    assert seen == [[window_rule(start + i, j, w) for j in range(S)] for i in range(T_)]
    assert [sum(row) for row in seen][-1] == min(w, S)  # the last query sees w keys


@pytest.mark.parametrize("start, T_, C", [(0, 11, 4), (11, 1, 4), (12, 1, 4), (7, 3, 2),
                                          (0, 5, 9)])
def test_chunk_mask_is_hfs_rule(start, T_, C):
    """Llama 4's chunks, as HF's `chunked_causal_mask_function`: causal, and in the query's
    own chunk of C positions (a decode step at 12 starts a chunk: it sees itself alone)."""
    from transformers.masking_utils import chunked_causal_mask_function

    rule = chunked_causal_mask_function(C, torch.zeros(1, dtype=torch.long))
    S = start + T_
    mask = causal_mask(T_, S, start) + chunk_mask(T_, S, start, C)  # [T, S]
    seen = [[mask[i, j].item() == 0 for j in range(S)] for i in range(T_)]
    assert seen == [[bool(rule(0, 0, torch.tensor(start + i), torch.tensor(j)))
                     for j in range(S)] for i in range(T_)]
    assert sum(seen[-1]) == (S - 1) % C + 1  # the last query: its chunk so far


@pytest.mark.parametrize("f", NEW)
def test_config_round_trip_through_hf(f):
    """to_hf writes what HF's class of the family reads back to the same switches."""
    c = Config.from_hf(make_config_json(f), name="x")
    assert c.family == hf_config(f).model_type
    assert Config.from_hf(c.to_hf(), name="x") == c
    hf_class = getattr(transformers, ROWS[f].config_class)
    back = hf_class(**{k: v for k, v in c.to_hf().items() if k != "architectures"})
    assert Config.from_hf(back.to_dict(), name="x") == c


def test_configs_hf_cannot_compute_are_refused():
    with pytest.raises(LlmTraceError, match=r"rope_scaling=\{'rope_type': 'dynamic'.* is not Llama"):
        Config.from_name("llama-3.2-1b").replace(rope_scaling={"rope_type": "dynamic"})
    with pytest.raises(LlmTraceError, match="rope_scaling of type 'yarn' needs a positive factor"):
        Config.from_name("gpt-oss-20b").replace(rope_scaling={"rope_type": "yarn"})
    with pytest.raises(LlmTraceError, match="rope_scaling of type 'yarn' with family 'llama'"):
        Config.from_name("llama-3.2-1b").replace(rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192})
    with pytest.raises(LlmTraceError, match="qk_norm=True set with family 'llama': HF's Llama"):
        Config.from_name("tinyllama").replace(qk_norm=True).to_hf()
    with pytest.raises(LlmTraceError, match="sliding_window=8 set with family 'qwen3'"):
        Config.from_name("qwen3-0.6b").replace(sliding_window=8).to_hf()
    olmo = Config.from_name("olmo-2-1b")
    with pytest.raises(LlmTraceError, match="pre_norm=False without sandwich_norm"):
        olmo.replace(sandwich_norm=False)
    with pytest.raises(LlmTraceError, match="qk_norm and qk_proj_norm both set"):
        olmo.replace(qk_norm=True)
    with pytest.raises(LlmTraceError, match="qk_proj_norm=False, but HF's Olmo2ForCausalLM alw"):
        olmo.replace(qk_proj_norm=False).to_hf()
    with pytest.raises(LlmTraceError, match="attention_bias=true .projections with a bias"):
        Config.from_hf({**olmo.to_hf(), "attention_bias": True})


def make_config_json(f: str) -> dict:
    return hf_config(f).to_dict()


def test_meta_model_of_each_family_has_its_tensors():
    for f in NEW:
        c = Config.from_hf(make_config_json(f), name=f)
        layers = meta_model(c).weights.layers
        full = next(i for i in range(c.n_layers) if not c.is_linear(i))  # Qwen3-Next: 3
        lw = layers[full]
        assert (layers[0].linear is not None) == c.is_linear(0) and lw.linear is None
        assert (lw.q_bias is not None) == c.qkv_bias
        assert (lw.q_norm is not None) == (c.qk_norm or c.qk_proj_norm)
        assert (lw.attn_norm is not None) == c.pre_norm


def only_tokenizer_json(tmp_path, family, text, post_processor=None):
    """A tiny checkpoint of `family` whose only tokenizer file is a word-level tokenizer.json
    (ids: <unk> 0, <s> 1, </s> 2, then the words of `text`), as Qwen, Gemma and Llama 3 ship."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    d = make_tiny_checkpoint(tmp_path / f"tiny-{family}", family=family)
    (d / "tokenizer.model").unlink()
    (d / "tokenizer_config.json").unlink()
    words = ["<unk>", "<s>", "</s>", *text.split()]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if post_processor is not None:
        tok.post_processor = post_processor
    tok.save(str(d / "tokenizer.json"))
    return d


def test_a_directory_with_only_tokenizer_json_loads(tmp_path):
    """Qwen, Gemma and Llama 3 checkpoints ship tokenizer.json, no tokenizer.model; Qwen's
    settings add no BOS."""
    d = only_tokenizer_json(tmp_path, "qwen3", "The capital of France is Paris")
    model = load_model(d)
    assert model.tokenizer.kind == "byte-level BPE"  # llmtrace's name for any tokenizer.json
    ids = model.encode("The capital of France is")[0].tolist()
    assert ids == [3, 4, 5, 6, 7]
    assert model.tokenizer.decode(ids) == "The capital of France is"
    assert generate(model, "The capital of France is", 2, trace=False).positions_processed == 6


def test_tokenizer_json_adds_bos_as_its_post_processor_says(tmp_path):
    """Llama 3's tokenizer.json adds <|begin_of_text|> in its post-processor and its settings
    do not say add_bos_token: HF adds it, so does llmtrace."""
    from tokenizers import processors

    bos = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    d = only_tokenizer_json(tmp_path, "llama3", "The capital", post_processor=bos)
    assert load_model(d).encode("The capital")[0].tolist() == [1, 3, 4]
