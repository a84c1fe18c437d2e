"""python -m llmtrace_book: the table and the text, --json, and one-line errors. In-process through
`main(argv)`, but for one true subprocess: the exit code and stdout as a shell sees them."""

import json
import subprocess
import sys

import pytest

from llmtrace_book.__main__ import main
from helpers import PROMPT, process_env


def run(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_process_greedy_paris():
    args = ["--model", "embedded", "--max-new-tokens", "4", PROMPT]
    r = subprocess.run([sys.executable, "-m", "llmtrace_book", *args], capture_output=True, text=True,
                       timeout=300, env=process_env())
    assert r.returncode == 0, r.stderr
    assert "layers.0.attn.scores" in r.stdout and "[1, 9, 5, 5]" in r.stdout
    assert "The capital of France is Paris." in r.stdout
    assert "7042  ' Paris'" in r.stdout


def test_cli_json(capsys):
    code, stdout, err = run(capsys, "--model", "embedded", "--max-new-tokens", "3", "--json",
                            PROMPT)
    assert code == 0, err
    out = json.loads(stdout)
    assert out["model"] == "smollm2-135m-instruct" and out["config"]["n_layers"] == 30
    assert out["input_ids"] == [504, 3575, 282, 4649, 314]
    assert out["input_pieces"][1] == " capital"
    assert out["generated_ids"][0] == 7042 and out["generated_text"].startswith(" Paris")
    top = out["top10"]
    assert len(top) == 10 and top[0]["piece"] == " Paris" and 0.75 < top[0]["prob"] < 0.80
    rec = {r["name"]: r for r in out["trace"]}
    assert rec["layers.29.attn.weights"]["shape"] == [1, 9, 5, 5]
    assert rec["lm_head"]["macs"] == 5 * 576 * 49152 and rec["lm_head"]["dtype"] == "float32"


@pytest.mark.parametrize("args, message", [
    (["--model", "embedded", ""], "error: the prompt is empty"),
    (["--model", "gpt-5", "hi"], "error: unknown model 'gpt-5'"),
    (["--temperature", "-1", "hi"], "error: temperature must be >= 0"),
    (["--top-p", "1.5", "hi"], "error: top_p must be in (0, 1]"),
    (["--top-k", "0", "hi"], "error: top_k must be at least 1"),
    (["--model", "embedded", "--max-new-tokens", "9000", "hi"], "exceed smollm2-135m-instruct's context of 8192"),
])
def test_cli_errors_are_one_line(capsys, args, message):
    code, _, err = run(capsys, *args)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_shapes_only_tinyllama(capsys):
    code, stdout, err = run(capsys, "--shapes-only", PROMPT)
    assert code == 0, err
    assert "tinyllama-1.1b" in stdout and "450:' The'" in stdout
    rows = [line for line in stdout.splitlines() if line.startswith("layers.0.attn.scores ")]
    assert "[1, 32, 6, 6]" in rows[0] and "73,728" in rows[0]  # the table: shape and MACs
    assert "[1, 32, 6, 6]" in rows[1] and "[1, 32, 1, 7]" in rows[1]  # prefill vs decode 1
    _, stdout, _ = run(capsys, "--shapes-only", "--json", PROMPT)
    out = json.loads(stdout)
    assert out["input_ids"] == [1, 450, 7483, 310, 3444, 338]
    shapes = {x["name"]: x["shape"] for x in out["trace"]}
    assert shapes["layers.21.attn.k_expanded"] == [1, 32, 6, 64] and shapes["lm_head"] == [1, 6, 32000]
    assert {x["name"]: x["shape"] for x in out["decode_trace"]}["layers.0.attn.kv_cache.k"] == [1, 7, 4, 64]


def test_cli_shapes_only_of_a_family_says_whose_tokenizer_stands_in(capsys):
    _, stdout, _ = run(capsys, "--shapes-only", "--json", "--model", "qwen3-0.6b", PROMPT)
    out = json.loads(stdout)
    assert "qwen3-0.6b's own tokenizer is not on this machine" in out["source"]
    shapes = {x["name"]: x["shape"] for x in out["trace"]}
    # Qwen3-0.6B: 16 query heads of 128 over a hidden of 1024, QK-norm per head
    assert shapes["layers.0.attn.q_norm"] == [1, 6, 16, 128] and shapes["lm_head"] == [1, 6, 151936]
    _, stdout, _ = run(capsys, "--shapes-only", "--json", PROMPT)
    assert "stands in" not in json.loads(stdout)["source"]  # TinyLlama's tokenizer is its own


def test_cli_shapes_only_of_a_checkpoint_directory(capsys, tmp_path):
    """Its own config.json on the meta device: a directory that holds nothing else will do."""
    from llmtrace_book import Config

    c = Config.from_name("qwen3-0.6b").replace(n_layers=3).to_hf()
    (tmp_path / "config.json").write_text(json.dumps(c))
    code, stdout, err = run(capsys, "--shapes-only", "--json", "--model", str(tmp_path), PROMPT)
    assert code == 0, err
    out = json.loads(stdout)
    assert out["model"] == tmp_path.name and out["config"]["n_layers"] == 3
    assert "own tokenizer is not on this machine" in out["source"]
    shapes = {x["name"]: x["shape"] for x in out["trace"]}
    assert shapes["layers.2.attn.q_norm"] == [1, 6, 16, 128]
    assert "layers.3.attn.q_norm" not in shapes
    assert shapes["lm_head"] == [1, 6, 151936]


def test_cli_preset_without_shapes_only_says_to_add_it(capsys):
    code, _, err = run(capsys, "--model", "llama-3.2-1b", PROMPT)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "'llama-3.2-1b' is a preset config, which has shapes only (no weights): add " \
           "--shapes-only" in err
