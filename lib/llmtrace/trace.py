"""The trace: an ordered record of every operation's output.

Each layer calls `trace.record(name, op, tensor, macs)` once per operation and gets its tensor
back. Names say where and what, following the module tree: `layers.3.attn.scores`. The record
keeps the tensor itself (no copy: it is the very tensor the next op reads) unless the trace was
asked for shapes only or for a subset of names. With tracing off, `NO_TRACE.record` just returns
the tensor.

A patch changes a named tensor as it flows: `Patched` wraps a trace (or `NO_TRACE`), hands each
matching operation's output to the patch function, and passes on (and records) what it returns.
The model wraps its trace only when a patch is given, so `record` itself never looks for one.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import inspect
import re
import textwrap
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from .errors import LlmTraceError


@dataclass(slots=True)
class Record:
    name: str  # where and what: "layers.3.attn.scores"
    op: str  # how it was computed: "q @ k^T / sqrt(64)"
    shape: tuple[int, ...]
    dtype: str  # "float32", "int64"
    macs: int  # multiply-adds this op performed (0 for lookups, reshapes and element-wise ops)
    tensor: torch.Tensor | None  # None when the trace keeps shapes only or filtered this name out

    def to_dict(self) -> dict:
        return {"name": self.name, "op": self.op, "shape": list(self.shape), "dtype": self.dtype,
                "macs": self.macs}


def _name_filter(names) -> Callable[[str], bool]:
    if names is None:
        return lambda name: True
    if callable(names):
        return names
    patterns = [names] if isinstance(names, str) else list(names)
    return lambda name: any(fnmatch.fnmatchcase(name, p) for p in patterns)


class Trace:
    """Records of one forward pass (or one sampling step), in the order they ran.

    keep_values=False keeps shapes, dtypes and costs but no tensors. `names` (a glob, a list of
    globs, or a callable on the name) chooses which records keep their tensor; every operation is
    recorded either way, so the data flow stays complete.
    """

    def __init__(self, keep_values: bool = True, names=None, label: str = ""):
        self.keep_values = keep_values
        self._keep = _name_filter(names)
        self.label = label
        self.records: list[Record] = []
        self._index: dict[str, Record] = {}

    def record(self, name: str, op: str, tensor: torch.Tensor, macs: int = 0) -> torch.Tensor:
        keep = self.keep_values and tensor.device.type != "meta" and self._keep(name)
        rec = Record(name, op, tuple(tensor.shape), _dtype_name(tensor.dtype), int(macs),
                     tensor.detach() if keep else None)
        self.records.append(rec)
        self._index[name] = rec  # a name recorded twice (never by the model) keeps its latest
        return tensor

    # --- look-ups ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def get(self, name: str) -> Record:
        if not isinstance(name, str) or name not in self._index:
            from .check import suggest

            hint = suggest(name, self.names)  # the closest names, from the same layer
            raise LlmTraceError(f"no record named {name!r} in this trace{hint}")
        return self._index[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        """The recorded tensor: `trace["layers.0.attn.weights"]`."""
        rec = self.get(name)
        if rec.tensor is None:
            why = ("this trace keeps shapes only" if not self.keep_values
                   else "its name was filtered out")
            raise LlmTraceError(f"record {name!r} holds no tensor ({why}): "
                                "trace with keep_values=True")
        return rec.tensor

    def shape(self, name: str) -> tuple[int, ...]:
        return self.get(name).shape

    def find(self, pattern: str) -> list[Record]:
        """Records whose name matches a glob: `trace.find("layers.*.attn.scores")`."""
        return [r for r in self.records if fnmatch.fnmatchcase(r.name, pattern)]

    def layer(self, i: int) -> list[Record]:
        return self.find(f"layers.{i}.*")

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.records]

    @property
    def total_macs(self) -> int:
        return sum(r.macs for r in self.records)

    def nbytes(self) -> int:
        """Bytes of memory the kept tensors occupy. A view (`q` of `q_proj`, a slice of the KV
        cache) and a tensor recorded under several names (the causal mask) share memory: counted
        once."""
        storages = {}
        for r in self.records:
            if r.tensor is not None:
                s = r.tensor.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())

    # --- views ------------------------------------------------------------------------------
    def table(self, pattern: str | None = None, layers: int | None = None) -> str:
        """A plain-text data-flow table (name, op, shape, MACs) whose rows fit TABLE_WIDTH: an op
        too long for its column continues on the next line. `layers=1` shows the first layer in
        full and folds the rest into one line, as the seed's diagram does. The dtype most tensors
        share is said once, under the table; any other dtype follows its tensor's shape."""
        rows = self.records if pattern is None else self.find(pattern)
        common = Counter(r.dtype for r in rows).most_common(1)[0][0] if rows else None
        lines, folded = [], 0
        for r in rows:
            if layers is not None and r.name.startswith("layers."):
                if int(r.name.split(".")[1]) >= layers:
                    folded += 1
                    continue
            shape = _fmt_shape(r.shape) + ("" if r.dtype == common else f" {r.dtype}")
            lines.append((r.name, r.op, shape, f"{r.macs:,}" if r.macs else ""))
            if folded == 0 and layers is not None and r.name == f"layers.{layers - 1}.resid_out":
                n_layers = len({x.name.split(".")[1] for x in rows if x.name.startswith("layers.")})
                if n_layers > layers:
                    lines.append((f"layers.{layers}..{n_layers - 1}",
                                  f"same ops, {n_layers - layers} more layers", "", ""))
        table = _format_rows(("name", "op", "shape", "MACs"), lines, wrap=1)
        if common is None:
            return table
        if all(r.dtype == common for r in rows):
            return f"{table}\nevery tensor above is {common}"
        return f"{table}\nevery tensor above is {common}, unless another dtype follows its shape"

    def compare(self, other: Trace, pattern: str | None = None, mark: bool = True) -> str:
        """Two traces side by side by name, e.g. prefill vs a decode step, or TinyLlama's shapes
        beside the model that ran. mark=False drops the column that flags differing shapes."""
        mine = self.records if pattern is None else self.find(pattern)
        theirs = {r.name: r for r in (other.records if pattern is None else other.find(pattern))}
        lines = []
        for r in mine:
            o = theirs.get(r.name)
            other_shape = _fmt_shape(o.shape) if o else "-"
            row = (r.name, _fmt_shape(r.shape), other_shape,
                   "" if o and o.shape == r.shape else "*")
            lines.append(row if mark else row[:3])
        left, right = self.label or "this", other.label or "other"
        return _format_rows(("name", left, right, "differs")[: 4 if mark else 3], lines)

    def to_dicts(self) -> list[dict]:
        return [r.to_dict() for r in self.records]

    def __repr__(self) -> str:
        kept = sum(r.tensor is not None for r in self.records)
        return (f"Trace({self.label!r}: {len(self.records)} records, {kept} with values, "
                f"{self.total_macs:,} MACs)")


class _NoTrace:
    """Tracing off: `record` hands the tensor straight back."""

    def record(self, name, op, tensor, macs=0):
        return tensor


NO_TRACE = _NoTrace()


class Patched:
    """A trace that changes named tensors as they flow on: `{name_or_glob: fn}`.

    `fn(tensor)` or `fn(tensor, name)` receives the output of each operation whose name matches,
    and returns the tensor that flows on to the next operation (same shape); the wrapped trace
    records what flowed on, its op marked "[patched]". Return a new tensor: changing one in place
    also changes the records that share its memory (`q` is a view of `q_proj`; every layer reads the
    same `causal_mask`). After the pass, `check_all_matched` refuses a name that matched nothing.
    """

    def __init__(self, patch: dict, trace=NO_TRACE):
        if not isinstance(patch, dict) or not all(isinstance(k, str) and callable(f)
                                                  for k, f in patch.items()):
            raise LlmTraceError("patch must be a dict {name or glob: function}, e.g. "
                                "{'layers.3.resid_out': lambda t: t * 0}")
        self.trace = trace
        self._fns = {name: (fn, _takes_name(fn)) for name, fn in patch.items()}
        self._exact = {n for n in patch if not _is_glob(n)}
        self._globs = [(re.compile(fnmatch.translate(g)), g) for g in patch if _is_glob(g)]
        self._matched: set[str] = set()
        self._seen: list[str] = []

    def _key(self, name: str) -> str | None:
        if name in self._exact:
            return name
        return next((g for pattern, g in self._globs if pattern.match(name)), None)

    def record(self, name: str, op: str, tensor: torch.Tensor, macs: int = 0) -> torch.Tensor:
        self._seen.append(name)
        key = self._key(name)
        if key is not None:
            fn, takes_name = self._fns[key]
            out = fn(tensor, name) if takes_name else fn(tensor)
            if not isinstance(out, torch.Tensor) or out.shape != tensor.shape:
                got = _fmt_shape(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise LlmTraceError(f"the patch for {name!r} returned {got}, not a tensor of the "
                                    f"op's shape {_fmt_shape(tensor.shape)}: return what flows on")
            self._matched.add(key)
            tensor, op = out, f"{op} [patched]"
        return self.trace.record(name, op, tensor, macs)

    def check_all_matched(self) -> None:
        """After a pass: every name or glob of the patch must have matched an operation."""
        missed = [k for k in self._fns if k not in self._matched]
        if not missed:
            return
        # the names this pass recorded, and the same with any layer number as a glob
        globbed = [re.sub(r"^layers\.\d+\.", "layers.*.", n) for n in self._seen]
        known = list(dict.fromkeys(self._seen + globbed))
        layers = {int(m[1]) for n in self._seen if (m := re.match(r"layers\.(\d+)\.", n))}
        hints = []
        for k in missed:
            notes = []
            if layers and (m := re.match(r"layers\.(\d+)\.", k)) and int(m[1]) not in layers:
                notes.append(f"this model's layers are 0..{max(layers)}")
            close = difflib.get_close_matches(k, known, n=3, cutoff=0.6)
            if close:
                notes.append(f"close: {', '.join(close)}")
            hints.append(f"{k!r}" + (f" ({'; '.join(notes)})" if notes else ""))
        raise LlmTraceError(f"patch names matching no operation of the forward pass: "
                            f"{'; '.join(hints)}: use the trace's names (model.run(...)[1].names)")


def _is_glob(name: str) -> bool:
    return any(ch in name for ch in "*?[")


def _takes_name(fn) -> bool:
    """True when fn requires a second positional argument: `fn(tensor, name)`."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature get the tensor only
        return False
    required = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                and p.default is p.empty]
    return len(required) >= 2


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # torch.float32 -> "float32"


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


TABLE_WIDTH = 100  # characters in a row of `Trace.table`: a page of the book


def _format_rows(header, rows, wrap: int | None = None) -> str:
    """Left-aligned columns, each as wide as its widest cell. Column `wrap`, if given, narrows
    (to no less than 20) so that a row fits TABLE_WIDTH; a longer cell goes on below its row."""
    widths = ([max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows
              else [len(h) for h in header])
    if wrap is not None:
        room = TABLE_WIDTH - 2 * (len(widths) - 1) - (sum(widths) - widths[wrap])
        widths[wrap] = min(widths[wrap], max(room, 20))
        rows = [part for row in rows for part in _wrap_cell(row, wrap, widths[wrap])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths)).rstrip()]
    out += [fmt.format(*row).rstrip() for row in rows]
    return "\n".join(out)


def _wrap_cell(row: tuple, i: int, width: int) -> list[tuple]:
    """`row` with its cell `i` cut to `width` at a space, then a row for each further line of it,
    indented two spaces and blank in every other column."""
    cell = str(row[i])
    if len(cell) <= width:
        return [row]
    first, *more = textwrap.wrap(cell, width, subsequent_indent="  ") or [""]
    blank = ("",) * len(row)
    return [row[:i] + (first,) + row[i + 1:]] + [blank[:i] + (m,) + blank[i + 1:] for m in more]
