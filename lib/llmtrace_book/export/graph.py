"""The forward pass exported to ONNX: the traced prefill graph, the decode step, the logit lens.

`Model.forward` is handed a `GraphTrace` and exported by PyTorch's own exporter
(`torch.onnx.export(..., dynamo=True)`): every record of the trace becomes a graph output under
its trace name, in trace order, and the input `ids` [1, T] keeps T free (`export_onnx`). The
graph is the library's pass, traced, not a second implementation of it. One decode step reading
the layers' `KVCache` (`export_decode`) and the logit lens (`export_lens`) are exported beside
it, their weights references into the main graph's data file (`share_data`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import warnings
from pathlib import Path

import torch

from ..errors import LlmTraceError, first_line
from ..model import TABLE_NAMES, Model, state_dict_from_weights, weights_from_state_dict
from ..trace import Record, Trace, _dtype_name
from .manifest import FP32_GRAPH, GRAPH, INPUT, LOGITS, _entry
from .pack import _lens_head_from_table

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
        self.config, self.norm = model.config, model.norm
        _buffers(self, {TABLE_NAMES["final_norm"]: model.weights.final_norm,
                        TABLE_NAMES["embed"]: model.weights.lm_head})

    def forward(self, resid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from types import SimpleNamespace

        from ..lens import grid_of

        buffers = dict(self.named_buffers())
        weights = SimpleNamespace(final_norm=buffers[TABLE_NAMES["final_norm"]],
                                  lm_head=buffers[TABLE_NAMES["embed"]])
        # the model's own head, on the two weights it reads
        model = SimpleNamespace(weights=weights, config=self.config, norm=self.norm)
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
                            f"fp32: load it with load_model(path, dtype='float32')")


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


def _relative_sources(graph) -> None:
    """Each node keeps the source lines that made it (the exporter's stack trace), named from
    the package (`llmtrace_book/model.py`), not from this machine's checkout or environment."""
    import sysconfig

    roots = [f"{Path(__file__).resolve().parents[2]}/", f"{sysconfig.get_path('purelib')}/"]
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
