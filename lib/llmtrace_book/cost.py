"""What the model costs: parameters (from the config), multiply-adds (from a trace), bytes read.

A multiply-add (MAC) is one `a * b + c`. Every matmul records its MACs in the trace, including
QK^T and the weighted sum, which counters working at module boundaries (torchinfo) miss because
they are not `nn.Linear` layers. Element-wise ops (norms, RoPE, SiLU, softmax) are recorded with
0 MACs: their cost is reading memory, not arithmetic.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from dataclasses import dataclass

from .config import Config
from .model import Model, meta_model
from .parts import layer_params


@dataclass
class ParamRow:
    component: str
    shape: tuple[int, ...]
    each: int  # parameters in one copy
    copies: int  # 1, or the number of layers that hold it
    per_layer: bool
    active: int = -1  # parameters of one copy a position reads (-1: all; experts: k of E)

    @property
    def total(self) -> int:
        return self.each * self.copies

    @property
    def active_total(self) -> int:
        """What a position reads of the row: a mixture of experts' k experts of E."""
        return (self.each if self.active < 0 else self.active) * self.copies


def parameter_table(c: Config) -> list[ParamRow]:
    """One row per component and shape, in model order: the embedding, each layer's weights as
    its parts say them (`parts.Part.tensors`), then the final norm and the LM head (a tied head
    has no row of its own). Layers alike share a row: `copies` counts them."""
    model = Model(c)  # its parts, no weights
    tables = {field: shape for field, (_, shape) in model.tensors().items()}
    held = {("embed", tables["embed"]): 1}  # (field, shape) -> the copies the model holds
    for block in model.blocks:
        for field, shape in layer_params(block).items():
            held[field, shape] = held.get((field, shape), 0) + 1
    held.update({(field, shape): 1 for field, shape in tables.items() if field != "embed"})
    return [ParamRow("embedding" if field == "embed" else field, shape, math.prod(shape), copies,
                     field not in tables, active_of(c, field, shape))
            for (field, shape), copies in held.items() if field not in BUFFERS]


# tensors a checkpoint holds that are no parameters: DeepSeek-V3's router bias is set by a rule
# during training, not by gradient (a buffer in HF's class, which counts it in no total)
BUFFERS = ("moe.score_bias",)


def active_of(c: Config, field: str, shape: tuple) -> int:
    """Parameters of one copy of `field` a position reads: all (-1), but k of a mixture of
    experts' E stacked experts."""
    if field in ("moe.gate", "moe.up", "moe.down", "moe.gate_bias", "moe.up_bias",
                 "moe.down_bias"):  # [E, ...]: expert e's at [e] (gpt-oss: biases too)
        return math.prod(shape) // c.n_experts * c.n_experts_active
    return -1


def parameter_count(c: Config, active: bool = False) -> int:
    """Parameters the model holds; active=True: those one position reads (with a mixture of
    experts, k of the E experts of each layer; every table and layer else)."""
    rows = parameter_table(c)
    return sum(r.active_total if active else r.total for r in rows)


def parameter_shares(c: Config) -> dict[str, float]:
    """Fractions of the total: the per-layer matrices, the norms, the embedding and LM head
    tables."""
    rows = parameter_table(c)
    total = sum(r.total for r in rows)
    matrices = sum(r.total for r in rows if r.per_layer and len(r.shape) >= 2)  # experts: 3D
    norms = sum(r.total for r in rows if len(r.shape) == 1)
    tables = sum(r.total for r in rows if r.component in ("embedding", "lm_head"))
    return {"per_layer_matrices": matrices / total, "norms": norms / total,
            "embedding_and_head": tables / total}


def macs_by_op(trace, per_layer: bool = False) -> dict[str, int]:
    """MACs summed by operation name with the layer index removed ("attn.q_proj", "lm_head").
    per_layer=True divides the layer ops by the number of layers."""
    totals: dict[str, int] = defaultdict(int)
    layers, layer_ops = set(), set()
    for r in trace:
        if not r.macs:
            continue
        if r.name.startswith("layers."):
            _, i, op = r.name.split(".", 2)
            layers.add(i)
            layer_ops.add(op)
            totals[op] += r.macs
        else:
            totals[r.name] += r.macs
    if per_layer and layers:
        for op in layer_ops:
            totals[op] //= len(layers)
    return dict(totals)


def macs_per_layer(trace) -> list[int]:
    """Total MACs of each layer, in order."""
    out: dict[int, int] = defaultdict(int)
    for r in trace:
        if r.name.startswith("layers."):
            out[int(r.name.split(".")[1])] += r.macs
    return [out[i] for i in sorted(out)]


def weight_macs_per_token_per_layer(c: Config) -> int:
    """The projections' MACs for one token in one layer: every weight of the layer used once.
    Attention's own QK^T and weighted sum add 2 * n_heads * head_dim per position attended."""
    D, hd = c.hidden_size, c.head_dim
    return D * c.n_heads * hd + 2 * D * c.n_kv_heads * hd + c.n_heads * hd * D + 3 * D * c.ffn_size


def attention_macs(c: Config, T: int, cached: int = 0, skip_masked: bool = False) -> int:
    """Multiply-adds of `q @ k^T` and `weights @ v` in one layer, for T queries after `cached`
    positions. As `Attention.mix` computes them, every query scores every key (T * S) and the mask then
    discards the future. A kernel that skips masked keys (skip_masked=True) needs only the keys
    each query sees: cached + 1, ..., cached + T; at prefill the triangle T * (T + 1) / 2."""
    keys = T * cached + (T * (T + 1) // 2 if skip_masked else T * T)
    return 2 * c.n_heads * c.head_dim * keys


def decode_bytes(c: Config, context: int, batch: int = 1,
                 bytes_per_value: int = 4) -> dict[str, int]:
    """Bytes one decode step must read from memory: every weight matrix once (the embedding lookup
    reads one row; the LM head reads its whole table, which is the embedding table when tied), and
    the cache of every cached position in every layer (K and V; latent attention's latents)."""
    table = c.vocab_size * c.hidden_size
    weights = (parameter_count(c) - (0 if c.tied_lm_head else table)
               + c.hidden_size)  # + the row looked up
    kv = cache_bytes(c, context, 1, batch, capped=False)  # values: the step reads them all
    return {"weights": weights * bytes_per_value, "kv_cache": kv * bytes_per_value,
            "total": (weights + kv) * bytes_per_value}


def layer_cache_values(c: Config, layer: int, context: int, capped: bool = True) -> int:
    """The numbers one layer's cache must hold after `context` positions, per sequence, as
    the layer's attention part counts them (`cache_values`: K and V, a latent, a DeltaNet
    state; a sliding layer capped at its window)."""
    return layer_parts(c)[layer].attn.cache_values(context, capped)


@functools.lru_cache(maxsize=64)
def layer_parts(c: Config) -> list:
    """Each layer's `Block` of the config's model, from a model on the meta device."""
    return meta_model(c).blocks


def cache_bytes(c: Config, context: int, bytes_per_value: int = 2, batch: int = 1,
                capped: bool = True) -> int:
    """Bytes a model's cache must hold after `context` positions (bf16 by default): the sum of
    its layers' `layer_cache_values`. A sliding layer counts only its window, what an inference
    cache keeps; capped=False counts every position, as llmtrace's own cache keeps them."""
    return batch * bytes_per_value * sum(layer_cache_values(c, i, context, capped)
                                         for i in range(c.n_layers))
