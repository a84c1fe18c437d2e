"""The page's ONNX export (llmtrace.export): the graph is the trace, and its files are checked.

The export of the embedded model is made once (about 35 s) and kept in the cache; these tests reuse
it when it is there, as `make book` does.
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import PROMPT, one_line, process_env
from llmtrace import export, meta_model
from llmtrace.errors import LlmTraceError
from llmtrace.model import Model, state_dict_from_weights, weights_from_state_dict

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


@pytest.fixture(scope="module")
def session(web_dir):
    return export.session(web_dir)


def relative_error(ref: np.ndarray, got: np.ndarray) -> float:
    """|got - ref| / |ref| over the finite entries (the masks' -inf must match exactly)."""
    finite = np.isfinite(ref)
    assert np.array_equal(ref[~finite], got[~finite])
    ref, got = ref[finite].astype(np.float64), got[finite].astype(np.float64)
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.mark.parametrize("prompt, length", list(zip(PROMPTS, LENGTHS)))
def test_graph_is_the_trace(embedded, web, session, prompt, length):
    """Every output of the graph is a record of the trace: same name, order and shape at each
    length, and onnxruntime's values within 1e-5 of the trace's (measured: at most 9.0e-6, on
    1 token; 2.7e-6 on 6; 6.4e-6 on 46), the logits within the tolerance web.json states."""
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
    assert float(np.abs(values[-1] - logits.numpy()).max()) <= web["tolerance"]["logits"]
    assert int(values[-1][0, -1].argmax()) == int(logits[0, -1].argmax())


def test_manifest(embedded, web, web_dir):
    """web.json says what the page needs: the model's config, the graph, every chunk (at most
    50 MB, all but the last full) and the files, each with its size and SHA-256."""
    c = embedded.config
    assert web["format"] == 1 and web["weights"] == "fp32" and web["input"] == "ids"
    assert web["model"] == "SmolLM2-135M-Instruct" and web["logits"] == "lm_head"
    assert web["config"] == {
        "vocab_size": c.vocab_size, "n_layers": c.n_layers, "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "hidden_size": c.hidden_size,
        "max_context": c.max_positions, "bos_id": c.bos_id,
        "add_bos": embedded.tokenizer.add_bos, "eos_ids": list(c.end_ids)}
    sizes = [ch["size"] for ch in web["chunks"]]
    assert max(sizes) <= 50_000_000 and set(sizes[:-1]) == {export.CHUNK_BYTES}
    assert [ch["file"] for ch in web["chunks"]] == [f"model.onnx.data.{i:03d}"
                                                   for i in range(len(sizes))]
    # the chunks hold every weight, fp32: 134.5M parameters, 538 MB
    params = sum(t.numel() for t in
                 state_dict_from_weights(c, embedded.weights).values())
    assert sum(sizes) >= 4 * params
    assert export.verify(web_dir) == web
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
    name = web["chunks"][3]["file"]
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
    """`python -m llmtrace.export --out DIR`: no second export, the page's files in DIR (links to
    the cache's), and a DIR that holds something else refused in one line."""
    manifest = (web_dir / "manifest.json").stat().st_mtime_ns
    out = tmp_path / "site" / "_static" / "web"
    run = subprocess.run([sys.executable, "-m", "llmtrace.export", "--out", str(out)],
                         capture_output=True, text=True, env=process_env(), timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"{web_dir}: SmolLM2-135M-Instruct (fp32), 905 records")
    assert (web_dir / "manifest.json").stat().st_mtime_ns == manifest  # not made again
    listed = {web["graph"]["file"], *(c["file"] for c in web["chunks"]),
              web["tokenizer"]["file"], web["tokenizer_config"]["file"], "web.json"}
    assert {f.name for f in out.iterdir()} == listed
    assert export.verify(out) == web
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    run = subprocess.run([sys.executable, "-m", "llmtrace.export", "--out",
                          str(tmp_path / "mine")], capture_output=True, text=True,
                         env=process_env(), timeout=120)
    assert run.returncode == 2 and run.stderr.startswith("error: ")
    assert "holds no export" in run.stderr and len(run.stderr.splitlines()) == 1
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
