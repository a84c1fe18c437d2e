"""The difference of two traces: what one model computes that another does not.

Two models of one family record the same operations under the same names; only the sizes differ.
A family that changes the machine shows up in its trace: an operation of its own (Qwen3's
`attn.q_norm`), one it lacks, or one computed another way (Llama 3's RoPE turns by llama3-scaled
frequencies). One layer of each trace is compared (layer 0 unless told), with the operations
outside the layers (`embed`, `final_norm`, `lm_head`).

    d = trace_diff(trace_shapes("tinyllama")[0], trace_shapes("qwen3-0.6b")[0])
    print("\\n".join(d.lines()))
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

from .check import check_int
from .errors import LlmTraceError
from .trace import Record, Trace, _fmt_shape


def layer_ops(trace: Trace, layer: int = 0) -> dict[str, Record]:
    """The records of one layer, named without their "layers.N." prefix, and the records outside
    the layers, in the order the trace made them."""
    check_trace(trace)
    check_int("layer", layer, minimum=0)
    prefix = f"layers.{layer}."
    ops = {r.name[len(prefix):]: r for r in trace if r.name.startswith(prefix)}
    if not ops:
        raise LlmTraceError(f"the trace {trace.label!r} has no layer {layer}: "
                            f"pick a layer below the model's count")
    ops.update({r.name: r for r in trace if not r.name.startswith("layers.")})
    return ops


def check_trace(trace) -> None:
    """trace_diff compares two `Trace` objects; say what to pass for what is often passed."""
    if isinstance(trace, Trace):
        return
    hint = {tuple: "model.run returns (logits, trace): pass its [1]",
            list: "trace_shapes returns [prefill, decode 1, ...]: pass one, e.g. its [0]"}
    kind = type(trace).__name__
    said = next((h for t, h in hint.items() if isinstance(trace, t)), None)
    if kind == "Generation":
        said = "generate keeps one trace per step: pass one, e.g. g.steps[0]"
    raise LlmTraceError(f"trace_diff compares two traces, got a {kind}: "
                        f"{said or 'pass model.run(prompt)[1] or trace_shapes(config)[0]'}")


def check_width(width) -> int:
    return check_int("width", width, minimum=1)


def same_op(a: str, b: str) -> bool:
    """Two descriptions of one operation, numbers aside: "split into 32 heads" and "split into
    8 heads" are the same operation at other sizes; "* freq" and "* llama3-scaled freq" are
    not."""
    def number_free(s):
        return re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", s)
    return number_free(a) == number_free(b)


@dataclass
class TraceDiff:
    added: list[Record]  # in b only, in b's order
    removed: list[Record]  # in a only, in a's order
    recomputed: list[tuple[Record, Record]]  # in both, another operation (numbers aside)
    reshaped: list[tuple[Record, Record]]  # in both, another shape

    def lines(self, shapes: bool = True, width: int = 80) -> list[str]:
        """The difference as printed lines: + added, - removed, ~ computed another way (then
        what it was), and (shapes=True) the shapes that changed."""
        check_width(width)
        named = self.added + self.removed + [b for _, b in self.recomputed]
        w = max((len(_short(r.name, 0)) for r in named), default=0)

        def line(mark, name, op):
            return textwrap.wrap(op, width, initial_indent=f"{mark} {name:{w}} ",
                                 subsequent_indent=" " * (w + 3))
        out = [s for r in self.added for s in line("+", _short(r.name, 0), r.op)]
        out += [s for r in self.removed for s in line("-", _short(r.name, 0), r.op)]
        for a, b in self.recomputed:
            out += line("~", _short(b.name, 0), b.op) + line(" ", "", "was " + a.op)
        if shapes:
            out += self.shape_lines(width)
        return out

    def shape_lines(self, width: int = 80) -> list[str]:
        """One line per change of shape, "[1, 6, 5632] -> [1, 6, 8192]", then the operations
        that changed so, wrapped to width."""
        check_width(width)
        groups: dict[str, list[str]] = {}  # in the order of their first operation
        for a, b in self.reshaped:
            key = f"{_fmt_shape(a.shape)} -> {_fmt_shape(b.shape)}"
            groups.setdefault(key, []).append(_short(b.name, 0))
        out = []
        for key, names in groups.items():
            out += textwrap.wrap(f"{key}: {', '.join(names)}", width,
                                 subsequent_indent="    ", break_on_hyphens=False)
        return out


def trace_diff(a: Trace, b: Trace, layer_a: int = 0, layer_b: int | None = None) -> TraceDiff:
    """What trace b computes at layer_b (default: layer_a) that trace a does not at layer_a,
    and what it computes another way or at another shape; the operations outside the layers
    too. Names are compared without the layer prefix ("attn.q_norm")."""
    ops_a = layer_ops(a, layer_a)
    ops_b = layer_ops(b, layer_a if layer_b is None else layer_b)
    both = [n for n in ops_b if n in ops_a]
    return TraceDiff(
        added=[ops_b[n] for n in ops_b if n not in ops_a],
        removed=[ops_a[n] for n in ops_a if n not in ops_b],
        recomputed=[(ops_a[n], ops_b[n]) for n in both
                    if not same_op(ops_a[n].op, ops_b[n].op)],
        reshaped=[(ops_a[n], ops_b[n]) for n in both
                  if tuple(ops_a[n].shape) != tuple(ops_b[n].shape)])


def _short(name: str, width: int) -> str:
    """A record's name without its layer prefix, padded to width."""
    name = re.sub(r"^layers\.\d+\.", "", name)
    return f"{name:{width}}"

