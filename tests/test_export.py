"""The page's ONNX export (llmtrace_book.export): the graph is the trace, and its files are checked.

The export of the embedded model is made once (about a minute: the fp32 graph, then the one that
holds the GGUF's own blocks) and kept in the cache; these tests reuse it when it is there, as
`make book` does.
"""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import PROMPT, one_line, process_env
from llmtrace_book import export, meta_model
from llmtrace_book.errors import LlmTraceError
from llmtrace_book.model import Model, state_dict_from_weights, weights_from_state_dict

# three lengths: 1, 6 and 46 tokens; the long one with accents, CJK, an emoji, a run of spaces
# and newlines
PROMPTS = ("Paris", "The capital of France is a",
           "In 1889, the Eiffel Tower \u2014 la tour Eiffel \u2014 opened in Paris; \u6771\u4eac "
           "and \U0001F600 emoji,   runs of   spaces\nand new\n\nlines follow here.")
LENGTHS = (1, 6, 46)
RTOL = 1e-5  # each record: |onnxruntime - trace| / |trace|, in the 2-norm


@pytest.fixture(scope="module")
def web_dir():
    return export.web_dir()


@pytest.fixture(scope="module")
def web(web_dir):
    return json.loads((web_dir / "web.json").read_text())


FORMS = ("web.json", "web-fp32.json")  # the page's form (the GGUF's blocks), and fp32


@pytest.fixture(scope="module")
def sessions(web_dir):
    return {form: export.session(web_dir, web=form) for form in FORMS}


def relative_error(ref: np.ndarray, got: np.ndarray) -> float:
    """|got - ref| / |ref| over the finite entries (the masks' -inf must match exactly)."""
    finite = np.isfinite(ref)
    assert np.array_equal(ref[~finite], got[~finite])
    ref, got = ref[finite].astype(np.float64), got[finite].astype(np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("prompt, length", list(zip(PROMPTS, LENGTHS)))
def test_graph_is_the_trace(embedded, web_dir, sessions, form, prompt, length):
    """Every output of the graph is a record of the trace: same name, order and shape at each
    length, and onnxruntime's values within 1e-5 of the fp32 trace's, in both forms (measured,
    at 1 / 6 / 46 tokens: fp32 9.0e-6 / 2.7e-6 / 6.4e-6; the GGUF's blocks 8.1e-6 / 2.2e-6 /
    4.3e-6), the logits within the tolerance the manifest states (1e-4; measured at most
    7.2e-5 in fp32, 6.7e-5 from the blocks), the ten most likely tokens in the same order."""
    web = export.verify(web_dir, form)
    session = sessions[form]
    ids = embedded.encode(prompt)  # [1, T]
    assert ids.shape == (1, length)
    logits, trace = embedded.run(ids)
    outputs = session.get_outputs()
    assert [o.name for o in outputs] == trace.names == [r["name"] for r in web["records"]]
    values = session.run(None, {"ids": ids.numpy()})
    worst = (0.0, "")
    for rec, value, listed in zip(trace, values, web["records"]):
        assert value.shape == rec.shape, rec.name
        assert [length if d == "T" else d for d in listed["shape"]] == list(rec.shape)
        assert str(value.dtype) == rec.dtype == listed["dtype"]
        ref = rec.tensor.numpy()
        if not rec.tensor.is_floating_point():
            assert np.array_equal(value, ref), rec.name
            continue
        worst = max(worst, (relative_error(ref, value), rec.name))
    assert worst[0] <= RTOL, f"{worst[1]}: relative error {worst[0]:.2e}"
    assert web["tolerance"]["logits"] == 1e-4
    assert float(np.abs(values[-1] - logits.numpy()).max()) <= web["tolerance"]["logits"]
    top = torch.from_numpy(values[-1][0, -1]).topk(10).indices
    assert top.tolist() == logits[0, -1].topk(10).indices.tolist()


@pytest.fixture(scope="module")
def lens_sessions(web_dir):
    return {form: export.session(web_dir, web=form, graph="lens") for form in FORMS}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("prompt", PROMPTS[:2])  # 1 and 6 tokens: the lens costs T x 30 heads
def test_lens_graph_is_the_lens(embedded, web_dir, lens_sessions, form, prompt):
    """The lens graph gives `lens_grid`'s top token after every layer at every position, and its
    probability within 1e-5 (measured: at most 5.7e-6), from the trace's residual streams."""
    from llmtrace_book.lens import lens_grid

    web = export.verify(web_dir, form)
    _, trace = embedded.run(prompt)
    resid = np.stack([trace[f"layers.{i}.resid_out"].numpy()
                      for i in range(embedded.config.n_layers)])  # [L, 1, T, D]
    top_ids, top_probs = lens_sessions[form].run(web["lens"]["outputs"],
                                                 {web["lens"]["input"]: resid})
    grid = lens_grid(embedded, trace)
    assert np.array_equal(top_ids, grid.top_ids.numpy())
    assert np.abs(top_probs - grid.top_probs.numpy()).max() <= 1e-5


@pytest.mark.parametrize("form", FORMS)
def test_the_lens_reads_the_main_graphs_bytes(web_dir, form):
    """The lens graph holds no weight of its own: each initializer points into the main graph's
    data file, at the offsets the main graph's initializer of that name uses."""
    import onnx

    web = export.verify(web_dir, form)
    main = {i.name: i for i in onnx.load(str(web_dir / web["graph"]["file"]),
                                         load_external_data=False).graph.initializer}
    lens = onnx.load(str(web_dir / web["lens"]["graph"]["file"]), load_external_data=False)
    assert web["lens"]["graph"]["size"] < 1e6
    for init in lens.graph.initializer:
        assert init == main[init.name]
        where = {e.key: e.value for e in init.external_data}
        assert not init.raw_data and where["location"] == web["external_data"]


@pytest.fixture(scope="module")
def decode_sessions(web_dir):
    return {form: export.session(web_dir, web=form, graph="decode") for form in FORMS}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_decode_graph_is_generate(embedded, web_dir, sessions, decode_sessions, form, prompt):
    """onnxruntime runs the decode graph step by step, as the page does (the main graph's
    kv_cache records are the first past, each step's kv_cache the next one's): the tokens are
    `generate`'s greedy ones, each step's logits within 1e-4 of generate's (measured: at most
    4.4e-5), and the cache the step returns is the library's cache after that step."""
    from llmtrace_book import generate

    web = export.verify(web_dir, form)
    step = web["decode"]
    assert step["past_shape"] == [1, "P", embedded.config.n_kv_heads, embedded.config.head_dim]
    ids = embedded.encode(prompt)  # [1, T]
    n = 12
    g = generate(embedded, ids, max_new_tokens=n, stop_at_eos=False, trace=True)
    new, chosen_from = export.onnx_greedy(web, sessions[form], decode_sessions[form],
                                          ids.numpy(), n)
    assert new == g.new_ids
    for got, want in zip(chosen_from, g.step_logits):
        assert np.abs(got - want.numpy()).max() <= 1e-4
    # the last step's cache out equals the library's cache as generate's last step read it
    past = {f"past.{i}.{kv}": g.steps[-2][f"layers.{i}.attn.kv_cache.{kv}"].numpy()
            for i in range(embedded.config.n_layers) for kv in "kv"}
    out = decode_sessions[form].run(["layers.29.attn.kv_cache.v"],
                                    {"ids": np.array([[g.ids[-2]]]), **past})
    want = g.steps[-1]["layers.29.attn.kv_cache.v"].numpy()  # [1, T + n - 1, KV, hd]
    assert out[0].shape == want.shape == (1, ids.shape[1] + n - 1, 3, 64)
    assert relative_error(want, out[0]) <= RTOL


@pytest.mark.parametrize("form", FORMS)
def test_the_decode_graph_reads_the_main_graphs_bytes(web_dir, form):
    """The decode graph holds no weight of its own: each large initializer is a reference into
    the main graph's data file, at the offsets of the main graph's tensor with the same bytes."""
    import onnx

    web = export.verify(web_dir, form)
    def where(init) -> tuple:
        return tuple((e.key, e.value) for e in init.external_data) + tuple(init.dims)

    main = {where(i) for i in onnx.load(str(web_dir / web["graph"]["file"]),
                                        load_external_data=False).graph.initializer}
    step = onnx.load(str(web_dir / web["decode"]["graph"]["file"]), load_external_data=False)
    assert web["decode"]["graph"]["size"] < 3e6  # nodes and their source lines
    shared = [i for i in step.graph.initializer if i.external_data]
    assert sum(len(i.raw_data) for i in step.graph.initializer) < 1e4  # shapes, RoPE freq
    assert len(shared) >= 7 * 30  # every layer's seven matrices at least
    for init in shared:
        assert where(init) in main
        assert {e.key: e.value for e in init.external_data}["location"] == web["external_data"]


@pytest.mark.parametrize("form", FORMS)
def test_manifest(embedded, web_dir, form):
    """Each manifest says what the page needs: the model's config, the graph, every chunk (at
    most 50 MB, all but the last full) and the files, each with its size and SHA-256."""
    web = export.verify(web_dir, form)
    c = embedded.config
    assert web["format"] == 1 and web["input"] == "ids"
    assert web["model"] == "SmolLM2-135M-Instruct" and web["logits"] == "lm_head"
    assert web["config"] == {
        "vocab_size": c.vocab_size, "n_layers": c.n_layers, "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "hidden_size": c.hidden_size,
        "max_context": c.max_positions, "bos_id": c.bos_id,
        "add_bos": embedded.tokenizer.add_bos, "eos_ids": list(c.end_ids)}
    sizes = [ch["size"] for ch in web["chunks"]]
    assert max(sizes) <= 50_000_000 and set(sizes[:-1]) == {export.CHUNK_BYTES}
    assert [ch["file"] for ch in web["chunks"]] == [f"{web['external_data']}.{i:03d}"
                                                   for i in range(len(sizes))]
    params = sum(t.numel() for t in state_dict_from_weights(c, embedded.weights).values())
    download = web["graph"]["size"] + sum(sizes) + web["tokenizer"]["size"]
    if form == "web-fp32.json":  # every weight in fp32: 134.5M parameters, 538 MB
        assert web["weights"] == "fp32" and sum(sizes) >= 4 * params
    else:  # the page's form: at most 150 MB to download (measured: 120 MB)
        assert web["weights"].startswith("Q4_1 blocks (MatMulNBits)")
        assert web["graph"]["file"] == "model.onnx" and web["external_data"] == "model.onnx.data"
        assert web["fp32"] == "web-fp32.json" and download <= 150e6
    # the exporter's versions are the pinned ones
    pins = Path(__file__).parents[1] / "requirements.txt"
    for package in ("onnx", "onnxscript"):
        assert f"{package}=={web['exported_with'][package]}" in pins.read_text()


def test_tokenizer_file_is_the_models(embedded, web_dir):
    """tokenizer.json, read back by `tokenizers`, gives the model's own ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(web_dir / "tokenizer.json"))
    settings = json.loads((web_dir / "tokenizer_config.json").read_text())
    assert settings["add_bos_token"] == embedded.tokenizer.add_bos
    assert tok.token_to_id(settings["eos_token"]) == embedded.config.eos_id
    for text in (*PROMPTS, PROMPT, "na\u00efve caf\u00e9 \U0001F468\u200d\U0001F469 \t\t x\r\n"):
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == embedded.tokenizer.encode(text)


@pytest.fixture
def copy_of(web_dir, tmp_path):
    """The export as links to the cache's files, except one chunk copied, to break safely."""
    def make(chunk: str) -> Path:
        d = tmp_path / "web"
        d.mkdir()
        for f in web_dir.iterdir():
            (d / f.name).symlink_to(f)
        (d / chunk).unlink()
        shutil.copyfile(web_dir / chunk, d / chunk)
        return d
    return make


def test_a_broken_chunk_is_refused(copy_of, web):
    name = web["chunks"][1]["file"]
    d = copy_of(name)
    with open(d / name, "r+b") as f:  # one byte changed, same size
        f.seek(12_345)
        byte = f.read(1)
        f.seek(12_345)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(LlmTraceError, match=f"{name} does not have the SHA-256"):
        export.session(d)
    with open(d / name, "r+b") as f:  # cut short
        f.truncate(1000)
    with pytest.raises(LlmTraceError, match=f"{name} has 1,000 bytes, not 50,000,000"):
        export.verify(d)
    (d / name).unlink()
    assert "is missing" in one_line(pytest.raises(LlmTraceError, export.verify, d))


def test_unsupported_models_are_refused(tiny):
    with pytest.raises(LlmTraceError) as err:
        export.export_onnx(meta_model("tinyllama-1.1b"), Path("unused.onnx"))
    assert "meta device" in one_line(err)
    half = Model(tiny.config, weights_from_state_dict(
        tiny.config, {k: v.bfloat16() for k, v in
                      state_dict_from_weights(tiny.config, tiny.weights).items()}))
    with pytest.raises(LlmTraceError) as err:
        export.export_onnx(half, Path("unused.onnx"))
    assert "bfloat16 weights" in one_line(err)
    with pytest.raises(LlmTraceError) as err:  # TinyLlama's tokenizer is SentencePiece
        export.write_tokenizer(tiny, Path("unused"))
    assert "has no tokenizer.json" in one_line(err)


def test_the_normal_pass_is_unchanged(embedded, web_dir):
    """After an export in this process, ids are checked again, and a trace keeps its MACs."""
    with pytest.raises(LlmTraceError, match="token id 49152 is outside the vocabulary"):
        embedded.forward(torch.tensor([[49152]]))
    _, trace = embedded.run(PROMPT, keep_values=False)
    assert trace.get("layers.0.attn.q_proj").macs == 5 * 576 * 576


def test_command_reuses_the_cache_and_places_the_files(web_dir, web, tmp_path):
    """`python -m llmtrace_book.export --out DIR`: no second export, the page's files in DIR (links to
    the cache's), and a DIR that holds something else refused in one line."""
    manifest = (web_dir / "manifest.json").stat().st_mtime_ns
    out = tmp_path / "site" / "_static" / "web"
    run = subprocess.run([sys.executable, "-m", "llmtrace_book.export", "--out", str(out)],
                         capture_output=True, text=True, env=process_env(), timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"{web_dir}: SmolLM2-135M-Instruct (Q4_1 blocks")
    assert "905 records, 3 chunks" in run.stdout
    assert (web_dir / "manifest.json").stat().st_mtime_ns == manifest  # not made again
    listed = set()
    for form in FORMS:
        w = export.verify(out, form)
        listed |= {w["graph"]["file"], *(c["file"] for c in w["chunks"]), w["tokenizer"]["file"],
                   w["tokenizer_config"]["file"], w["lens"]["graph"]["file"],
                   w["decode"]["graph"]["file"], w["lab"]["graph"]["file"], form}
    assert {f.name for f in out.iterdir()} == listed
    assert (out / "web.json").read_text() == (web_dir / "web.json").read_text()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    run = subprocess.run([sys.executable, "-m", "llmtrace_book.export", "--out",
                          str(tmp_path / "mine")], capture_output=True, text=True,
                         env=process_env(), timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("error: ")
    assert "holds no export" in run.stderr and len(run.stderr.splitlines()) == 1
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_blocks_are_the_ggufs():
    """Q4_1 as MatMulNBits reads it (scale d, float zero point -m/d) and Q8_0 as uint8 around
    128 give the weights gguf's own dequantize gives: Q8_0 exactly, Q4_1 within fp32 rounding.
    A block whose 32 weights are equal (d = 0) keeps its value."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 128)).astype(np.float32)  # [N, K]
    w[2, 32:64] = 0.37  # one flat block: d = 0
    rows = quantize(w, GGMLQuantizationType.Q4_1)  # [N, 4 blocks x 20 bytes]
    want = dequantize(rows, GGMLQuantizationType.Q4_1)
    packed, scale, zero = export.q4_1_as_matmul_nbits(rows, 128)
    assert packed.shape == (6, 4, 16) and scale.shape == zero.shape == (24,)
    got = export._dequantized_4(packed, scale, zero, 6, 128)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    assert (got[2, 32:64] == want[2, 32:64]).all() and scale[2 * 4 + 1] == want[2, 32]
    rows = quantize(w, GGMLQuantizationType.Q8_0)
    q, d = export.q8_0_as_uint8(rows, 128)
    assert q.shape == (6, 4, 32) and d.shape == (6, 4, 1)
    assert np.array_equal(((q.astype(np.float32) - 128) * d).reshape(6, 128),
                          dequantize(rows, GGMLQuantizationType.Q8_0))


def test_the_page_graph_holds_the_blocks(web_dir, embedded):
    """In the page's graph every weight matrix is the GGUF's blocks: 210 MatMulNBits of 4 bits
    (7 per layer), the head one of 8 bits, the embedding a GatherBlockQuantized on the same
    bytes; the MatMuls left are attention's own (no weight), and no fp32 matrix remains."""
    import onnx
    from collections import Counter

    graph = onnx.load(str(web_dir / "model.onnx"), load_external_data=False).graph
    c = embedded.config
    ops = Counter(n.op_type for n in graph.node)
    bits = Counter(next(a.i for a in n.attribute if a.name == "bits")
                   for n in graph.node if n.op_type == "MatMulNBits")
    assert bits == {4: 7 * c.n_layers, 8: 1} and ops["GatherBlockQuantized"] == 1
    weights = {i.name for i in graph.initializer}
    assert ops["MatMul"] == 2 * c.n_layers  # q @ k^T and weights @ v
    assert not any(i in weights for n in graph.node if n.op_type == "MatMul" for i in n.input)
    gather = next(n for n in graph.node if n.op_type == "GatherBlockQuantized")
    head = next(n for n in graph.node if n.op_type == "MatMulNBits" and n.output == ["lm_head"])
    assert gather.input[0] == head.input[1] == "model.embed_tokens.q8"
    floats = [math.prod(i.dims) for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    assert max(floats) == c.vocab_size * c.hidden_size // 32  # the largest: the table's scales


def test_quantized_export_needs_the_ggufs_kinds(embedded):
    with pytest.raises(LlmTraceError) as err:
        export.quantize_graph(Path("unused.onnx"), Path("unused.onnx"), {}, embedded)
    assert "tied Q8_0 embedding and Q4_1 layers" in one_line(err)


def test_each_node_names_its_source_from_the_package(web_dir):
    """The graph's nodes keep the exporter's stack trace (its first frames: the library's
    forward pass that made them), with paths from the package, none from this machine."""
    import onnx

    graph = onnx.load(str(web_dir / "model.onnx"), load_external_data=False).graph
    traces = [p.value for n in graph.node for p in n.metadata_props
              if p.key == "pkg.torch.onnx.stack_trace"]
    assert len(traces) > 0.8 * len(graph.node)  # all but the outputs' Identity copies, shapes
    assert not any('File "/' in t for t in traces)
    softmax = next(n for n in graph.node if n.op_type == "Softmax")
    where = next(p.value for p in softmax.metadata_props if p.key == "pkg.torch.onnx.stack_trace")
    assert where.startswith('File "llmtrace_book/export/graph.py"')
    assert 'File "llmtrace_book/model.py"' in where


def test_another_llama_exports_too(tiny, tmp_path):
    """The export is the library's pass, not the embedded model's: the tiny random checkpoint
    (2 layers, GQA 4/2, untied head) exports with the same records, and onnxruntime agrees."""
    import onnxruntime as ort

    records = export.export_onnx(tiny, tmp_path / "tiny.onnx")
    ids = torch.tensor([[1, 5, 9, 300, 7, 2, 11]])  # [1, 7]
    logits, trace = tiny.run(ids)
    assert [r["name"] for r in records] == trace.names
    sess = ort.InferenceSession(str(tmp_path / "tiny.onnx"), export.session_options(),
                                providers=["CPUExecutionProvider"])
    values = sess.run(None, {"ids": ids.numpy()})
    for rec, value in zip(trace, values):
        assert value.shape == rec.shape
        if rec.tensor.is_floating_point():
            assert relative_error(rec.tensor.numpy(), value) <= RTOL, rec.name
    assert np.abs(values[-1] - logits.numpy()).max() <= 1e-4
