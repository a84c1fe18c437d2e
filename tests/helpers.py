"""What several test files share: the prompt, an exercise's verdict, and small tools to break a
checkpoint."""

import json
import os
from pathlib import Path

import torch

PROMPT = "The capital of France is"  # the book's prompt, defined once for the tests


def process_env(**changes) -> dict:
    """The environment for a child Python: this one, with torch's threads as the tests run them
    (one, unless OMP_NUM_THREADS is set: see conftest.py), and `changes`."""
    return {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **changes}


def one_line(err) -> str:
    """The message of an LlmTraceError (or pytest's ExceptionInfo of one), checked to be one
    line with no traceback."""
    message = str(err.value if hasattr(err, "value") else err)
    assert message and "\n" not in message and "Traceback" not in message
    return message


def edit_config(d: Path, **changes) -> Path:
    c = json.loads((d / "config.json").read_text())
    c.update(changes)
    (d / "config.json").write_text(json.dumps(c))
    return d


def nan_weight(d: Path, name: str, value: float = float("nan")) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(d / "model.safetensors")
    sd[name] = torch.full_like(sd[name], value)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})


def verdict(capsys, name, fn, model) -> tuple[bool, str]:
    """An exercise's check on fn: whether it passed, and the one line it printed."""
    from exercises import check

    ok = check(name, fn, model=model)
    out = capsys.readouterr().out
    assert out.count("\n") == 1, f"check printed more than one line: {out!r}"
    return ok, out.strip()
