"""The page's lab: the forward pass exported with interventions as its inputs.

Chapter 14's method (run a prompt with one tensor replaced, read the logit difference of two
answers) as one ONNX graph that the page runs on the reader's own prompts. It is `Model.forward`,
handed a `LabTrace`: a trace that keeps nothing and, at four kinds of site, hands on a tensor of
the graph's inputs where a mask says so, the meaning of `Patched` with `torch.where`:

- `heads`: each head's output, `layers.{l}.attn.weighted_sum` [B, H, T, hd];
- `pattern`: each head's attention weights, `layers.{l}.attn.weights` [B, H, T, T];
- `mlp`: each MLP's output, `layers.{l}.mlp.down` [B, T, D];
- `resid`: the residual stream entering each layer (`embed`, then `layers.{l}.resid_out`).

For a site kind K, the input `K.mask` [B, L, ...] (1: replace, 0: keep; one row per run, so that a
sweep is one batched pass) and `K.source` [L, ...] (the values written in: another prompt's
records, zeros, a mean, a uniform pattern: the page's choice, computed from its records) have the
site's shape without the batch. A row whose masks are all 0 is the unpatched pass, to the bit: the
graph is the library's pass, and `torch.where` hands the tensor on unchanged. Outputs: `lab.logits`
[B, V], the last position's logits, and `lab.metric` [B], logit(answers[0]) - logit(answers[1])
there, for the answers given as the input `answers` [2].
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..errors import LlmTraceError, first_line
from ..model import Model, state_dict_from_weights, weights_from_state_dict
from ..trace import NO_TRACE

SITES = ("heads", "pattern", "mlp", "resid")
LAB_GRAPH, FP32_LAB_GRAPH = "lab.onnx", "lab-fp32.onnx"
LAB_OUTPUTS = ["lab.logits", "lab.metric"]


def site_shapes(c) -> dict[str, list]:
    """Each site kind's mask and source shapes, "B" and "T" free."""
    L, H, hd, D = c.n_layers, c.n_heads, c.head_dim, c.hidden_size
    return {"heads": (["B", L, H, "T"], [L, H, "T", hd]),
            "pattern": (["B", L, H, "T"], [L, H, "T", "T"]),
            "mlp": (["B", L, "T"], [L, "T", D]),
            "resid": (["B", L, "T"], [L, "T", D])}


_SITE = [(re.compile(r"layers\.(\d+)\.attn\.weighted_sum"), "heads", 0),
         (re.compile(r"layers\.(\d+)\.attn\.weights"), "pattern", 0),
         (re.compile(r"layers\.(\d+)\.mlp\.down"), "mlp", 0),
         (re.compile(r"embed"), "resid", None),  # the stream entering layer 0
         (re.compile(r"layers\.(\d+)\.resid_out"), "resid", 1)]  # entering layer l + 1


class LabTrace:
    """A trace that replaces the sites' tensors where the masks say, and keeps only the tensors
    named in `keep` (as the operations made them, before any replacement): the graph's records
    that the quantized form's rewrite finds its nodes by."""

    def __init__(self, inputs: dict[str, torch.Tensor], n_layers: int, keep=()):
        self.inputs, self.n_layers, self.keep = inputs, n_layers, set(keep)
        self.kept: dict[str, torch.Tensor] = {}

    def record(self, name: str, op: str, tensor: torch.Tensor, macs=0, recompute=None):
        if name in self.keep:
            self.kept[name] = tensor
        for pattern, kind, shift in _SITE:
            m = pattern.fullmatch(name)
            if m is None:
                continue
            layer = 0 if shift is None else int(m.group(1)) + shift
            if layer >= self.n_layers:  # the last block's output enters no layer
                return tensor
            mask = self.inputs[f"{kind}.mask"][:, layer]  # [B, ...] without the last dims
            source = self.inputs[f"{kind}.source"][layer]  # the site's shape, no batch
            while mask.dim() < tensor.dim():
                mask = mask[..., None]
            return torch.where(mask > 0, source, tensor)
        return tensor


class _Lab(torch.nn.Module):
    """The model with the lab's inputs: weights as buffers under their HF names (as the page's
    main graph has them), forward `Model.forward` with a `LabTrace` over ids repeated for every
    row of the masks."""

    def __init__(self, model: Model):
        from .graph import _buffers

        super().__init__()
        self.config = model.config
        _buffers(self, state_dict_from_weights(model.config, model.weights))

    def forward(self, ids, answers, heads_mask, heads_source, pattern_mask, pattern_source,
                mlp_mask, mlp_source, resid_mask, resid_source):
        c = self.config
        model = Model(c, weights_from_state_dict(c, dict(self.named_buffers()), "export"))
        inputs = {"heads.mask": heads_mask, "heads.source": heads_source,
                  "pattern.mask": pattern_mask, "pattern.source": pattern_source,
                  "mlp.mask": mlp_mask, "mlp.source": mlp_source,
                  "resid.mask": resid_mask, "resid.source": resid_source}
        rows = ids.expand(heads_mask.shape[0], -1)  # [B, T]: one run per row
        trace = LabTrace(inputs, c.n_layers, kept_records(c))
        logits = model.forward(rows, trace)[:, -1]  # [B, V]
        metric = logits[:, answers[0]] - logits[:, answers[1]]  # [B]
        return (logits, metric, *[trace.kept[n] for n in kept_records(c)])


def kept_records(c) -> list[str]:
    """The records the lab's graph outputs besides its own: each linear layer's, the embedding
    and the LM head, by which `pack.quantize_graph` finds the nodes it rewrites."""
    from .manifest import LOGITS
    from .pack import LINEAR_RECORDS

    return (["embed"] + [f"layers.{i}.{r}" for i in range(c.n_layers)
                         for r in LINEAR_RECORDS.values()] + [LOGITS])


def lab_inputs(c, T: int, B: int = 1) -> dict[str, torch.Tensor]:
    """Inputs that change nothing: every mask 0 (sources zero), for B rows of T tokens."""
    out = {}
    for kind, (mask, source) in site_shapes(c).items():
        def size(shape):
            return [B if d == "B" else T if d == "T" else d for d in shape]
        out[f"{kind}.mask"] = torch.zeros(size(mask))
        out[f"{kind}.source"] = torch.zeros(size(source))
    return out


def run_lab(model: Model, ids: torch.Tensor, answers, inputs: dict) -> tuple:
    """The lab's pass in PyTorch, as the graph computes it: (logits [B, V], metric [B])."""
    lab = _Lab(model).eval()
    with torch.inference_mode():
        return lab(ids, torch.tensor(answers), *[inputs[f"{k}.{p}"] for k in SITES
                                                 for p in ("mask", "source")])[:2]


def lab_difference(model: Model, sess, prompts) -> float:
    """The lab graph (an onnxruntime session) with no intervention, two rows, against the
    library's pass: the largest |difference| of the last position's logits."""
    import numpy as np

    worst = 0.0
    for prompt in prompts:
        ids = model.encode(prompt)
        feeds = {"ids": ids.numpy(), "answers": np.array([0, 1], dtype=np.int64)}
        feeds |= {k: v.numpy() for k, v in lab_inputs(model.config, ids.shape[1], 2).items()}
        (got,) = sess.run(["lab.logits"], feeds)
        want = model.forward(ids)[0, -1].numpy()
        worst = max(worst, float(np.abs(got - want).max()))
    return worst


def input_names() -> list[str]:
    return ["ids", "answers"] + [f"{k}.{p}" for k in SITES for p in ("mask", "source")]


def export_lab(model: Model, path: Path) -> dict:
    """Export the lab (`_Lab`) to `path`, its data in path + ".data" (for `graph.share_data` to
    make into references to the main graph's). B and T free. Returns its manifest entry's
    description: the inputs, their shapes, the outputs."""
    from .graph import _optimize, _quiet, _relative_sources, check_exportable

    check_exportable(model)
    c = model.config
    T, B = 6, 2
    example = lab_inputs(c, T, B)
    ids = torch.tensor([[c.bos_id] * T])
    dims = {"B": torch.export.Dim("B", min=1, max=4096),
            "T": torch.export.Dim("T", min=2, max=c.max_positions)}

    def dynamic(shape):
        return {i: dims[d] for i, d in enumerate(shape) if isinstance(d, str)}
    shapes = site_shapes(c)
    dynamic_shapes = {"ids": {1: dims["T"]}, "answers": None}
    for kind, (mask, source) in shapes.items():
        dynamic_shapes[f"{kind}_mask"] = dynamic(mask)
        dynamic_shapes[f"{kind}_source"] = dynamic(source)
    args = (ids, torch.tensor([0, 1]), *[example[f"{k}.{p}"] for k in SITES
                                         for p in ("mask", "source")])
    try:
        with _quiet():
            exported = torch.export.export(_Lab(model).eval(), args, strict=False,
                                           dynamic_shapes=dynamic_shapes)
            program = torch.onnx.export(exported, dynamo=True, verbose=False, optimize=False,
                                        input_names=input_names())
    except Exception as e:  # torch.export and the ONNX translation raise many kinds
        raise LlmTraceError(f"{model.name}: the lab cannot be exported to ONNX "
                            f"({type(e).__name__}: {first_line(e)[:160]})") from None
    g = program.model.graph
    _optimize(program.model, LAB_OUTPUTS + kept_records(c))  # as the main graph's
    got = [v.name for v in g.inputs]
    if got != input_names():
        raise LlmTraceError(f"{model.name}: the lab graph's inputs are {got}, not "
                            f"{input_names()}")
    _relative_sources(g)
    program.save(str(path), external_data=True)
    return {"inputs": input_names(), "outputs": LAB_OUTPUTS,
            "shapes": {f"{k}.{p}": s for k, (m, src) in shapes.items()
                       for p, s in (("mask", m), ("source", src))}}


__all__ = ["FP32_LAB_GRAPH", "LAB_GRAPH", "LAB_OUTPUTS", "LabTrace", "NO_TRACE", "SITES",
           "export_lab", "input_names", "lab_inputs", "run_lab", "site_shapes"]
