"""The trace: an ordered record of every operation's output.

Each layer calls `trace.record(name, op, tensor, macs)` once per operation and gets its tensor
back, to flow on to the next op. Names say where and what, following the module tree:
`layers.3.attn.scores`. The record keeps the tensor's values unless the trace was asked for shapes
only or for a subset of names. With tracing off, `NO_TRACE.record` just returns the tensor.

What a trace of every value holds, and where it lives:
- an op whose output is a cheap function of records kept before it says so
  (`recompute=(fn, *names)`: the masked scores are scores + mask, GQA's expanded K and V repeat
  the cache's heads, `merged` lays the heads side by side, the MLP's `act` is silu(gate)); its
  record keeps no tensor and computes it from those records when read, the same bits as the op;
- a view of a record (`q` of `q_proj`) and a tensor recorded under several names (the causal
  mask of every layer) share memory with it;
- the rest is copied into buffers of a `TracePool`: a dropped trace hands back the buffers no
  reader was ever given, and the next trace writes into memory the process already has instead
  of fresh pages that the kernel must map and zero one by one (glibc returns a large freed block
  to it).

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
import sys
import textwrap
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from .errors import LlmTraceError


class _Buffer:
    """One value a trace keeps in its pool's memory. `lent` turns true the first time a reader
    is handed a tensor on it: from then on the memory is the reader's, freed when the last
    reference goes, and never returned to the pool."""

    __slots__ = ("tensor", "lent", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.lent = tensor, False


@dataclass(slots=True, eq=False)
class Record:
    name: str  # where and what: "layers.3.attn.scores"
    op: str  # how it was computed: "q @ k^T / sqrt(64)"
    shape: tuple[int, ...]
    dtype: str  # "float32", "int64"
    macs: int  # multiply-adds this op performed (0 for lookups, reshapes and element-wise ops)
    # the tensor kept; None for shapes only, a filtered-out name, or a recipe's record. Read it
    # through `tensor`, which lends its memory to the reader (`_Buffer`)
    _held: torch.Tensor | None = field(default=None, repr=False)
    recipe: tuple | None = None  # (fn, *records): the tensor is fn of theirs, computed when read
    _buffer: _Buffer | None = field(default=None, repr=False)  # the pool memory _held is on

    @property
    def tensor(self) -> torch.Tensor | None:
        """The recorded tensor (None when the trace keeps none for this name)."""
        return self._read(lend=True)

    def _read(self, lend: bool) -> torch.Tensor | None:
        """The tensor; lend=True for a reader outside the trace, whose memory it becomes."""
        if self.recipe is None:
            if lend and self._buffer is not None:
                self._buffer.lent = True
            return self._held
        fn, *inputs = self.recipe
        with torch.inference_mode():  # as the pass made it
            out = fn(*(r._read(lend=False) for r in inputs))
        if lend:  # fn's output is new memory, unless it is a view of an input's
            where = out.untyped_storage().data_ptr()
            for r in _leaves(inputs):
                if r._held.untyped_storage().data_ptr() == where:
                    r._read(lend=True)
        return out

    @property
    def kept(self) -> bool:
        """Does reading this record give a tensor (held, or recomputed from held ones)?"""
        return self._held is not None or self.recipe is not None

    @property
    def recomputed(self) -> bool:
        """Is the tensor computed when read, from the records it is a function of?"""
        return self.recipe is not None

    def to_dict(self) -> dict:
        return {"name": self.name, "op": self.op, "shape": list(self.shape), "dtype": self.dtype,
                "macs": self.macs}


def _leaves(records) -> Iterator[Record]:
    """The records that hold the tensors a recipe reads, through recipes of recipes."""
    for r in records:
        if r.recipe is None:
            yield r
        else:
            yield from _leaves(r.recipe[1:])


def _owns_its_memory(t: torch.Tensor) -> bool:
    """Is t the whole of its storage, laid out densely (an op's fresh output), not a view?"""
    s = t.untyped_storage()
    return (t.is_contiguous() and t.storage_offset() == 0
            and s.nbytes() == t.numel() * t.element_size())


class TracePool:
    """Memory for the kept values of traces, reused from one trace to the next.

    A trace of every value is hundreds of MiB (about 500 for 256 tokens on the embedded model).
    Allocated afresh in each pass, every page of it is mapped and zero-filled by the kernel on
    first touch, because glibc's malloc hands a large freed block back to the operating system:
    for a 256-token pass, some 170,000 page faults, 0.35x of a plain forward. So a trace copies
    each value it keeps into a buffer of its pool (the op's own output flows on to the next op),
    and a dropped trace returns its buffers here: the next pass of the same shapes writes into
    memory the process already has.

    Returned is only memory that nothing outside the trace can have reached, which the trace
    knows for itself rather than asks PyTorch: a buffer never flows on through the model, and a
    reader gets one only through a record (`Record.tensor`, `trace[name]`), which marks it lent
    for good. So a buffer comes back when no reader was ever handed it, no record or copy of the
    trace still refers to it, and it was not moved to shared memory. A lent buffer is the
    reader's: freed when their last reference goes, whatever they made of it (a view, a storage,
    a NumPy array, a tensor sent to another process). The pool holds what the last dropped trace
    returned, at most one trace's bytes: `clear()` frees it. Several threads may trace at once.
    Nothing changes for the rest of the process (no malloc setting). Every trace uses `POOL`
    unless given another (pool=None: none, each value kept where its op wrote it).
    """

    def __init__(self):
        self._free: dict[tuple, list] = {}  # (shape, stride, dtype, device) -> storages
        # reentrant: a trace dropped by the garbage collector inside `take` gives in this thread
        self._lock = threading.RLock()

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """A tensor laid out as `like`: in returned memory if there is some, else new."""
        key = (like.shape, like.stride(), like.dtype, like.device)
        with self._lock:
            free = self._free.get(key)
            storage = free.pop() if free else None
        if storage is None:
            return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype,
                                       device=like.device)
        out = torch.empty(0, dtype=like.dtype, device=like.device)
        return out.set_(storage, 0, like.shape, like.stride())

    def give(self, buffers: list[_Buffer]) -> None:
        """A dropped trace's buffers (the list is emptied): the memory of those that no reader
        was lent, and no record still refers to, replaces what the pool held."""
        free: dict[tuple, list] = {}
        while buffers:
            b = buffers.pop()
            t = b.tensor
            key = (t.shape, t.stride(), t.dtype, t.device)
            storage, alive, lent = t.untyped_storage(), weakref.ref(b), b.lent
            del b, t  # the last references here: alive() is None unless a record holds it
            if not lent and alive() is None and not storage.is_shared():
                free.setdefault(key, []).append(storage)
        with self._lock:
            self._free = free

    def nbytes(self) -> int:
        """Bytes the pool holds for the next trace."""
        with self._lock:
            return sum(s.nbytes() for free in self._free.values() for s in free)

    def clear(self) -> None:
        with self._lock:
            self._free = {}

    def __deepcopy__(self, memo):  # a copied trace writes into the same process's pool
        return self


POOL = TracePool()  # the traces' pool, unless a trace is given its own


def _name_filter(names) -> tuple[Callable[[str], bool], list[str]]:
    """(keep, globs): which names keep their tensor, and the globs to account for after a pass."""
    if names is None:
        return (lambda name: True), []
    if callable(names):
        return names, []
    patterns = [names] if isinstance(names, str) else names
    if not isinstance(patterns, (list, tuple, set, frozenset)) \
            or not all(isinstance(p, str) for p in patterns):
        raise LlmTraceError(f"names must be a glob, a list of globs or a function of the name, "
                            f"got {type(names).__name__}: e.g. names='layers.*.attn.weights'")
    patterns = list(patterns)
    exact = {p for p in patterns if not _is_glob(p)}
    globs = [re.compile(fnmatch.translate(p)) for p in patterns if _is_glob(p)]
    return (lambda name: name in exact or any(g.match(name) for g in globs)), patterns


class Trace:
    """Records of one forward pass (or one sampling step), in the order they ran.

    keep_values=False keeps shapes, dtypes and costs but no tensors. `names` (a glob, a list of
    globs, or a callable on the name) chooses which records keep their tensor; every operation is
    recorded either way, so the data flow stays complete. keep_on: where kept values live: None,
    on the device that computed them; "cpu", copied there as they are recorded (a GPU's memory
    then holds only the pass).
    """

    def __init__(self, keep_values: bool = True, names=None, label: str = "",
                 pool: TracePool | None = POOL, keep_on=None):
        if not isinstance(keep_values, bool):
            raise LlmTraceError(f"keep_values must be True or False, got {keep_values!r}")
        if keep_on is not None:
            from .check import check_device

            keep_on = check_device(keep_on)
        self.keep_on = keep_on
        self.keep_values = keep_values
        self._keep, self._patterns = _name_filter(names)
        self.keeps_all = names is None  # every record keeps its tensor (if keep_values)
        self.label = label
        self.records: list[Record] = []
        self._index: dict[str, Record] = {}
        self.pool = pool  # where kept values are copied to (`TracePool`)
        self._buffers: list[_Buffer] = []  # the pool memory this trace's values live in
        # the address of each storage copied from -> (a weak reference to that storage, the
        # copy's buffer): a view of it, or the same tensor recorded again, is kept on the
        # buffer, not copied once more. PyTorch keeps one Python object per storage for as
        # long as the memory lives, so the reference dies with the memory, views and all
        self._copied: dict[int, tuple[weakref.ref, _Buffer]] = {}

    def record(self, name: str, op: str, tensor: torch.Tensor, macs: int = 0,
               recompute: tuple | None = None) -> torch.Tensor:
        """Record one op's output and return it, to flow on. recompute=(fn, *names): the output
        is fn of the tensors of those records (made before it); when they keep their tensors,
        this record keeps none and computes it when read."""
        keep = self.keep_values and tensor.device.type != "meta" and self._keep(name)
        held = recipe = buffer = None
        if keep:
            recipe = self._recipe(recompute)
            if recipe is None:
                held, buffer = self._hold(tensor)
        rec = Record(name, op, tuple(tensor.shape), _dtype_name(tensor.dtype), int(macs),
                     held, recipe, buffer)
        self.records.append(rec)
        self._index[name] = rec  # a name recorded twice (never by the model) keeps its latest
        return tensor

    def _recipe(self, recompute) -> tuple | None:
        """(fn, *records) when every record `recompute` names keeps its tensor, else None."""
        if recompute is None:
            return None
        fn, *names = recompute
        inputs = [self._index.get(n) for n in names]
        if not all(r is not None and r.kept for r in inputs):
            return None
        return (fn, *inputs)

    def _hold(self, t: torch.Tensor) -> tuple[torch.Tensor, _Buffer | None]:
        """What to keep for t, and the pool buffer it is on: t itself without a pool, or when t
        is a view of memory the pass did not make here (a KV cache, the caller's token ids, a
        sampling step's outside the model); the buffer of the tensor t views, when that tensor
        was copied already (`q` viewing `q_proj`, the causal mask recorded in every layer); else
        a copy of t in a new buffer of the pool. t itself flows on, never the copy."""
        if self.keep_on is not None and t.device != self.keep_on:
            return t.detach().to(self.keep_on), None  # a copy there, outside the pool
        if self.pool is None:
            return t.detach(), None
        storage = t.untyped_storage()
        ref, buffer = self._copied.get(storage.data_ptr(), (None, None))
        if ref is not None and ref() is storage:  # the memory copied, not a reuse of its address
            kept = buffer.tensor
            if (t.shape, t.stride(), t.storage_offset()) == (kept.shape, kept.stride(), 0):
                return kept, buffer
            if t.dtype == kept.dtype:  # t's own layout, on the buffer's memory
                view = torch.empty(0, dtype=t.dtype, device=t.device)
                return view.set_(kept.untyped_storage(), t.storage_offset(), t.shape,
                                 t.stride()), buffer
        if not _owns_its_memory(t) or not t.is_inference():
            return t.detach(), None
        buffer = _Buffer(self.pool.take(t).copy_(t.detach()))
        self._buffers.append(buffer)
        self._copied[storage.data_ptr()] = (weakref.ref(storage), buffer)
        return buffer.tensor, buffer

    def __del__(self):
        # the kept values' memory goes back to the pool, for the next trace to write into
        buffers = getattr(self, "_buffers", None)
        if buffers and self.pool is not None:
            self.records, self._index, self._copied, self._buffers = [], {}, {}, []
            self.pool.give(buffers)

    def __getstate__(self) -> dict:
        """A copy (copy, deepcopy, pickle) holds its records and owns no pool memory: the
        buffers stay this trace's, and go back to the pool only when no record refers to them."""
        state = dict(self.__dict__)
        state.update(_buffers=[], _copied={}, pool=None)
        return state

    # --- look-ups ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def keeps(self, name: str) -> bool:
        """Would a record of this name keep its tensor?"""
        return self.keep_values and self._keep(name)

    def check_names_matched(self) -> None:
        """After a pass: each name or glob of `names` must have matched a record."""
        missed = [p for p in self._patterns if not self.find(p)]
        if missed:
            raise LlmTraceError(f"names matching no record of the pass: "
                                f"{'; '.join(f'{p!r}{suggest(p, self.names)}' for p in missed)}"
                                f": use the trace's names (trace.names)")

    def get(self, name: str) -> Record:
        if not isinstance(name, str) or name not in self._index:
            hint = suggest(name, self.names)  # the closest names, from the same layer
            raise LlmTraceError(f"no record named {name!r} in this trace{hint}")
        return self._index[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        """The recorded tensor: `trace["layers.0.attn.weights"]`."""
        rec = self.get(name)
        if not rec.kept:
            why = ("this trace keeps shapes only" if not self.keep_values
                   else "its name was filtered out")
            raise LlmTraceError(f"record {name!r} holds no tensor ({why}): "
                                "trace with keep_values=True")
        return rec.tensor

    def shape(self, name: str) -> tuple[int, ...]:
        return self.get(name).shape

    def find(self, pattern: str) -> list[Record]:
        """Records whose name matches a glob: `trace.find("layers.*.attn.scores")`."""
        if not isinstance(pattern, str):
            raise LlmTraceError(f"find takes a glob on the records' names, got "
                                f"{type(pattern).__name__}: e.g. trace.find('layers.*.attn.q')")
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
        once. A record recomputed when read holds none."""
        storages = {}
        for r in self.records:
            if r._held is not None:
                s = r._held.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        return sum(storages.values())

    # --- views ------------------------------------------------------------------------------
    def table(self, pattern: str | None = None, layers: int | None = None) -> str:
        """A plain-text data-flow table (name, op, shape, MACs) whose rows fit TABLE_WIDTH: an op
        too long for its column continues on the next line. `layers=1` shows the first layer in
        full and folds the rest into one line, as the seed's diagram does. The dtype most tensors
        share is said once, under the table; any other dtype follows its tensor's shape."""
        if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int)
                                   or layers < 1):
            raise LlmTraceError(f"layers must be a whole number of layers, at least 1, got "
                                f"{layers!r}: layers=1 shows the first layer in full")
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
                ops: dict[str, set] = {}  # layer -> the names of its ops
                for x in rows:
                    if x.name.startswith("layers."):
                        _, i, op = x.name.split(".", 2)
                        ops.setdefault(i, set()).add(op)
                n_layers = len(ops)
                if n_layers > layers:
                    # Gemma 3's full and sliding layers differ: say which ops some lack
                    some = sorted(set.union(*ops.values()) - set.intersection(*ops.values()))
                    what = (f"{n_layers - layers} more layers; {', '.join(some)} in some only"
                            if some else f"same ops, {n_layers - layers} more layers")
                    lines.append((f"layers.{layers}..{n_layers - 1}", what, "", ""))
        table = format_rows(("name", "op", "shape", "MACs"), lines, wrap=1)
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
        return format_rows(("name", left, right, "differs")[: 4 if mark else 3], lines)

    def to_dicts(self) -> list[dict]:
        return [r.to_dict() for r in self.records]

    def __repr__(self) -> str:
        kept = sum(r.kept for r in self.records)
        return (f"Trace({self.label!r}: {len(self.records)} records, {kept} with values, "
                f"{self.total_macs:,} MACs)")


class _NoTrace:
    """Tracing off: `record` hands the tensor straight back."""

    def record(self, name, op, tensor, macs=0, recompute=None):
        return tensor


NO_TRACE = _NoTrace()


class Patched:
    """A trace that changes named tensors as they flow on: `{name_or_glob: fn}`.

    `fn(tensor)` or `fn(tensor, name)` receives the output of each operation whose name matches
    (the first key that matches, in the dict's order), and returns the tensor that flows on to the
    next operation: same shape, dtype and device. The wrapped trace records what flowed on, its op
    marked "[patched]". Return a new tensor: changing one in place also changes the records that
    share its memory (`q` is a view of `q_proj`; every layer reads the same `causal_mask`). After
    the pass, `check_all_matched` refuses a key that changed nothing.
    """

    def __init__(self, patch: dict, trace=NO_TRACE, vocab_size: int | None = None):
        if not isinstance(patch, dict) or not all(isinstance(k, str) and callable(f)
                                                  for k, f in patch.items()):
            raise LlmTraceError("patch must be a dict {name or glob: function}, e.g. "
                                "{'layers.3.resid_out': lambda t: t * 0}")
        self.trace = trace
        self.vocab_size = vocab_size  # to check patched token ids
        self._fns = {name: (fn, _arity(name, fn)) for name, fn in patch.items()}
        self._keys = [(re.compile(fnmatch.translate(k)), k) for k in patch]
        self._used: set[str] = set()  # keys that patched an operation
        self._shadowed: dict[str, str] = {}  # key -> the earlier key that took its operation
        self._seen: list[str] = []

    def _key(self, name: str) -> str | None:
        matches = [k for pattern, k in self._keys if pattern.match(name)]
        for later in matches[1:]:
            self._shadowed.setdefault(later, matches[0])
        return matches[0] if matches else None

    def record(self, name: str, op: str, tensor: torch.Tensor, macs: int = 0,
               recompute: tuple | None = None) -> torch.Tensor:
        self._seen.append(name)
        key = self._key(name)
        if key is not None:
            fn, arity = self._fns[key]
            out = fn(tensor, name) if arity == 2 else fn(tensor)
            self._check(name, tensor, out)
            self._used.add(key)
            # what flows on is the patch's: the record keeps it, recomputes nothing
            tensor, op, recompute = out, f"{op} [patched]", None
        return self.trace.record(name, op, tensor, macs, recompute)

    def _check(self, name: str, before: torch.Tensor, out) -> None:
        """What a patch returns flows on: it must be what the next operation can read."""
        want = f"{_fmt_shape(before.shape)} {_dtype_name(before.dtype)} on {before.device.type}"
        if isinstance(out, torch.Tensor):
            got = f"{_fmt_shape(out.shape)} {_dtype_name(out.dtype)} on {out.device.type}"
        else:
            got = type(out).__name__
        if got != want:
            raise LlmTraceError(f"the patch for {name!r} returned {got}, not the op's {want}: "
                                f"return a tensor like the one it received")
        if self.vocab_size is not None and not before.is_floating_point() \
                and out.device.type != "meta" and out.numel():
            low, high = int(out.min()), int(out.max())
            if low < 0 or high >= self.vocab_size:
                raise LlmTraceError(f"the patch for {name!r} returned token id "
                                    f"{low if low < 0 else high}, outside the vocabulary "
                                    f"(0 .. {self.vocab_size - 1}): return ids the model knows")

    def check_all_matched(self) -> None:
        """After a pass: every name or glob of the patch must have patched an operation."""
        missed = [k for k in self._fns if k not in self._used]
        if not missed:
            return
        hints = []
        for k in missed:
            if k in self._shadowed:
                hints.append(f"{k!r} (every operation it matches was taken by the earlier "
                             f"{self._shadowed[k]!r}: put the narrower key first)")
            else:
                hints.append(f"{k!r}{suggest(k, self._seen)}")
        raise LlmTraceError(f"patch keys that changed no operation of the pass: "
                            f"{'; '.join(hints)}: use the trace's names (model.run(...)[1].names)")


def suggest(name, names: list[str]) -> str:
    """' (did you mean ...?)' for a name or glob not found among `names`: the closest names of the
    same layer, or the layers there are. The one "did you mean" of the library."""
    if not isinstance(name, str):
        return (": look a record up by its name, e.g. trace['layers.0.attn.q'] "
                "(trace.records[i] is the i-th one)")
    layers = sorted({int(m[1]) for n in names if (m := re.match(r"layers\.(\d+)\.", n))})
    m = re.match(r"layers\.(\d+)\.", name)
    pool = list(dict.fromkeys(names + [re.sub(r"^layers\.\d+\.", "layers.*.", n)
                                       for n in names]))
    if m:
        layer = int(m[1])
        if m[1] != str(layer) and layer in layers:
            right = f"layers.{layer}.{name[m.end():]}"
            return f" (layer numbers have no leading zero: {right!r})"
        if layer not in layers:
            return f" (this trace has {f'layers 0..{layers[-1]}' if layers else 'no layers'})"
        pool = [n for n in names if n.startswith(m[0])]
    close = difflib.get_close_matches(name, pool, n=3, cutoff=0.5)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _arity(key: str, fn) -> int:
    """2 when fn takes (tensor, name), 1 when it takes (tensor); anything else is refused."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature get the tensor only
        return 1
    for arity in (2, 1):
        try:
            sig.bind(*range(arity))
        except TypeError:
            continue
        required = [p for p in sig.parameters.values() if p.default is p.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if arity == 2 and len(required) < 2:
            continue  # fn(t, name=None): called with the tensor only
        return arity
    raise LlmTraceError(f"the patch for {key!r} takes {len(sig.parameters)} parameter(s): a patch "
                        f"takes (tensor) or (tensor, name) and returns the tensor that flows on")


def _is_glob(name: str) -> bool:
    return any(ch in name for ch in "*?[")


@functools.cache
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # torch.float32 -> "float32"


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


TABLE_WIDTH = 100  # characters in a row of `Trace.table`: a page of the book


def format_rows(header, rows, wrap: int | None = None, rule: bool = True) -> str:
    """Left-aligned columns, each as wide as its widest cell, the header ruled off (rule=True).
    Column `wrap`, if given, narrows (to no less than 20) so that a row fits TABLE_WIDTH; a longer
    cell goes on below its row."""
    widths = ([max(len(str(x)) for x in col) for col in zip(header, *rows)] if rows
              else [len(h) for h in header])
    if wrap is not None:
        room = TABLE_WIDTH - 2 * (len(widths) - 1) - (sum(widths) - widths[wrap])
        widths[wrap] = min(widths[wrap], max(room, 20))
        rows = [part for row in rows for part in _wrap_cell(row, wrap, widths[wrap])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header).rstrip()]
    if rule:
        out.append(fmt.format(*("-" * w for w in widths)).rstrip())
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
