"""The forward pass exported to ONNX, for the page that runs it in the reader's browser.

`Model.forward` is handed a `GraphTrace` and exported by PyTorch's own exporter
(`torch.onnx.export(..., dynamo=True)`): every record of the trace becomes a graph output under
its trace name, in trace order, and the input `ids` [1, T] keeps T free. The graph is the
library's pass, traced, not a second implementation of it.

What the page loads, made once from the embedded model and kept in `$LLMTRACE_CACHE/web/<key>/`
(the key changes with the weights, the library's code and the exporter's versions):
- `model.onnx`, whose initializers live in one external file, `model.onnx.data`, stored here in
  chunks of at most 50 MB (`model.onnx.data.000`, ...) that static hosts serve; the page checks
  each chunk's size and SHA-256, joins them and hands the whole buffer over as `model.onnx.data`;
- `tokenizer.json` (the model's own) and `tokenizer_config.json` (BOS, EOS, whether BOS is added);
- `web.json`, the page's manifest, written last: files, sizes, hashes, the records, the config,
  and how far onnxruntime's logits were from the trace's when it was made.

`python -m llmtrace.export [--out DIR]` makes them (or finds them made) and prints where they are.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

from .errors import LlmTraceError, first_line
from .model import Model, state_dict_from_weights, weights_from_state_dict
from .trace import Record, Trace, _dtype_name

FORMAT = 1  # web.json's layout; the page refuses another
GRAPH = "model.onnx"
DATA = "model.onnx.data"  # the external data's one file name, as the graph refers to it
CHUNK_BYTES = 50_000_000  # at most 50 MB a file: what static hosts serve
TOKENIZER, TOKENIZER_CONFIG, MANIFEST = "tokenizer.json", "tokenizer_config.json", "web.json"
INPUT, LOGITS = "ids", "lm_head"
# the prompts the stated tolerance is measured on: the book's, and one of digits, accents, an
# emoji, newlines and a run of spaces
TOLERANCE_PROMPTS = ("The capital of France is", "Hello! 1234 caf\u00e9 \U0001F600\n\n  ok")
KEEP = 2  # exports kept in the cache: the one in use and the one before it


# --- the graph --------------------------------------------------------------------------------
class GraphTrace(Trace):
    """A trace for the exporter: every record keeps its tensor, which becomes a graph output.
    While torch.export traces the pass, T is a symbol: nothing may turn it into a Python int
    (`Trace.record` counts MACs with `int(macs)`, which would fix T to the example's length), so
    no MACs are counted here, and an op that names the length says "T"."""

    def __init__(self, length):
        super().__init__(keep_values=True, label="export")
        self._length = re.compile(rf"\b{re.escape(str(length))}\b")  # "s27", the symbol of T

    def record(self, name: str, op: str, tensor: torch.Tensor, macs=0) -> torch.Tensor:
        rec = Record(name, self._length.sub("T", op), tuple(tensor.shape),
                     _dtype_name(tensor.dtype), 0, tensor)
        self.records.append(rec)
        self._index[name] = rec
        return tensor


class _Graph(torch.nn.Module):
    """The model as a module: its weights are buffers under their Hugging Face names (so the
    graph's initializers carry those names), and forward is `Model.forward` with a GraphTrace,
    returning every record's tensor in trace order."""

    def __init__(self, model: Model):
        super().__init__()
        self.config = model.config
        for name, tensor in state_dict_from_weights(model.config, model.weights).items():
            *path, leaf = name.split(".")
            module = self
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_buffer(leaf, tensor)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = self.config
        model = Model(c, weights_from_state_dict(c, dict(self.named_buffers()), "export"))
        trace = GraphTrace(ids.shape[1])
        model.forward(ids, trace)
        # a new attribute: torch.export puts back the ones the module had before it ran
        self.records = trace.records
        return tuple(r.tensor for r in trace.records)


def check_exportable(model: Model) -> None:
    """The page runs fp32 weights on real values: say so before a slow export."""
    if model.is_meta:
        raise LlmTraceError(f"{model.name} lives on the meta device (shapes only): the export "
                            f"needs real weights, e.g. load_model('embedded')")
    dtype = model.weights.embed.dtype
    if dtype != torch.float32:
        raise LlmTraceError(f"{model.name} holds {_dtype_name(dtype)} weights; the export writes "
                            f"fp32: load an fp32 model, or convert its weights with .float()")


@contextlib.contextmanager
def _quiet():
    """The exporter's warnings about what this graph does not use (torchvision, training mode)."""
    log = logging.getLogger("torch.onnx")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        log.setLevel(level)


def export_onnx(model: Model, path: Path) -> list[dict]:
    """Export `Model.forward` with a trace to `path` (the graph) and `DATA` beside it (every
    initializer, one file). Returns the records, in trace order: name, op, dtype, and the shape
    with the prompt's length written "T"."""
    import onnx_ir as ir

    check_exportable(model)
    graph = _Graph(model).eval()
    example = torch.tensor([[model.config.bos_id] * 6])  # [1, 6]; the values do not matter
    T = torch.export.Dim("T", min=1, max=model.config.max_positions)
    names = [r.name for r in _trace_of(model, example)]
    try:
        with _quiet():
            # torch.export in Python (strict=False) runs the library's own code as it is, and
            # keeps what GraphTrace recorded; the ONNX exporter then translates that program
            exported = torch.export.export(graph, (example,), dynamic_shapes={"ids": {1: T}},
                                           strict=False)
            program = torch.onnx.export(exported, dynamo=True, verbose=False, optimize=True,
                                        input_names=[INPUT], output_names=names)
    except Exception as e:  # torch.export and the ONNX translation raise many kinds
        raise LlmTraceError(f"{model.name} cannot be exported to ONNX ({type(e).__name__}: "
                            f"{first_line(e)[:160]}): the page runs only what exports") from None
    records = [{"name": r.name, "op": r.op, "dtype": r.dtype,
                "shape": [d if isinstance(d, int) else "T" for d in r.shape]}
               for r in getattr(graph, "records", [])]
    if [r["name"] for r in records] != names:
        raise LlmTraceError(f"{model.name}: the exported pass recorded {len(records)} records, "
                            f"an ordinary pass {len(names)}: the export did not run the trace")
    outputs = program.model.graph.outputs
    _check_outputs(model, outputs, names)
    types = {"float32": ir.DataType.FLOAT, "int64": ir.DataType.INT64}
    for value, r in zip(outputs, records):  # the exporter leaves renamed outputs untyped
        value.dtype, value.shape = types[r["dtype"]], ir.Shape(r["shape"])
    program.save(str(path), external_data=True)
    if not (path.parent / DATA).is_file():
        raise LlmTraceError(f"the exporter wrote no {DATA} beside {path}: its onnx version "
                            f"differs from the pinned one; reinstall the requirements")
    return records


def _trace_of(model: Model, ids: torch.Tensor) -> Trace:
    """The records of an ordinary pass over `ids`, shapes only."""
    trace = Trace(keep_values=False)
    model.forward(ids, trace)
    return trace


def _check_outputs(model: Model, outputs, names: list[str]) -> None:
    """Every record an output, under its name, in order; each one computed from `ids` by the
    graph, none a weight or a constant the exporter folded (a record the same for every prompt
    would be a shape that T no longer reaches)."""
    got = [v.name for v in outputs]
    if got != names:
        first = next(i for i, (a, b) in enumerate(zip(got + [""], names + [""])) if a != b)
        raise LlmTraceError(f"{model.name}: graph output {first} is {got[first:first + 1]}, "
                            f"the trace's record {names[first:first + 1]}: the export lost "
                            f"the trace's order")
    for v in outputs:
        node = v.producer()
        if node is None or node.op_type == "Constant":
            raise LlmTraceError(f"{model.name}: the record {v.name!r} became a constant of the "
                                f"graph, not an output computed from ids")


# --- the files the page loads -----------------------------------------------------------------
def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def _entry(path: Path) -> dict:
    return {"file": path.name, "size": path.stat().st_size, "sha256": sha256(path)}


def split(path: Path, chunk_bytes: int = CHUNK_BYTES) -> list[Path]:
    """`path` cut into path.000, path.001, ... of at most chunk_bytes each; `path` removed."""
    chunks = []
    with open(path, "rb") as f:
        for i in itertools.count():
            block = f.read(chunk_bytes)
            if not block:
                break
            chunks.append(path.with_name(f"{path.name}.{i:03d}"))
            chunks[-1].write_bytes(block)
    path.unlink()
    return chunks


def write_tokenizer(model: Model, d: Path) -> None:
    """The model's own tokenizer.json, and what a JS tokenizer needs beside it."""
    tok = model.tokenizer
    if tok is None or not hasattr(tok, "tok"):
        kind = "none" if tok is None else tok.kind
        raise LlmTraceError(f"{model.name}'s tokenizer ({kind}) has no tokenizer.json: the page "
                            f"reads a Hugging Face tokenizers file (byte-level BPE)")
    tok.tok.save(str(d / TOKENIZER))
    piece = tok.tok.id_to_token
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": tok.add_bos,
                "add_eos_token": False, "bos_token": piece(tok.bos_id),
                "eos_token": piece(tok.eos_id), "model_max_length": model.config.max_positions,
                "clean_up_tokenization_spaces": False}
    (d / TOKENIZER_CONFIG).write_text(json.dumps(settings, indent=1))


def session_options(threads: int = 1):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only
    return options


def session(d: Path, threads: int = 1, web: dict | None = None):
    """An onnxruntime session on the exported graph, its external data read as the page reads
    it: every chunk checked (`verify`, unless web.json's content is given), joined in memory,
    handed over as `model.onnx.data`."""
    import onnxruntime as ort

    web = verify(d) if web is None else web
    data = bytearray()
    for c in web["chunks"]:
        data += (d / c["file"]).read_bytes()
    options = session_options(threads)
    options.add_external_initializers_from_files_in_memory([DATA], [data], [len(data)])
    return ort.InferenceSession((d / GRAPH).read_bytes(), options,
                                providers=["CPUExecutionProvider"])


def logit_difference(model: Model, sess, prompts=TOLERANCE_PROMPTS) -> float:
    """The largest |onnxruntime's logit - the trace's| over the prompts' every position."""
    worst = 0.0
    for prompt in prompts:
        ids = model.encode(prompt)  # [1, T]
        logits, _ = model.run(ids, keep_values=False)  # [1, T, V]
        (got,) = sess.run([LOGITS], {INPUT: ids.numpy()})
        worst = max(worst, float((torch.from_numpy(got) - logits).abs().max()))
    return worst


def round_up(x: float) -> float:
    """x rounded up to one significant digit: 1.2e-4 -> 2e-4."""
    if x <= 0:
        return 1e-6
    exponent = math.floor(math.log10(x))
    return float(f"{math.ceil(x / 10**exponent - 1e-9)}e{exponent}")


def config_for_page(model: Model) -> dict:
    c, tok = model.config, model.tokenizer
    return {"vocab_size": c.vocab_size, "n_layers": c.n_layers, "n_heads": c.n_heads,
            "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "hidden_size": c.hidden_size,
            "max_context": c.max_positions, "bos_id": c.bos_id,
            "add_bos": bool(tok.add_bos), "eos_ids": list(c.end_ids)}


def versions() -> dict:
    import onnx
    import onnx_ir
    import onnxruntime
    import onnxscript

    return {"torch": torch.__version__, "onnx": onnx.__version__,
            "onnxscript": onnxscript.__version__, "onnx_ir": onnx_ir.__version__,
            "onnxruntime": onnxruntime.__version__}


def write_web(model: Model, d: Path, label: str | None = None) -> dict:
    """Every file the page loads, into the directory d, web.json last; returns web.json."""
    started = time.perf_counter()
    records = export_onnx(model, d / GRAPH)
    chunks = split(d / DATA)
    write_tokenizer(model, d)
    web = {"format": FORMAT, "model": label or model.name, "source": model.source,
           "weights": "fp32", "graph": _entry(d / GRAPH), "external_data": DATA,
           "chunks": [_entry(c) for c in chunks], "tokenizer": _entry(d / TOKENIZER),
           "tokenizer_config": _entry(d / TOKENIZER_CONFIG), "input": INPUT,
           "records": records, "logits": LOGITS, "config": config_for_page(model)}
    measured = logit_difference(model, session(d, web=web))
    # twice what was measured: other prompts and other CPU kernels move it (a 46-token prompt
    # gave 7.2e-5 where these two gave 6.4e-5)
    web["tolerance"] = {"logits": round_up(2 * measured), "logits_measured": measured,
                        "prompts": list(TOLERANCE_PROMPTS)}
    web["exported_with"] = versions()
    web["export_seconds"] = round(time.perf_counter() - started, 1)
    (d / MANIFEST).write_text(json.dumps(web, indent=1))
    return web


def verify(d: Path) -> dict:
    """web.json, after checking that every file it lists has its size and SHA-256 (what the
    page checks before it runs anything)."""
    try:
        web = json.loads((d / MANIFEST).read_text())
        files = [web["graph"], *web["chunks"], web["tokenizer"], web["tokenizer_config"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise LlmTraceError(f"{d / MANIFEST} is missing or unreadable: "
                            f"make it again with python -m llmtrace.export") from None
    for f in files:
        path = d / f["file"]
        if not path.is_file():
            raise LlmTraceError(f"{path} is missing: make the export again "
                                f"(python -m llmtrace.export)")
        size = path.stat().st_size
        if size != f["size"]:
            raise LlmTraceError(f"{path} has {size:,} bytes, not {f['size']:,}: it was cut short "
                                f"or changed; make the export again (python -m llmtrace.export)")
        if sha256(path) != f["sha256"]:
            raise LlmTraceError(f"{path} does not have the SHA-256 web.json gives: it changed; "
                                f"make the export again (python -m llmtrace.export)")
    return web


# --- the cached export of the embedded model --------------------------------------------------
def cache_key() -> str:
    """What the export depends on: the embedded model's file, every source file of the library
    (the graph is the library's own pass, so a change anywhere may change it), and the versions
    of the exporter and of onnxruntime (which measured the tolerance)."""
    from .disk_cache import _digest
    from .weights.gguf import embedded_gguf_path

    gguf = embedded_gguf_path()
    h = hashlib.sha256(f"format {FORMAT} {gguf.stat().st_size} {_digest(gguf)}".encode())
    h.update(json.dumps(versions(), sort_keys=True).encode())
    package = Path(__file__).resolve().parent
    for f in sorted(package.rglob("*.py")):
        h.update(f.relative_to(package).as_posix().encode() + b"\0" + f.read_bytes())
    return f"smollm2-135m-{h.hexdigest()[:16]}"


def web_dir(rebuild: bool = False) -> Path:
    """The embedded model's export in the cache, made if it is not there or not `usable`."""
    from .disk_cache import (atomic_path, build_lock, cache_dir, check_writable, collect_stale,
                             usable, write_manifest)

    root = cache_dir() / "web"
    root.mkdir(parents=True, exist_ok=True)
    target = root / cache_key()
    collect_stale(root, target.name)
    if not rebuild and usable(target) is None:
        return target
    with build_lock(root, target.name):
        if rebuild or usable(target) is not None:
            from .load import load_model
            from .weights.gguf import EMBEDDED_FILE

            check_writable(root, 2 * 560 * 2**20)  # the data file, then its chunks
            model = load_model("embedded")
            with atomic_path(target, directory=True) as tmp:
                write_web(model, tmp, label=EMBEDDED_FILE.split(".")[0])
                write_manifest(tmp)  # last: the disk cache's rule, `usable`
            _prune(root, target)
    return target


def _prune(root: Path, target: Path) -> None:
    """Each change of the library makes a new export of 540 MB: keep the newest KEEP."""
    done = [d for d in root.glob("smollm2-135m-*") if (d / "manifest.json").is_file()]
    done.sort(key=lambda d: (d == target, (d / "manifest.json").stat().st_mtime), reverse=True)
    for old in done[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)


def place(d: Path, out: Path) -> None:
    """The page's files (not the cache's manifest) into `out`: hard links where the disk allows,
    else copies. `out` is replaced if it holds an earlier export."""
    if out.exists() and not (out.is_dir() and (not any(out.iterdir())
                                                or (out / MANIFEST).is_file())):
        raise LlmTraceError(f"{out} exists and holds no export (no {MANIFEST}): "
                            f"choose another --out")
    web = verify(d)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    files = [web["graph"], *web["chunks"], web["tokenizer"], web["tokenizer_config"]]
    for name in [f["file"] for f in files] + [MANIFEST]:
        try:
            os.link(d / name, out / name)
        except OSError:  # another disk, or links not allowed
            shutil.copyfile(d / name, out / name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m llmtrace.export", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--out", type=Path, default=None,
                   help="also put the page's files into this directory (hard links if possible)")
    p.add_argument("--rebuild", action="store_true", help="export again even if cached")
    args = p.parse_args(argv)
    try:
        d = web_dir(rebuild=args.rebuild)
        if args.out is not None:
            place(d, args.out)
    except LlmTraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    web = json.loads((d / MANIFEST).read_text())
    size = web["graph"]["size"] + sum(c["size"] for c in web["chunks"])
    print(f"{d}: {web['model']} ({web['weights']}), {len(web['records'])} records, "
          f"{len(web['chunks'])} chunks, {size / 1e6:,.0f} MB"
          + (f"; placed in {args.out}" if args.out is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
