"""The CLI under bad input: one line on stderr that says what was wrong and what to do, exit
status 2, nothing on stdout; text from a user or a model never reaches the terminal raw."""

import errno
import io
import json
import os
import subprocess
import sys

import pytest

from helpers import PROMPT, nan_weight, process_env
from llmtrace_book.__main__ import main, parse_args, run_live


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
    (["--seed", "x", PROMPT], "--seed: invalid int value: 'x': see python -m llmtrace_book --help"),
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


def test_cli_ctrl_c_is_one_line_and_130(cli, monkeypatch, tiny_dir):
    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr("llmtrace_book.__main__.run_live", interrupted)
    status, out, err = cli("--model", str(tiny_dir), PROMPT)
    assert status == 130 and out == "" and err == "error: interrupted\n"


def test_cli_escape_sequences_never_reach_the_terminal(cli, tiny_dir):
    prompt = "\x1b]0;owned\x07\x1b[2J hi"  # retitle the window, clear the screen
    status, out, err = cli("--model", str(tiny_dir), "--max-new-tokens", "2", prompt)
    assert status == 0, err
    assert "\x1b" not in out and "\x07" not in out
    assert "\\x1b]0;owned\\x07\\x1b[2J hi" in out  # the prompt, echoed with its escapes visible


def test_cli_ascii_stdout(cli, monkeypatch, tiny_dir):
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    status = main(["--model", str(tiny_dir), "--max-new-tokens", "2", "café ☕"])
    text = raw.getvalue().decode("ascii")
    assert status == 0
    assert "caf\\xe9 \\u2615" in text  # what ASCII cannot show is escaped, not a crash


def test_cli_stdout_write_error(cli, monkeypatch, tiny_dir):
    class Full(io.StringIO):
        def write(self, s):
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(sys, "stdout", Full())
    status = main(["--model", str(tiny_dir), "--max-new-tokens", "1", PROMPT])
    monkeypatch.undo()
    assert status == 2


def test_cli_dev_full_in_a_process(tiny_dir):
    """stdout on a full disk, a non-ASCII prompt under the C locale: one line, status 2, no
    warning at exit."""
    with open("/dev/full", "w") as full:
        argv = [sys.executable, "-m", "llmtrace_book", "--model", str(tiny_dir), "--max-new-tokens", "1",
                "Paris, café ☕"]
        r = subprocess.run(argv, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120,
                           env=process_env(LC_ALL="C"))
    assert r.returncode == 2
    assert r.stderr == ("error: cannot write the output (No space left on device): "
                        "check where stdout goes\n")


def test_cli_with_stdout_closed(tiny_dir):
    argv = [sys.executable, "-m", "llmtrace_book", "--model", str(tiny_dir), "--max-new-tokens", "1",
            PROMPT]
    r = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                       timeout=120, preexec_fn=lambda: os.close(1), env=process_env())
    assert r.returncode == 2
    assert r.stderr == ("error: cannot write the output (stdout is closed): "
                        "check where stdout goes\n")


def test_cli_json_is_valid(cli, tiny_dir):
    status, out, err = cli("--model", str(tiny_dir), "--max-new-tokens", "2", "--json", "café")
    assert status == 0, err
    assert "".join(json.loads(out)["input_pieces"]).endswith("café")


def test_cli_nan_weights_name_the_op(cli, ckpt):
    nan_weight(ckpt, "model.layers.1.mlp.down_proj.weight")
    err = cli_error(*cli("--model", str(ckpt), PROMPT))
    assert "the output of layers.1.mlp.down is not finite (NaN or inf)" in err
    assert "check the weights that op reads" in err
    err = cli_error(*cli("--model", str(ckpt), "--json", PROMPT))  # no bare NaN: no output at all
    assert "layers.1.mlp.down" in err


def test_cli_tiny_temperature(cli, tiny_dir):
    greedy = cli("--model", str(tiny_dir), "--max-new-tokens", "3", "--json", PROMPT)
    cold = cli("--model", str(tiny_dir), "--max-new-tokens", "3", "--json", "--temperature", "1e-45",
               PROMPT)
    assert greedy[0] == cold[0] == 0
    assert json.loads(greedy[1])["generated_ids"] == json.loads(cold[1])["generated_ids"]


def test_cli_keeps_only_the_first_step(tiny_dir):
    args = parse_args(["--model", str(tiny_dir), "--max-new-tokens", "6", PROMPT])
    out = run_live(args)
    g = out["generation"]
    assert len(g.new_ids) == 6 and len(g.steps) == 1 and len(g.step_logits) == 1
    assert out["trace"].label == "prefill" and out["trace"].records[0].tensor is None


