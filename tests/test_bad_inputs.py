"""Bad input of every kind: one line that says what was wrong and what to do, exit status 2 from
the CLI, an LlmTraceError from the API. Nothing half-written, nothing hanging, nothing wrong
printed as right. Checkpoints and caches are generated here, small, in temporary directories."""

import errno
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import llmtrace.load as load
from llmtrace import Config, LlmTraceError, generate, load_model, sample
from llmtrace.__main__ import main, parse_args, run_live
from llmtrace.disk_cache import MANIFEST, cache_dir, manifest_problem
from llmtrace.check import estimate_trace_bytes

sys.path.insert(0, str(Path(__file__).parent))
from tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

PROMPT = "The capital of France is"


def one_line(err) -> str:
    message = str(err.value if hasattr(err, "value") else err)
    assert message and "\n" not in message and "Traceback" not in message
    return message


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random-weight 2-layer Llama checkpoint with TinyLlama's tokenizer, made once."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture
def ckpt(tiny, tmp_path):
    """A copy of the tiny checkpoint this test may break."""
    return Path(shutil.copytree(tiny, tmp_path / "ckpt"))


def edit_config(d: Path, **changes) -> Path:
    c = json.loads((d / "config.json").read_text())
    c.update(changes)
    (d / "config.json").write_text(json.dumps(c))
    return d


@pytest.fixture
def cli(capsys, monkeypatch):
    """main(argv) in-process: (exit status, stdout, stderr)."""
    monkeypatch.delenv("LLMTRACE_MODEL", raising=False)

    def run(*argv):
        status = main(list(argv))
        out, err = capsys.readouterr()
        return status, out, err
    return run


def cli_error(status, out, err) -> str:
    assert status == 2 and out == ""
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
    return err


# --- the CLI: flags and prompts ---------------------------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["--model", "", PROMPT], "--model '' is empty: use one of auto, embedded, tinyllama"),
    (["--model", "   ", PROMPT], "is empty: use one of auto"),
    (["--layers", "0", PROMPT], "--layers must be at least 1, got 0 (--all-layers shows every"),
    (["--layers", "-3", PROMPT], "--layers must be at least 1"),
    (["--seed", "-1", PROMPT], "seed must be from 0 to 2**64 - 1"),
    (["--seed", str(2**64), PROMPT], "take it modulo 2**64"),
    (["--temperature", "nan", PROMPT], "temperature must be a finite number, got nan"),
    (["--temperature", "inf", PROMPT], "temperature must be a finite number"),
    (["--top-p", "nan", PROMPT], "top_p must be a finite number, got nan"),
    (["--max-new-tokens", "0", PROMPT], "--max-new-tokens must be at least 1"),
    (["--seed", "x", PROMPT], "--seed: invalid int value: 'x': see python -m llmtrace --help"),
    (["--max-new-tokens", "2.5", PROMPT], "invalid int value: '2.5'"),
    ([], "the following arguments are required: prompt"),
    (["--model", "embedded", ""], "the prompt is empty: give at least one character"),
    (["--model", "embedded", "caf\udce9"], "not valid UTF-8 (byte 0xe9 at character 3): pass"),
    (["--shapes-only", "--model", "gpt-5", PROMPT], "unknown config 'gpt-5': choose one of"),
    (["--model", "no/such/dir", PROMPT], "unknown model 'no/such/dir'"),
])
def test_cli_flags(cli, argv, says):
    err = cli_error(*cli(*argv))
    assert says in err


def test_cli_blank_environment_model(cli, monkeypatch):
    monkeypatch.setenv("LLMTRACE_MODEL", "   ")
    err = cli_error(*cli(PROMPT))
    assert "LLMTRACE_MODEL='   ' is blank: unset it, or set it to one of auto, embedded" in err


def test_cli_ctrl_c_is_one_line_and_130(cli, monkeypatch, tiny):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr("llmtrace.__main__.run_live", interrupted)
    status, out, err = cli("--model", str(tiny), PROMPT)
    assert status == 130 and out == "" and err == "error: interrupted\n"


def test_cli_escape_sequences_never_reach_the_terminal(cli, tiny):
    prompt = "\x1b]0;owned\x07\x1b[2J hi"  # retitle the window, clear the screen
    status, out, err = cli("--model", str(tiny), "--max-new-tokens", "2", prompt)
    assert status == 0, err
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b]0;owned\\x07\\x1b[2J hi" in out  # the prompt, echoed with its escapes visible


def test_cli_ascii_stdout(cli, monkeypatch, tiny):
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    status = main(["--model", str(tiny), "--max-new-tokens", "2", "café ☕"])
    text = raw.getvalue().decode("ascii")
    assert status == 0
    assert "caf\\xe9 \\u2615" in text  # what ASCII cannot show is escaped, not a crash


def test_cli_stdout_write_error(cli, monkeypatch, tiny):
    class Full(io.StringIO):
        def write(self, s):
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(sys, "stdout", Full())
    status = main(["--model", str(tiny), "--max-new-tokens", "1", PROMPT])
    monkeypatch.undo()
    assert status == 2


def test_cli_dev_full_in_a_process(tiny):
    """stdout on a full disk, a non-ASCII prompt under the C locale: one line, status 2, no
    warning at exit."""
    with open("/dev/full", "w") as full:
        argv = [sys.executable, "-m", "llmtrace", "--model", str(tiny), "--max-new-tokens", "1",
                "Paris, café ☕"]
        r = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
                           env={**os.environ, "LC_ALL": "C"})
    assert r.returncode == 2
    assert r.stderr == ("error: cannot write the output (No space left on device): "
                        "check where stdout goes\n")


def test_cli_json_is_valid(cli, tiny):
    status, out, err = cli("--model", str(tiny), "--max-new-tokens", "2", "--json", "café")
    assert status == 0, err
    assert "".join(json.loads(out)["input_pieces"]).endswith("café")


def test_cli_nan_weights_name_the_op(cli, ckpt):
    nan_weight(ckpt, "model.layers.1.mlp.down_proj.weight")
    err = cli_error(*cli("--model", str(ckpt), PROMPT))
    assert "the output of layers.1.mlp.down is not finite (NaN or inf)" in err
    assert "check the weights that op reads" in err
    err = cli_error(*cli("--model", str(ckpt), "--json", PROMPT))  # no bare NaN: no output at all
    assert "layers.1.mlp.down" in err


def test_cli_tiny_temperature(cli, tiny):
    greedy = cli("--model", str(tiny), "--max-new-tokens", "3", "--json", PROMPT)
    cold = cli("--model", str(tiny), "--max-new-tokens", "3", "--json", "--temperature", "1e-45",
               PROMPT)
    assert greedy[0] == cold[0] == 0
    assert json.loads(greedy[1])["generated_ids"] == json.loads(cold[1])["generated_ids"]


def test_cli_keeps_only_the_first_step(tiny):
    args = parse_args(["--model", str(tiny), "--max-new-tokens", "6", PROMPT])
    out = run_live(args)
    g = out["generation"]
    assert len(g.new_ids) == 6 and len(g.steps) == 1 and len(g.step_logits) == 1
    assert out["trace"].label == "prefill" and out["trace"].records[0].tensor is None


# --- loaders: config.json -----------------------------------------------------------------
@pytest.mark.parametrize("change, says", [
    ({"hidden_size": "64"}, "hidden_size must be an integer, got '64'"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers must be an integer, got 2.5"),
    ({"tie_word_embeddings": "no"}, "tie_word_embeddings must be true or false"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a number"),
    ({"num_attention_heads": 0}, "n_heads=0 must be at least 1"),
    ({"num_key_value_heads": 3}, "n_heads=4 is not a multiple of n_kv_heads=3"),
    ({"rope_theta": -10000.0, "rope_parameters": None}, "rope_theta=-10000 must be positive"),
    ({"bos_token_id": 99999}, "bos_id=99999 is not below vocab_size=32000"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling of type 'llama3'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_scaling of type 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not implemented"),
    ({"attention_bias": True}, "attention_bias=true (projections with a bias vector) is not"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"sliding_window": 128}, "sliding_window=128 (attention to the last 128 positions only)"),
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not a Llama-family model"),
])
def test_config_values(ckpt, change, says):
    edit_config(ckpt, **change)
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert says in one_line(err)


def test_unsupported_says_what_is_computed(ckpt):
    edit_config(ckpt, rope_scaling={"rope_type": "llama3"})
    with pytest.raises(LlmTraceError, match="llmtrace computes the Llama-2 architecture"):
        load_model(ckpt)


def test_sliding_window_as_long_as_the_context_is_full_attention(ckpt):
    edit_config(ckpt, sliding_window=256)  # = max_position_embeddings: never slides
    assert load_model(ckpt).config.max_positions == 256


@pytest.mark.parametrize("content, says", [
    ("{not json", "config.json is not valid JSON"),
    ("[1, 2]", "holds a list, not an object of settings"),
    (json.dumps({"model_type": "llama"}), "lacks 'vocab_size': a Llama config.json names it"),
])
def test_config_file(ckpt, content, says):
    (ckpt / "config.json").write_text(content)
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert says in one_line(err)


def test_config_dataclass_validates_before_dividing():
    with pytest.raises(LlmTraceError, match=r"n_heads=0 must be at least 1; n_kv_heads=0 must be"):
        Config("x", 100, 64, 2, 0, 0, 128, 256)


# --- loaders: weights and tokenizers --------------------------------------------------------
def nan_weight(d: Path, name: str):
    from safetensors.torch import load_file, save_file

    sd = load_file(d / "model.safetensors")
    sd[name] = torch.full_like(sd[name], float("nan"))
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})


def test_truncated_safetensors(ckpt):
    f = ckpt / "model.safetensors"
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 1000)
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert "is not a complete safetensors file" in one_line(err)
    assert "download it again" in str(err.value)


def test_safetensors_garbage(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(LlmTraceError, match="its header is unreadable"):
        load_model(ckpt)


def test_int8_weights_are_refused(ckpt):
    from safetensors.torch import load_file, save_file

    sd = load_file(ckpt / "model.safetensors")
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].to(torch.int8)
    save_file(sd, ckpt / "model.safetensors")
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert "up_proj.weight is I8, not a float type" in one_line(err)
    assert "use an fp32, fp16 or bf16 checkpoint" in str(err.value)


@pytest.mark.parametrize("index, says", [
    ({"metadata": {}}, "has no weight_map (tensor name -> shard file)"),
    ({"weight_map": []}, "has no weight_map"),
    ("{broken", "model.safetensors.index.json is not valid JSON"),
    ({"weight_map": {"model.norm.weight": "m-2.safetensors"}}, "shard m-2.safetensors named in"),
])
def test_index(ckpt, index, says):
    (ckpt / "model.safetensors").unlink()
    text = index if isinstance(index, str) else json.dumps(index)
    (ckpt / "model.safetensors.index.json").write_text(text)
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert says in one_line(err)


@pytest.mark.parametrize("file, content, says", [
    ("tokenizer.model", b"\x00garbage" * 100, "the tokenizer file cannot be read"),
    ("tokenizer_config.json", b"{", "tokenizer_config.json is not valid JSON"),
    ("tokenizer_config.json", b"[]", "not an object of settings"),
])
def test_tokenizer_files(ckpt, file, content, says):
    (ckpt / file).write_bytes(content)
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert says in one_line(err)


def test_corrupt_tokenizer_json(ckpt):
    (ckpt / "tokenizer.model").unlink()
    (ckpt / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 7}}')
    with pytest.raises(LlmTraceError, match="tokenizer file cannot be read .*download it again"):
        load_model(ckpt)


def test_tokenizer_larger_than_the_vocabulary(ckpt):
    edit_config(ckpt, vocab_size=1000)
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert "tokenizer has 32,000 pieces but the model's embedding only 1,000 rows" in one_line(err)


def write_gguf(path: Path, tokens=True, merges=True, int8=False, heads=4):
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.vocab_size", 8)
    w.add_uint32("llama.embedding_length", 8)
    w.add_uint32("llama.block_count", 1)
    w.add_uint32("llama.attention.head_count", heads)
    w.add_uint32("llama.attention.head_count_kv", 2)
    w.add_uint32("llama.feed_forward_length", 16)
    w.add_uint32("llama.context_length", 32)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_string("tokenizer.ggml.model", "gpt2")
    if tokens:
        w.add_array("tokenizer.ggml.tokens", ["a", "b", "c", "d", "ab", "cd", "<s>", "</s>"])
        w.add_array("tokenizer.ggml.token_type", [1] * 6 + [3, 3])
    if merges:
        w.add_array("tokenizer.ggml.merges", ["a b", "c d"])
    w.add_tensor("token_embd.weight", np.ones((8, 8), dtype=np.int8 if int8 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind, says", [
    (dict(tokens=False), "lacks tokenizer.ggml.tokens: the file has no complete tokenizer"),
    (dict(merges=False), "lacks tokenizer.ggml.merges: the file has no complete tokenizer"),
    (dict(int8=True), "token_embd.weight holds raw I8 integers"),
    (dict(heads=0), "n_heads=0 must be at least 1"),
])
def test_gguf_contents(tmp_path, kind, says):
    write_gguf(tmp_path / "m.gguf", **kind)
    with pytest.raises(LlmTraceError) as err:
        load_model(tmp_path / "m.gguf")
    assert says in one_line(err)


def test_gguf_garbage_and_upper_case(tmp_path):
    (tmp_path / "M.GGUF").write_bytes(b"GGUF" + b"\xff" * 64)  # read as GGUF, not as a directory
    with pytest.raises(LlmTraceError) as err:
        load_model(tmp_path / "M.GGUF")
    assert "cannot read" in one_line(err) and "as GGUF" in str(err.value)


def test_fifo_named_gguf_does_not_hang(tmp_path):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    start = time.perf_counter()
    with pytest.raises(LlmTraceError) as err:
        load_model(fifo)
    assert "is neither a regular file nor a directory" in one_line(err)
    assert time.perf_counter() - start < 1


def test_a_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 10)
    with pytest.raises(LlmTraceError, match="is a file but not a .gguf one"):
        load_model(tmp_path / "weights.bin")


def test_tinyllama_label_on_another_model(tiny, monkeypatch):
    monkeypatch.setenv("LLMTRACE_TINYLLAMA", str(tiny))
    with pytest.raises(LlmTraceError) as err:
        load_model("tinyllama")
    assert "is not TinyLlama-1.1B: hidden_size=64 (TinyLlama: 2048)" in one_line(err)
    assert "point LLMTRACE_TINYLLAMA at TinyLlama" in str(err.value)


# --- the API ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny):
    return load_model(Path(tiny))  # a Path, as the docstring promises


@pytest.mark.parametrize("name, says", [
    (123, "load_model takes a model name or a path (str or pathlib.Path), got int"),
    (b"embedded", "got bytes"),
    ("", "the model name is empty"),
    ("  ", "the model name is empty"),
])
def test_load_model_argument(name, says):
    with pytest.raises(LlmTraceError) as err:
        load_model(name)
    assert says in one_line(err)


@pytest.mark.parametrize("ids, says", [
    ([[1, 32000]], "token id 32000 is outside the vocabulary (0 .. 31999)"),
    ([[1, -5]], "token id -5 is outside the vocabulary"),
    ([[1.0, 2.0]], "token ids must be integers, got float32: convert them with .long()"),
    ([[1, 2], [3, 4]], "must be one sequence, shape [T] or [1, T], got [2, 2]"),
    ([[]], "no token ids: give at least one"),
    ("tokens", None),  # a str is a prompt: it is encoded, not refused
    (b"\x01\x02", "token ids must be a list or tensor of integers"),
    ([[1, "a"]], "token ids must be a list or tensor of integers"),
])
def test_token_ids(model, ids, says):
    if says is None:
        n = len(model.tokenizer.encode(ids))
        assert model.run(ids, keep_values=False)[0].shape[:2] == (1, n)
        return
    with pytest.raises(LlmTraceError) as err:
        model.run(ids)
    assert says in one_line(err)
    with pytest.raises(LlmTraceError, match="token"):
        generate(model, ids, 2)


def test_one_dimensional_ids_are_one_sequence(model):
    logits, trace = model.run(torch.tensor([1, 450, 7483]), keep_values=False)
    assert logits.shape == (1, 3, 32000) and trace.shape("tokens") == (1, 3)


@pytest.mark.parametrize("kwargs, says", [
    (dict(max_new_tokens=2.5), "max_new_tokens must be an integer, got 2.5 (float)"),
    (dict(temperature="0.5"), "temperature must be a number, got '0.5' (str)"),
    (dict(top_k=1.5), "top_k must be an integer"),
    (dict(top_p="all"), "top_p must be a number"),
    (dict(seed=2**64), "seed must be from 0 to 2**64 - 1"),
    (dict(seed=-1), "seed must be from 0"),
    (dict(seed="7"), "seed must be an integer"),
])
def test_generate_arguments(model, kwargs, says):
    with pytest.raises(LlmTraceError) as err:
        generate(model, PROMPT, **{"max_new_tokens": 2, **kwargs})
    assert says in one_line(err)


@pytest.mark.parametrize("temperature", [1e-30, 1e-39, 1e-45, 5e-324])
def test_any_positive_temperature(model, temperature):
    greedy = generate(model, PROMPT, 4, keep_steps=False).new_ids
    cold = generate(model, PROMPT, 4, temperature=temperature, seed=3, keep_steps=False)
    assert cold.new_ids == greedy


def test_sample_refuses_nan_logits():
    with pytest.raises(LlmTraceError, match="the logits hold NaN or \\+inf"):
        sample(torch.tensor([0.0, float("nan")]), 1.0)
    masked = torch.tensor([float("-inf"), 2.0, float("-inf")])  # -inf is a mask, not an error
    assert sample(masked, 0.7, generator=torch.Generator().manual_seed(0)) == 1


def test_trace_lookups(model):
    _, trace = model.run(PROMPT)
    with pytest.raises(LlmTraceError) as err:
        trace[0]
    assert "look a record up by its name" in one_line(err) and "trace.records[i]" in str(err.value)
    with pytest.raises(LlmTraceError) as err:
        trace["layers.1.attn.weight"]
    assert "did you mean layers.1.attn.weights" in one_line(err)
    assert "layers.0." not in str(err.value)  # the suggestions come from the layer asked for
    with pytest.raises(LlmTraceError, match="this trace has layers 0..1"):
        trace["layers.7.attn.weights"]


def test_nan_weights_name_the_first_op(ckpt):
    nan_weight(ckpt, "model.layers.0.self_attn.v_proj.weight")
    m = load_model(ckpt)
    for run in (lambda: m.run(PROMPT), lambda: m.run(PROMPT, keep_values=False),
                lambda: generate(m, PROMPT, 3, keep_steps=False)):  # untraced: found by a traced re-run
        with pytest.raises(LlmTraceError) as err:
            run()
        assert "the output of layers.0.attn.v_proj is not finite" in one_line(err)


def test_trace_size_budget(model, monkeypatch):
    monkeypatch.setenv("LLMTRACE_TRACE_BUDGET", "1M")
    ids = torch.ones(1, 100, dtype=torch.long)
    with pytest.raises(LlmTraceError) as err:
        model.run(ids)
    message = one_line(err)
    assert "over the budget of 0.0 GiB" in message
    assert "names=['layers.3.*']" in message and "keep_values=False" in message
    assert model.run(ids, keep_values=False)[0].shape == (1, 100, 32000)  # shapes only: no limit
    _, kept = model.run(ids, names="layers.0.attn.*")  # a filter: the user chose what to keep
    assert kept["layers.0.attn.scores"].shape == (1, 4, 100, 100)
    monkeypatch.setenv("LLMTRACE_TRACE_BUDGET", "lots")
    with pytest.raises(LlmTraceError, match="is not a size: write e.g. 8G"):
        model.run(ids)


def test_trace_size_estimate_matches_the_trace(model):
    _, trace = model.run(torch.ones(1, 40, dtype=torch.long))
    kept = sum(r.tensor.numel() * r.tensor.element_size() for r in trace if r.tensor is not None)
    assert estimate_trace_bytes(model.config, 40) == kept


def test_embedded_trace_of_2048_tokens_is_refused_first(embedded, monkeypatch):
    monkeypatch.setenv("LLMTRACE_TRACE_BUDGET", "8G")
    start = time.perf_counter()
    with pytest.raises(LlmTraceError, match="about 16.9 GiB, over the budget of 8.0 GiB"):
        embedded.run(torch.ones(1, 2048, dtype=torch.long))
    assert time.perf_counter() - start < 0.5


# --- the cache ------------------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch, embedded):
    """An empty cache, and a conversion that takes no ten seconds: a 1-layer model with the
    embedded vocabulary stands in for the GGUF. `calls` counts conversions."""
    from llmtrace.config import expected_shapes

    monkeypatch.setenv("LLMTRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "_embedded", None)
    config = Config("smollm2-135m", 49152, 64, 1, 4, 2, 128, 256, tied_lm_head=True)
    sd = {k: torch.randn(s) for k, s in expected_shapes(config).items()}
    calls = []

    def fake_load_gguf(path=None, name=None):
        calls.append(time.perf_counter())
        time.sleep(0.2)  # long enough for two threads to meet
        return config, sd, embedded.tokenizer
    monkeypatch.setattr("llmtrace.weights.gguf.load_gguf", fake_load_gguf)
    return calls


def test_cache_builds_with_a_manifest_and_readable_files(cache):
    d = models.embedded_checkpoint()
    assert len(cache) == 1 and manifest_problem(d) is None
    assert sorted(json.loads((d / MANIFEST).read_text())["files"]) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert {oct(f.stat().st_mode & 0o777) for f in d.iterdir()} == {"0o644"}
    assert models.embedded_checkpoint() == d and len(cache) == 1  # valid: not built again


@pytest.mark.parametrize("damage", ["truncate", "delete config", "delete manifest", "bad manifest"])
def test_cache_fault_is_repaired_by_the_next_run(cache, damage):
    d = models.embedded_checkpoint()
    if damage == "truncate":
        with open(d / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    elif damage == "delete config":
        (d / "config.json").unlink()
    elif damage == "delete manifest":  # and the checkpoint is cut short too: not adopted
        (d / MANIFEST).unlink()
        with open(d / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    else:
        (d / MANIFEST).write_text("{")
    assert manifest_problem(d) is not None
    model = models._load_embedded()
    assert len(cache) == 2 and manifest_problem(d) is None
    assert model.config.n_layers == 1


def test_cache_entry_from_before_manifests_is_kept(cache):
    d = models.embedded_checkpoint()
    (d / MANIFEST).unlink()
    assert models.embedded_checkpoint() == d and len(cache) == 1 and manifest_problem(d) is None


def test_cache_content_corrupt_at_the_same_size_is_rebuilt(cache):
    d = models.embedded_checkpoint()
    tok = d / "tokenizer.json"
    tok.write_bytes(b"x" * tok.stat().st_size)  # the manifest's sizes cannot see this
    assert models._load_embedded().tokenizer.encode(PROMPT) == [504, 3575, 282, 4649, 314]
    assert len(cache) == 2


def test_stale_temporaries_are_collected(cache):
    dead = subprocess.Popen(["true"])
    dead.wait()
    root = cache_dir()
    name = "smollm2-135m-fp32-" + str(models.embedded_checkpoint().name.rsplit("-", 1)[1])
    stale = root / f".{name}.{dead.pid}.abc123"
    alive = root / f".{name}.{os.getppid()}.def456"  # a conversion still running elsewhere
    for d in (stale, alive):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 1000)
    models.embedded_checkpoint()
    assert not stale.exists() and alive.exists()


def test_two_threads_convert_and_load_once(cache):
    got = []
    def load():
        got.append(models._load_embedded())
    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 1 and got[0] is got[1]


def test_cache_that_is_a_file(cache, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("LLMTRACE_CACHE", str(tmp_path / "afile"))
    with pytest.raises(LlmTraceError) as err:
        models.embedded_checkpoint()
    assert "is a file, not a directory: move it away, or set LLMTRACE_CACHE" in one_line(err)
    assert cache == []


def test_read_only_cache_fails_before_the_parse(cache, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr("llmtrace.disk_cache.tempfile.mkstemp", refuse)
    with pytest.raises(LlmTraceError) as err:
        models.embedded_checkpoint()
    assert "cannot write in the cache" in one_line(err) and "Permission denied" in str(err.value)
    assert cache == []  # refused before the slow parse


def test_full_cache_fails_before_the_parse(cache, monkeypatch):
    def one_mib_free(d):
        return shutil._ntuple_diskusage(2**40, 2**40 - 2**20, 2**20)
    monkeypatch.setattr("llmtrace.disk_cache.shutil.disk_usage", one_mib_free)
    with pytest.raises(LlmTraceError) as err:
        models.embedded_checkpoint()
    assert "has 1 MiB free, 529 MiB are needed: free some space" in one_line(err)
    assert cache == []


def test_disk_full_while_writing_leaves_nothing(cache, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("llmtrace.weights.hf.save_hf", full)
    with pytest.raises(LlmTraceError) as err:
        models.embedded_checkpoint()
    assert "is full: free some space, or set LLMTRACE_CACHE to another disk" in one_line(err)
    assert [p.name for p in cache_dir().iterdir() if not p.name.startswith(".lock")] == []


def test_truncated_tokenizer_model_is_rebuilt(tmp_path, monkeypatch):
    from llmtrace.weights.tokenizer_llama import LLAMA2_BYTES, build, vocab_dir

    source, built = vocab_dir(), build(fetch=False)
    monkeypatch.setenv("LLMTRACE_CACHE", str(tmp_path))
    shutil.copytree(source, vocab_dir())
    target = tmp_path / "tinyllama" / "tokenizer.model"
    target.parent.mkdir()
    target.write_bytes(built.read_bytes()[:1000])  # cut short
    assert build(fetch=False).stat().st_size == LLAMA2_BYTES
    assert oct(target.stat().st_mode & 0o777) == "0o644"


def test_damaged_vocabulary_is_removed_and_named(tmp_path, monkeypatch):
    from llmtrace.weights.tokenizer_llama import VOCAB, build, vocab_dir

    monkeypatch.setenv("LLMTRACE_CACHE", str(tmp_path))
    vocab_dir().mkdir()
    (vocab_dir() / VOCAB).write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 100)
    with pytest.raises(LlmTraceError) as err:
        build(fetch=False)
    assert "was damaged (" in one_line(err) and "is now removed: run `" in str(err.value)
    assert not vocab_dir().exists()


def test_messages_name_a_command_that_exists_here(tmp_path, monkeypatch):
    from llmtrace.weights.tokenizer_llama import build

    monkeypatch.setenv("LLMTRACE_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # outside the checkout: there is no `make setup` here
    with pytest.raises(LlmTraceError) as err:
        build(fetch=False)
    assert "-m llmtrace.weights.tokenizer_llama`" in one_line(err) and "make" not in str(err.value)
