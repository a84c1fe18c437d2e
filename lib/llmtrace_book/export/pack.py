"""The GGUF's own blocks, held as they are: Q4_1 and Q8_0 repacked for onnxruntime's kernels.

`quantize_graph` turns the fp32 graph into the page's form: each linear layer's MatMul a
MatMulNBits on the Q4_1 blocks (`q4_1_as_matmul_nbits`), the embedding's Gather a
GatherBlockQuantized and the tied head's MatMul an 8-bit MatMulNBits, both on the Q8_0 table
(`q8_0_as_uint8`); `_lens_head_from_table` does the same to the logit lens's head. Every block set
is checked against the fp32 weight it replaces.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import LlmTraceError
from ..model import TABLE_NAMES, Model
from .manifest import LOGITS

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
    if not c.tied_lm_head or blocks.get(TABLE_NAMES["embed"], ("",))[0] != "Q8_0" \
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
    q, d = q8_0_as_uint8(blocks[TABLE_NAMES["embed"]][1], D)
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
        if w is not names[TABLE_NAMES["embed"]] or any(i is not None for i in node.inputs[2:]) \
                or any(attrs.get(k, 0 if k == "transA" else 1) != v for k, v in plain.items()):
            raise LlmTraceError(f"the lens's head is not x @ embed_tokens^T ({attrs})")
        new = ir.node("MatMulNBits", [x, table, scales], domain="com.microsoft",
                      attributes={"K": c.hidden_size, "N": c.vocab_size, "bits": 8,
                                  "block_size": BLOCK})
        g.insert_before(node, new)
        _rename(node, new, g)
    del g.initializers[TABLE_NAMES["embed"]]
    g.opset_imports["com.microsoft"] = 1


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
