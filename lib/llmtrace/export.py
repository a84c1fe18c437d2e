"""The forward pass exported to ONNX, for the page that runs it in the reader's browser.

`Model.forward` is handed a `GraphTrace` and exported by PyTorch's own exporter
(`torch.onnx.export(..., dynamo=True)`): every record of the trace becomes a graph output under
its trace name, in trace order, and the input `ids` [1, T] keeps T free. The graph is the
library's pass, traced, not a second implementation of it.

What the page loads, made once from the embedded model and kept in `$LLMTRACE_CACHE/web/<key>/`
(the key changes with the weights, the library's code and the exporter's versions):
- `model.onnx`, the page's form: the same graph with the GGUF's own blocks for weights (Q4_1 as
  MatMulNBits, the Q8_0 table as GatherBlockQuantized and an 8-bit MatMulNBits), 120 MB; its
  initializers live in one external file, `model.onnx.data`, stored here in chunks of at most
  50 MB (`model.onnx.data.000`, ...) that static hosts serve; the page checks each chunk's size
  and SHA-256, joins them and hands the whole buffer over as `model.onnx.data`;
- `model-fp32.onnx` and its chunks, the fp32 graph as exported (540 MB), kept beside it;
- `lens.onnx` (and `lens-fp32.onnx`): the logit lens, `lens.lens_grid` exported, which reads
  its two weights from the main graph's data file, so it runs on the same chunks;
- `decode.onnx` (and `decode-fp32.onnx`): one decode step, `Model.forward` of one token reading
  the layers' `KVCache` (inputs `past.{layer}.{k,v}`, the cache after the step among its
  outputs), its weights references into the main graph's data file too;
- `tokenizer.json` (the model's own) and `tokenizer_config.json` (BOS, EOS, whether BOS is added);
- `web.json` (and `web-fp32.json`), the page's manifest, written last: files, sizes, hashes, the
  records, the config, and how far onnxruntime's logits were from the trace's when it was made.

`python -m llmtrace.export [--out DIR]` makes them (or finds them made) and prints where they are.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from .weights.names import hf_name
from .errors import LlmTraceError, first_line
from .model import Model, state_dict_from_weights, weights_from_state_dict
from .trace import Record, Trace, _dtype_name

FORMAT = 1  # web.json's layout; the page refuses another
GRAPH = "model.onnx"  # the page's form; its external data is one file, model.onnx.data
FP32_GRAPH, FP32_MANIFEST = "model-fp32.onnx", "web-fp32.json"  # fp32, kept beside it
CHUNK_BYTES = 50_000_000  # at most 50 MB a file: what static hosts serve
TOKENIZER, TOKENIZER_CONFIG, MANIFEST = "tokenizer.json", "tokenizer_config.json", "web.json"
INPUT, LOGITS = "ids", "lm_head"
# the prompts the stated tolerance is measured on: the book's, and one of digits, accents, an
# emoji, newlines and a run of spaces
TOLERANCE_PROMPTS = ("The capital of France is", "Hello! 1234 caf\u00e9 \U0001F600\n\n  ok")
KEEP = 2  # exports kept in the cache: the one in use and the one before it
LOGIT_TOLERANCE = 1e-4  # the page's logits against the trace's; each form is measured at export


# --- the graph --------------------------------------------------------------------------------
class GraphTrace(Trace):
    """A trace for the exporter: every record keeps its tensor, which becomes a graph output.
    While torch.export traces the pass, T is a symbol: nothing may turn it into a Python int
    (`Trace.record` counts MACs with `int(macs)`, which would fix T to the example's length), so
    no MACs are counted here, and an op that names the length says "T"."""

    def __init__(self, length, letter: str = "T"):
        super().__init__(keep_values=True, label="export", pool=None)
        self._length = re.compile(rf"\b{re.escape(str(length))}\b")  # "s27", the symbol of T
        self._letter = letter

    def record(self, name: str, op: str, tensor: torch.Tensor, macs=0,
               recompute=None) -> torch.Tensor:
        rec = Record(name, self._length.sub(self._letter, op), tuple(tensor.shape),
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
        _buffers(self, state_dict_from_weights(model.config, model.weights))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = self.config
        model = Model(c, weights_from_state_dict(c, dict(self.named_buffers()), "export"))
        trace = GraphTrace(ids.shape[1])
        model.forward(ids, trace)
        # a new attribute: torch.export puts back the ones the module had before it ran
        self.records = trace.records
        return tuple(r.tensor for r in trace.records)


class _Decode(torch.nn.Module):
    """One decode step as a module: `Model.forward` of one new token at position P, reading the
    layers' `KVCache`s, which hold the P positions before it (`past.{i}.k`, `past.{i}.v`,
    [1, P, KV, hd] each: the prefill's records `layers.{i}.attn.kv_cache.k` / `.v`, or the last
    step's), and returning every record; among them `layers.{i}.attn.kv_cache.k` / `.v`, the
    cache after this step's write [1, P + 1, KV, hd], the next step's past."""

    def __init__(self, model: Model):
        super().__init__()
        self.config = model.config
        _buffers(self, state_dict_from_weights(model.config, model.weights))

    def forward(self, ids: torch.Tensor, past: tuple[torch.Tensor, ...]) -> tuple:
        c = self.config
        model = Model(c, weights_from_state_dict(c, dict(self.named_buffers()), "export"))
        P = past[0].shape[1]
        cache = model.new_cache(P + 1)  # the past, then this step's position
        for i, layer in enumerate(cache):
            layer.update(0, past[2 * i], past[2 * i + 1])
        trace = GraphTrace(P, letter="P")
        model.forward(ids, trace, cache, start=P)  # [1, 1, V]
        self.records = trace.records  # as in _Graph
        return tuple(r.tensor for r in trace.records)


def _buffers(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Each tensor a buffer under its dotted name (`model.norm.weight`), in nested modules."""
    for name, tensor in tensors.items():
        *path, leaf = name.split(".")
        inner = module
        for part in path:
            if not hasattr(inner, part):
                inner.add_module(part, torch.nn.Module())
            inner = getattr(inner, part)
        inner.register_buffer(leaf, tensor)


class _Lens(torch.nn.Module):
    """The logit lens, `lens.lens_grid`, as a module: the residual stream after every layer
    [L, 1, T, D] -> the most likely token after each layer at each position [L, T], and its
    probability [L, T]. Its two weights carry their HF names, which the main graph's data file
    holds: the page runs it on the same chunks (`export_lens`). The head is tied: the table."""

    def __init__(self, model: Model):
        super().__init__()
        self.config = model.config
        _buffers(self, {hf_name("final_norm"): model.weights.final_norm,
                        hf_name("embed"): model.weights.lm_head})

    def forward(self, resid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from types import SimpleNamespace

        from .lens import grid_of

        buffers = dict(self.named_buffers())
        weights = SimpleNamespace(final_norm=buffers[hf_name("final_norm")],
                                  lm_head=buffers[hf_name("embed")])
        # the model's own head, on the two weights it reads
        model = SimpleNamespace(weights=weights, config=self.config)
        grid = grid_of(lambda x: Model.head(model, x), resid[:, 0], self.config.vocab_size)
        return grid.top_ids, grid.top_probs  # [L, T] each


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
    """Export `Model.forward` with a trace to `path` (the graph) and path + ".data" beside it
    (every initializer, one file). Returns the records, in trace order: name, op, dtype, and the
    shape with the prompt's length written "T"."""
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
            program = torch.onnx.export(exported, dynamo=True, verbose=False, optimize=False,
                                        input_names=[INPUT])
    except Exception as e:  # torch.export and the ONNX translation raise many kinds
        raise LlmTraceError(f"{model.name} cannot be exported to ONNX ({type(e).__name__}: "
                            f"{first_line(e)[:160]}): the page runs only what exports") from None
    records = [{"name": r.name, "op": r.op, "dtype": r.dtype,
                "shape": [d if isinstance(d, int) else "T" for d in r.shape]}
               for r in getattr(graph, "records", [])]
    if [r["name"] for r in records] != names:
        raise LlmTraceError(f"{model.name}: the exported pass recorded {len(records)} records, "
                            f"an ordinary pass {len(names)}: the export did not run the trace")
    _optimize(program.model, names)
    outputs = program.model.graph.outputs
    _check_outputs(model, outputs, names)
    types = {"float32": ir.DataType.FLOAT, "int64": ir.DataType.INT64}
    for value, r in zip(outputs, records):  # the exporter leaves renamed outputs untyped
        value.dtype, value.shape = types[r["dtype"]], ir.Shape(r["shape"])
    _relative_sources(program.model.graph)
    program.save(str(path), external_data=True)
    if not path.with_name(path.name + ".data").is_file():
        raise LlmTraceError(f"the exporter wrote no {path.name}.data beside {path}: its onnx "
                            f"version differs from the pinned one; reinstall the requirements")
    return records


DECODE_GRAPH, FP32_DECODE_GRAPH = "decode.onnx", "decode-fp32.onnx"
PAST, PRESENT = "past.{layer}.{kv}", "layers.{layer}.attn.kv_cache.{kv}"


def past_names(c) -> list[str]:
    """The decode graph's cache inputs, layer by layer, K before V."""
    return [PAST.format(layer=i, kv=kv) for i in range(c.n_layers) for kv in "kv"]


def _optimize(onnx_model, names: list[str]) -> None:
    """The exporter's optimizer without its rewrite rules (they take a minute on these graphs,
    and onnxruntime makes its own rewrites when it loads one): constants folded (a weight's
    transpose among them), unused nodes removed; then each output a value of its own (every
    layer's causal_mask is one tensor) under its record's name, and the input named `ids`."""
    from onnx_ir.passes import common as passes
    from onnxscript.optimizer import _constant_folding

    for p in [passes.InlinePass(), _constant_folding.FoldConstantsPass(
            shape_inference=True, input_size_limit=8192, output_size_limit=262144),
            passes.RemoveUnusedNodesPass(),
            passes.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
            passes.DeduplicateInitializersPass(), passes.CommonSubexpressionEliminationPass(),
            passes.OutputFixPass(), passes.NameFixPass()]:
        p(onnx_model)
    g = onnx_model.graph
    for value, name in zip(g.outputs, names):
        value.name = name
    g.inputs[0].name = INPUT  # OutputFixPass renamed it, an output (`tokens`) being the input


def export_decode(model: Model, path: Path) -> None:
    """Export one decode step (`_Decode`) to `path`, its data in path + ".data" (made into
    references to the main graph's data by `share_data`). The past's length P is free."""
    c = model.config
    graph = _Decode(model).eval()
    past = tuple(torch.zeros(1, 5, c.n_kv_heads, c.head_dim)  # [1, P, KV, hd]; values unused
                 for _ in range(2 * c.n_layers))
    example = torch.tensor([[c.bos_id]])  # [1, 1]
    P = torch.export.Dim.AUTO  # a Dim with bounds fails on a guard sympy cannot prove
    try:
        with _quiet():
            exported = torch.export.export(
                graph, (example, past), strict=False,
                dynamic_shapes={"ids": None, "past": tuple({1: P} for _ in past)})
            names = [r.name for r in graph.records]
            program = torch.onnx.export(exported, dynamo=True, verbose=False, optimize=False,
                                        input_names=[INPUT, *past_names(c)])
    except Exception as e:  # as in export_onnx
        raise LlmTraceError(f"{model.name}: the decode step cannot be exported to ONNX "
                            f"({type(e).__name__}: {first_line(e)[:160]})") from None
    g = program.model.graph
    if g.inputs[1].shape is None or g.inputs[1].shape[1] == 5:
        raise LlmTraceError(f"{model.name}: the decode graph fixed the past's length")
    _optimize(program.model, names)
    _check_outputs(model, g.outputs, names)
    _relative_sources(g)
    program.save(str(path), external_data=True)


def share_data(graph: Path, main: Path) -> None:
    """`graph`'s initializers made references into `main`'s data file, each to the tensor that
    holds the same bytes (the decode graph's weights are the main graph's, under names the
    exporter chose), and `graph`'s own data file removed: the page hands every session the same
    joined chunks. A large tensor the main graph lacks is refused."""
    import onnx
    from onnx import numpy_helper

    def key(init, raw: bytes):
        return init.data_type, tuple(init.dims), hashlib.sha256(raw).digest()

    held = {}
    main_proto = onnx.load(str(main), load_external_data=False)
    with open(main.with_name(main.name + ".data"), "rb") as f:
        for init in main_proto.graph.initializer:
            where = {e.key: e.value for e in init.external_data}
            if "location" in where:
                f.seek(int(where.get("offset", 0)))
                held[key(init, f.read(int(where["length"])))] = init
    proto = onnx.load(str(graph), load_external_data=True)
    for init in proto.graph.initializer:
        raw = numpy_helper.to_array(init).tobytes()
        same = held.get(key(init, raw))
        if same is not None:
            name = init.name
            init.CopyFrom(same)
            init.name = name
        elif len(raw) > 2**16:
            raise LlmTraceError(f"{graph.name}: its weight {init.name} {list(init.dims)} is "
                                f"not among {main.name}'s: the two graphs' weights differ")
    onnx.save(proto, str(graph))
    graph.with_name(graph.name + ".data").unlink()


def decode_entry(model: Model, d: Path, graph: str) -> dict:
    """The decode graph's entry in a manifest."""
    c = model.config
    return {"graph": _entry(d / graph), "input": INPUT, "past": PAST, "present": PRESENT,
            "past_shape": [1, "P", c.n_kv_heads, c.head_dim], "logits": LOGITS}


LENS_INPUT, LENS_OUTPUTS = "resid", ["lens.top_ids", "lens.top_probs"]


def export_lens(model: Model, d: Path, quantized: bool) -> dict[str, dict]:
    """The logit lens (`_Lens`) exported beside each main graph in d (`lens-fp32.onnx` beside
    `model-fp32.onnx`; `lens.onnx` beside `model.onnx`, its head the 8-bit MatMulNBits on the
    Q8_0 table), holding no data of its own: each initializer points into the main graph's data
    file, at the main graph's own offsets, so the page hands both sessions the same joined
    chunks. Returns each main graph's lens entry for its manifest."""
    import onnx
    import onnx_ir as ir

    c = model.config
    if not c.tied_lm_head:  # the exporter folds an untied head into a matrix of a new name,
        return {}  # which the lens could not find: such a model's page has no lens
    example = torch.zeros(c.n_layers, 1, 6, c.hidden_size)  # [L, 1, T, D]
    T = torch.export.Dim("T", min=1, max=c.max_positions)
    try:
        with _quiet():  # no optimizer: it would fold embed_tokens^T into a matrix of its own
            exported = torch.export.export(_Lens(model).eval(), (example,), strict=False,
                                           dynamic_shapes={"resid": {2: T}})
            program = torch.onnx.export(exported, dynamo=True, verbose=False, optimize=False,
                                        input_names=[LENS_INPUT], output_names=LENS_OUTPUTS)
    except Exception as e:  # as in export_onnx
        raise LlmTraceError(f"{model.name}: the logit lens cannot be exported to ONNX "
                            f"({type(e).__name__}: {first_line(e)[:160]})") from None
    lens = program.model
    _relative_sources(lens.graph)
    lens.graph.inputs[0].shape = ir.Shape([c.n_layers, 1, "T", c.hidden_size])
    for value in lens.graph.outputs:
        value.shape = ir.Shape([c.n_layers, "T"])
    entries = {}
    for main, name, quantize in ((FP32_GRAPH, "lens-fp32.onnx", False),
                                 (GRAPH, "lens.onnx", True)):
        if quantize and not quantized:
            continue
        graph = ir.from_proto(ir.to_proto(lens))  # a copy to change
        if quantize:
            _lens_head_from_table(graph.graph, c)
        proto = ir.to_proto(graph)
        held = {i.name: i for i in onnx.load(str(d / main), load_external_data=False)
                .graph.initializer}
        for init in proto.graph.initializer:  # the main graph's own bytes, by name
            init.CopyFrom(held[init.name])
        onnx.save(proto, str(d / name))
        entries[main] = {"graph": _entry(d / name), "input": LENS_INPUT,
                         "input_shape": [c.n_layers, 1, "T", c.hidden_size],
                         "outputs": LENS_OUTPUTS}
    return entries


def _lens_head_from_table(g, c) -> None:
    """Each of the lens's head products (Gemm with embed_tokens, transposed) read from the
    Q8_0 table, as the main graph's head reads it."""
    import onnx_ir as ir

    names = {v.name: v for v in g.initializers.values()}
    table = ir.Value(name="model.embed_tokens.q8", const_value=ir.tensor(
        np.zeros((c.vocab_size, c.hidden_size // BLOCK, BLOCK), np.uint8)))
    scales = ir.Value(name="model.embed_tokens.scales_flat", const_value=ir.tensor(
        np.zeros(c.vocab_size * c.hidden_size // BLOCK, np.float32)))
    g.register_initializer(table)
    g.register_initializer(scales)
    for node in [n for n in g if n.op_type == "Gemm"]:
        x, w = node.inputs[:2]
        attrs = {k: a.value for k, a in node.attributes.items()}
        plain = {"transA": 0, "transB": 1, "alpha": 1.0, "beta": 1.0}
        if w is not names[hf_name("embed")] or any(i is not None for i in node.inputs[2:]) \
                or any(attrs.get(k, 0 if k == "transA" else 1) != v for k, v in plain.items()):
            raise LlmTraceError(f"the lens's head is not x @ embed_tokens^T ({attrs})")
        new = ir.node("MatMulNBits", [x, table, scales], domain="com.microsoft",
                      attributes={"K": c.hidden_size, "N": c.vocab_size, "bits": 8,
                                  "block_size": BLOCK})
        g.insert_before(node, new)
        _rename(node, new, g)
    del g.initializers[hf_name("embed")]
    g.opset_imports["com.microsoft"] = 1


def _relative_sources(graph) -> None:
    """Each node keeps the source lines that made it (the exporter's stack trace), named from
    the package (`llmtrace/model.py`), not from this machine's checkout or environment."""
    import sysconfig

    roots = [f"{Path(__file__).resolve().parents[1]}/", f"{sysconfig.get_path('purelib')}/"]
    for node in graph:
        trace = node.metadata_props.get("pkg.torch.onnx.stack_trace")
        if trace is not None:
            for root in roots:
                trace = trace.replace(root, "")
            node.metadata_props["pkg.torch.onnx.stack_trace"] = trace


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


def session(d: Path, threads: int = 1, web: dict | str = MANIFEST, graph: str = ""):
    """An onnxruntime session on an exported graph (web.json's form, or another manifest's;
    `graph="lens"` for its lens, `"decode"` for its decode step), its external data read as
    the page reads it: every chunk checked (`verify`, unless the manifest's content is given),
    joined in memory, handed over under its one file name."""
    import onnxruntime as ort

    web = verify(d, web) if isinstance(web, str) else web
    data = bytearray()
    for c in web["chunks"]:
        data += (d / c["file"]).read_bytes()
    options = session_options(threads)
    options.add_external_initializers_from_files_in_memory([web["external_data"]], [data],
                                                           [len(data)])
    entry = web[graph]["graph"] if graph else web["graph"]
    return ort.InferenceSession((d / entry["file"]).read_bytes(), options,
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


def onnx_greedy(web: dict, main, decode, ids: np.ndarray, steps: int):
    """Greedy continuation as the page runs it: the main graph over the prompt ids [1, T] (its
    `kv_cache` records are the past), then the decode graph one token at a time, each step's
    cache the next one's past. -> (the new ids, the logits [V] each step chose from)."""
    step = web["decode"]
    layers = range(web["config"]["n_layers"])
    present = [step["present"].format(layer=i, kv=kv) for i in layers for kv in "kv"]
    past = [step["past"].format(layer=i, kv=kv) for i in layers for kv in "kv"]
    out = main.run([LOGITS, *present], {INPUT: ids})
    new, chosen_from = [], []
    for _ in range(steps):
        chosen_from.append(out[0][0, -1])  # [V]
        new.append(int(chosen_from[-1].argmax()))
        if len(new) < steps:
            out = decode.run([step["logits"], *present],
                             {step["input"]: np.array([[new[-1]]]), **dict(zip(past, out[1:]))})
    return new, chosen_from


DECODE_STEPS = 8  # greedy steps the decode graph is measured on at export


def decode_difference(model: Model, web: dict, main, decode, prompt: str) -> float:
    """The largest |onnxruntime's logit - generate's| over DECODE_STEPS greedy steps; refused
    if a token differs."""
    from .generate import generate

    ids = model.encode(prompt)  # [1, T]
    g = generate(model, ids, max_new_tokens=DECODE_STEPS, stop_at_eos=False, trace=False)
    new, chosen_from = onnx_greedy(web, main, decode, ids.numpy(), DECODE_STEPS)
    if new != g.new_ids:
        raise LlmTraceError(f"{model.name}: the decode graph continues {prompt!r} with {new}, "
                            f"generate with {g.new_ids}")
    return max(float(np.abs(got - want.numpy()).max())
               for got, want in zip(chosen_from, g.step_logits))


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


def _form(model: Model, d: Path, graph: Path, weights: str, head: dict) -> dict:
    """One form's manifest: its graph, its data in chunks, and its logits measured against the
    trace's (refused past LOGIT_TOLERANCE)."""
    data = graph.with_name(graph.name + ".data")
    web = {**head, "weights": weights, "graph": _entry(graph), "external_data": data.name,
           "chunks": [_entry(c) for c in split(data)]}
    main = session(d, web=web)
    measured = logit_difference(model, main)
    decoded = decode_difference(model, web, main, session(d, web=web, graph="decode"),
                                TOLERANCE_PROMPTS[0]) if "decode" in web else None
    for what, worst in (("logits", measured), ("decode steps' logits", decoded)):
        if worst is not None and worst > LOGIT_TOLERANCE:
            raise LlmTraceError(f"{model.name}: the {weights} graph's {what} are {worst:.1e} "
                                f"from the library's, over the page's {LOGIT_TOLERANCE:g}")
    measured_decode = {} if decoded is None else {"decode_measured": decoded,
                                                  "decode_steps": DECODE_STEPS}
    return {**web, "tolerance": {"logits": LOGIT_TOLERANCE, "logits_measured": measured,
                                 **measured_decode, "prompts": list(TOLERANCE_PROMPTS)}}


def write_web(model: Model, d: Path, label: str | None = None, blocks: dict | None = None) -> dict:
    """Every file the page loads, into the directory d, web.json last; returns web.json.
    The fp32 graph always (`FP32_GRAPH`, manifest `FP32_MANIFEST`); given the GGUF's own
    blocks (`weights.gguf.read_blocks`), also the graph that holds them, which web.json names
    as the page's form."""
    started = time.perf_counter()
    records = export_onnx(model, d / FP32_GRAPH)
    write_tokenizer(model, d)
    head = {"format": FORMAT, "model": label or model.name, "source": model.source,
            "tokenizer": _entry(d / TOKENIZER), "tokenizer_config": _entry(d / TOKENIZER_CONFIG),
            "input": INPUT, "records": records, "logits": LOGITS,
            "config": config_for_page(model), "exported_with": versions()}
    export_decode(model, d / FP32_DECODE_GRAPH)
    if blocks is not None:  # before the fp32 data is cut into chunks: it reads that file
        quantize_graph(d / FP32_GRAPH, d / GRAPH, blocks, model)
        quantize_graph(d / FP32_DECODE_GRAPH, d / DECODE_GRAPH, blocks, model)
        share_data(d / DECODE_GRAPH, d / GRAPH)
    share_data(d / FP32_DECODE_GRAPH, d / FP32_GRAPH)
    lens = export_lens(model, d, quantized=blocks is not None)
    decode = {GRAPH: decode_entry(model, d, DECODE_GRAPH)} if blocks is not None else {}
    decode[FP32_GRAPH] = decode_entry(model, d, FP32_DECODE_GRAPH)
    with_lens = {g: {**head, "decode": decode[g], **({"lens": lens[g]} if g in lens else {})}
                 for g in decode}
    fp32 = _form(model, d, d / FP32_GRAPH, "fp32", with_lens[FP32_GRAPH])
    web = fp32
    if blocks is not None:
        web = {**_form(model, d, d / GRAPH, QUANTIZED, with_lens[GRAPH]), "fp32": FP32_MANIFEST}
        (d / FP32_MANIFEST).write_text(json.dumps(fp32, indent=1))
    web["export_seconds"] = round(time.perf_counter() - started, 1)
    (d / MANIFEST).write_text(json.dumps(web, indent=1))
    return web


def listed_files(web: dict) -> list[dict]:
    """Every file a manifest lists: graphs, chunks, the tokenizer's two."""
    return [web["graph"], *web["chunks"], web["tokenizer"], web["tokenizer_config"],
            *(web[g]["graph"] for g in ("decode", "lens") if g in web)]


def verify(d: Path, manifest: str = MANIFEST) -> dict:
    """web.json (or another manifest), after checking that every file it lists has its size
    and SHA-256 (what the page checks before it runs anything)."""
    try:
        web = json.loads((d / manifest).read_text())
        files = listed_files(web)
    except (OSError, ValueError, KeyError, TypeError):
        raise LlmTraceError(f"{d / manifest} is missing or unreadable: "
                            f"make it again with python -m llmtrace.export --rebuild") from None
    again = "make the export again (python -m llmtrace.export --rebuild)"
    for f in files:
        path = d / f["file"]
        if not path.is_file():
            raise LlmTraceError(f"{path} is missing: {again}")
        size = path.stat().st_size
        if size != f["size"]:
            raise LlmTraceError(f"{path} has {size:,} bytes, not {f['size']:,}: it was cut short "
                                f"or changed; {again}")
        if sha256(path) != f["sha256"]:
            raise LlmTraceError(f"{path} does not have the SHA-256 {manifest} gives: it changed; "
                                f"{again}")
    return web


# --- the GGUF's own blocks, held as they are ----------------------------------------------------
QUANTIZED = ("Q4_1 blocks (MatMulNBits) + Q8_0 embedding and head "
             "(GatherBlockQuantized, MatMulNBits)")
# a layer's quantized matrices (HF name after `model.layers.i.`) -> the record their MatMul makes
LINEAR_RECORDS = {"self_attn.q_proj.weight": "attn.q_proj",
                  "self_attn.k_proj.weight": "attn.k_proj",
                  "self_attn.v_proj.weight": "attn.v_proj",
                  "self_attn.o_proj.weight": "attn.out", "mlp.gate_proj.weight": "mlp.gate",
                  "mlp.up_proj.weight": "mlp.up", "mlp.down_proj.weight": "mlp.down"}
BLOCK = 32  # weights per block, Q4_1 and Q8_0 alike


def q4_1_as_matmul_nbits(rows: np.ndarray, K: int):
    """Q4_1 rows [N, K/32 blocks of (d fp16, m fp16, 16 bytes)], w = d q + m, as MatMulNBits
    reads them, w = (q - zero_point) scale: the same 4-bit q, scale d, zero point -m/d (a float).
    Q4_1 puts weight j in the low nibble of byte j and j + 16 in its high nibble; MatMulNBits
    wants weights 2i, 2i+1 in byte i. A block with d = 0 holds m 32 times: q 1, scale m, zero 0.
    Returns (q [N, K/32, 16] uint8, scales [N * K/32], zero points [N * K/32]), fp32."""
    N, blocks = rows.shape[0], K // BLOCK
    b = rows.reshape(N, blocks, 20)  # [N, K/32, 20]
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    q = np.concatenate([b[..., 4:] & 0x0F, b[..., 4:] >> 4], axis=-1)  # [N, K/32, 32], in order
    flat = d == 0
    q = np.where(flat[..., None], 1, q).astype(np.uint8)
    scale = np.where(flat, m, d)
    zero = np.where(flat, 0, -m / np.where(flat, 1, d)).astype(np.float32)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)  # [N, K/32, 16]
    return packed, scale.reshape(-1), zero.reshape(-1)


def q8_0_as_uint8(rows: np.ndarray, D: int):
    """Q8_0 rows [V, D/32 blocks of (d fp16, 32 int8)], w = d q, as uint8 with the zero point
    128 that GatherBlockQuantized and MatMulNBits take by default for 8 bits: q + 128.
    Returns (q [V, D/32, 32] uint8, scales [V, D/32, 1] fp32)."""
    b = rows.reshape(rows.shape[0], D // BLOCK, 2 + BLOCK)  # [V, D/32, 34]
    d = b[..., 0:2].copy().view(np.float16).astype(np.float32)  # [V, D/32, 1]
    q = (b[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [V, D/32, 32]
    return q, d


def _dequantized_4(packed, scale, zero, N: int, K: int) -> np.ndarray:
    q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(N, K).astype(np.float32)
    zero, scale = (np.repeat(v.reshape(N, -1), BLOCK, axis=1) for v in (zero, scale))
    return (q - zero) * scale  # [N, K]


def quantize_graph(source: Path, target: Path, blocks: dict, model: Model) -> None:
    """The fp32 graph at `source` with its weight matrices replaced by the GGUF's blocks, saved
    to `target` (its data in target + ".data"): each linear layer's MatMul becomes MatMulNBits
    (4 bits), the embedding's Gather GatherBlockQuantized, the tied head's MatMul MatMulNBits
    (8 bits) on the same bytes. Every output keeps its name. Each block set is checked against
    the fp32 weight it replaces, so a wrong match cannot pass."""
    import onnx_ir as ir

    c = model.config
    if not c.tied_lm_head or blocks.get(hf_name("embed"), ("",))[0] != "Q8_0" \
            or any(blocks.get(n, ("",))[0] != "Q4_1" for n in _linear_names(c)):
        raise LlmTraceError(f"{model.name}: the quantized export reads a tied Q8_0 embedding and "
                            f"Q4_1 layers, as the embedded GGUF holds them")
    graph_model = ir.load(str(source))
    g = graph_model.graph
    made = {n.outputs[0].name: n for n in g}  # a record's name -> the node that makes it

    def constant(name: str, array: np.ndarray) -> ir.Value:
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        g.register_initializer(value)
        return value

    def swap(old, op: str, inputs: list, **attributes) -> None:
        """`old`'s output, made by a com.microsoft `op` instead, under the same name."""
        new = ir.node(op, inputs, attributes=attributes, domain="com.microsoft")
        g.insert_before(old, new)
        _rename(old, new, g)

    for name in _linear_names(c):
        i, part = name.split(".", 3)[2], name.split(".", 3)[3]
        node = made[f"layers.{i}.{LINEAR_RECORDS[part]}"]
        x, w = node.inputs  # w: W^T [K, N], as the exporter folded it
        K, N = w.shape
        packed, scale, zero = q4_1_as_matmul_nbits(blocks[name][1], K)
        _check_same(name, _dequantized_4(packed, scale, zero, N, K),
                    w.const_value.numpy().T, model)
        swap(node, "MatMulNBits", [x, constant(f"{name}.q4", packed),
                                   constant(f"{name}.scales", scale),
                                   constant(f"{name}.zero_points", zero)],
             K=K, N=N, bits=4, block_size=BLOCK)

    V, D = c.vocab_size, c.hidden_size
    q, d = q8_0_as_uint8(blocks[hf_name("embed")][1], D)
    _check_same("embed_tokens", ((q.astype(np.float32) - 128) * d).reshape(V, D),
                model.weights.embed.numpy(), model)
    table = constant("model.embed_tokens.q8", q)  # [V, D/32, 32]: both nodes read it
    gather = made["embed"]
    rows = ir.node("GatherBlockQuantized", [table, gather.inputs[1], constant(
        "model.embed_tokens.scales", d)], attributes={"gather_axis": 0, "quantize_axis": 2,
                                                      "block_size": BLOCK, "bits": 8},
        domain="com.microsoft")  # [1, T, D/32, 32]
    g.insert_before(gather, rows)
    flat = ir.node("Reshape", [rows.outputs[0], constant(
        "embed.shape", np.array([0, 0, D], dtype=np.int64))])  # [1, T, D]
    g.insert_before(gather, flat)
    _rename(gather, flat, g)
    head = made[LOGITS]
    transposed = head.inputs[1].producer()  # embed_tokens^T, for the fp32 MatMul
    swap(head, "MatMulNBits", [head.inputs[0], table,
                               constant("model.embed_tokens.scales_flat", d.reshape(-1))],
         K=D, N=V, bits=8, block_size=BLOCK)
    if transposed is not None and not transposed.outputs[0].uses():
        g.remove(transposed, safe=True)
    for name, value in list(g.initializers.items()):  # the fp32 matrices, now read by nothing
        if not value.uses():
            del g.initializers[name]
    graph_model.opset_imports["com.microsoft"] = 1
    ir.save(graph_model, str(target), external_data=target.name + ".data")


def _linear_names(c) -> list[str]:
    return [f"model.layers.{i}.{part}" for i in range(c.n_layers) for part in LINEAR_RECORDS]


def _rename(old, new, g) -> None:
    """`new` takes `old`'s place: its output gets the name, type and shape, and every use."""
    out = old.outputs[0]
    name, dtype, shape = out.name, out.dtype, out.shape
    out.replace_all_uses_with(new.outputs[0], replace_graph_outputs=True)
    g.remove(old, safe=True)
    new.outputs[0].name, new.outputs[0].dtype, new.outputs[0].shape = name, dtype, shape


def _check_same(name: str, dequantized: np.ndarray, weight: np.ndarray, model: Model) -> None:
    """The blocks must be the weights the trace ran: equal up to fp32 rounding of -m/d."""
    worst = float(np.abs(dequantized - weight).max())
    if worst > 1e-6 * max(float(np.abs(weight).max()), 1.0):
        raise LlmTraceError(f"{model.name}: the GGUF blocks of {name} are {worst:.1e} from the "
                            f"weights the trace runs: the file is not the one loaded")


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
    from .disk_cache import (atomic_path, build_lock, cache_subdir, check_writable, collect_stale,
                             usable, write_manifest)

    root = cache_subdir("web")
    target = root / cache_key()
    collect_stale(root, target.name)
    if not rebuild and usable(target) is None:
        return target
    with build_lock(root, target.name):
        if rebuild or usable(target) is not None:
            from .load import load_model
            from .weights.gguf import EMBEDDED_FILE, embedded_gguf_path, read_blocks

            # at the peak: the fp32 data file and its chunks, the blocks' file and its chunks
            check_writable(root, 1400 * 2**20)
            model = load_model("embedded")
            with atomic_path(target, directory=True) as tmp:
                write_web(model, tmp, label=EMBEDDED_FILE.split(".")[0],
                          blocks=read_blocks(embedded_gguf_path(), model.config))
                write_manifest(tmp)  # last: the disk cache's rule, `usable`
            _prune(root, target)
    return target


def _prune(root: Path, target: Path) -> None:
    """Each change of the library makes a new export of 540 MB: keep the newest KEEP."""
    done = [d for d in root.glob("smollm2-135m-*") if (d / "manifest.json").is_file()]
    done.sort(key=lambda d: (d == target, (d / "manifest.json").stat().st_mtime), reverse=True)
    for old in done[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)
        (root / f".lock-{old.name}").unlink(missing_ok=True)


def manifests(d: Path) -> list[str]:
    """web.json, and the fp32 form's manifest when web.json names another form."""
    web = json.loads((d / MANIFEST).read_text())
    return [MANIFEST] + ([web["fp32"]] if "fp32" in web else [])


def check_out(out: Path, keep: Path) -> None:
    """Before the export is looked up (or made): `out` can take the page's files. Placing them
    replaces `out`, so it must lie apart from `keep` (the cache, which holds the export), and be
    empty or an earlier export; the nearest directory above it that exists must be writable."""
    o, k = out.resolve(), keep.resolve()
    if o == k or k in o.parents or o in k.parents:
        where = "holds" if o in k.parents else "is in"
        raise LlmTraceError(f"--out {out} {where} the cache {keep}, which keeps the export: "
                            f"choose a --out outside it")
    if out.exists() and not (out.is_dir() and (not any(out.iterdir())
                                                or (out / MANIFEST).is_file())):
        raise LlmTraceError(f"{out} exists and holds no export (no {MANIFEST}): "
                            f"choose another --out")
    above = _existing(o.parent)
    if not above.is_dir():
        raise LlmTraceError(f"{above} is a file, not a directory, so --out {out} cannot be "
                            f"made: choose another --out")
    if not os.access(above, os.W_OK | os.X_OK):
        raise LlmTraceError(f"cannot write in {above}, so --out {out} cannot be made: "
                            f"choose a --out in a directory you can write")


def _existing(path: Path) -> Path:
    """The path itself if it exists, else the nearest directory above it that does."""
    while not path.exists():
        path = path.parent
    return path


def place(d: Path, out: Path) -> None:
    """The page's files (not the cache's manifest) into `out`: hard links where the disk allows,
    else copies. They are gathered in a temporary beside `out`, renamed into place at the end, so
    a failure leaves nothing half-written. `out` is replaced if it holds an earlier export."""
    check_out(out, d)
    names = []
    for manifest in manifests(d):
        web = verify(d, manifest)
        files = listed_files(web)
        names += [f["file"] for f in files] + [manifest]
    final = out.resolve()
    above = _existing(final.parent)  # the directories made below it go again if placing fails
    tmp = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.{os.getpid()}.", dir=final.parent))
        tmp.chmod(0o755)  # mkdtemp's 0700: a static host must read it
        for name in dict.fromkeys(names):
            try:
                os.link(d / name, tmp / name)
            except OSError:  # another disk, or links not allowed
                shutil.copyfile(d / name, tmp / name)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except OSError as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for made in [final.parent, *final.parent.parents]:
            if made == above:
                break
            with contextlib.suppress(OSError):
                made.rmdir()
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise LlmTraceError(f"the disk holding {out} is full: free some space, "
                                f"or choose a --out on another disk") from None
        raise LlmTraceError(f"cannot write {out} ({e.strerror or e}): "
                            f"choose a --out in a directory you can write") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage and exits; here: one line, exit status 2
        raise LlmTraceError(f"{message}: see python -m llmtrace.export --help")


def main(argv=None) -> int:
    from .disk_cache import cache_dir

    p = _Parser(prog="python -m llmtrace.export", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None,
                   help="also put the page's files into this directory (hard links if possible; "
                        "outside the cache; an earlier export there is replaced)")
    p.add_argument("--rebuild", action="store_true", help="export again even if cached")
    try:
        args = p.parse_args(argv)
        if args.out is not None:
            if not args.out.strip():  # Path("") would be the current directory
                raise LlmTraceError("--out is empty: name a directory, e.g. --out site/web")
            args.out = Path(args.out)
            check_out(args.out, cache_dir())  # before a minute's export, not after it
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


if __name__ == "__main__":  # the package's module, not __main__: its class names enter the graph
    from llmtrace.export import main as package_main

    sys.exit(package_main())
