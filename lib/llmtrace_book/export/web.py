"""Every file the page loads, written into one directory and measured: `write_web`.

The fp32 graph, the decode step and the logit lens (`graph`), the page's form on the GGUF's
blocks (`pack`), the model's tokenizer, then each form's manifest (`manifest`), written last:
its files, the records, the config, and how far onnxruntime's logits (and greedy decode steps)
were from the library's when it was made, refused past LOGIT_TOLERANCE.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from ..errors import LlmTraceError
from ..model import Model
from .graph import (DECODE_GRAPH, FP32_DECODE_GRAPH, decode_entry, export_decode, export_lens,
                    export_onnx, share_data)
from .lab import FP32_LAB_GRAPH, LAB_GRAPH, export_lab, lab_difference
from .manifest import (FORMAT, FP32_GRAPH, FP32_MANIFEST, GRAPH, INPUT, LOGITS, MANIFEST,
                       TOKENIZER, TOKENIZER_CONFIG, _entry, session, split)
from .pack import QUANTIZED, quantize_graph

# the prompts the stated tolerance is measured on: the book's, and one of digits, accents, an
# emoji, newlines and a run of spaces
TOLERANCE_PROMPTS = ("The capital of France is", "Hello! 1234 caf\u00e9 \U0001F600\n\n  ok")
LOGIT_TOLERANCE = 1e-4  # the page's logits against the trace's; each form is measured at export
# the status line's words for each form of the weights (the manifest's "weights" is the detail)
IN_WORDS = {"fp32": "on its weights in fp32, the numbers the chapters run",
            QUANTIZED: "on the 4-bit blocks its GGUF file stores (8-bit for the embedding and "
                       "the head), unpacked as each product runs"}


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
    from ..generate import generate

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
    web = {**head, "weights": weights, "weights_in_words": IN_WORDS.get(weights, weights),
           "graph": _entry(graph), "external_data": data.name,
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
    if "lab" in web:
        lab = lab_difference(model, session(d, web=web, graph="lab"), TOLERANCE_PROMPTS)
        if lab > LOGIT_TOLERANCE:
            raise LlmTraceError(f"{model.name}: the {weights} lab graph's logits are {lab:.1e} "
                                f"from the library's, over the page's {LOGIT_TOLERANCE:g}")
        measured_decode["lab_measured"] = lab
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
    lab = export_lab(model, d / FP32_LAB_GRAPH)
    if blocks is not None:  # before the fp32 data is cut into chunks: it reads that file
        quantize_graph(d / FP32_GRAPH, d / GRAPH, blocks, model)
        quantize_graph(d / FP32_DECODE_GRAPH, d / DECODE_GRAPH, blocks, model)
        quantize_graph(d / FP32_LAB_GRAPH, d / LAB_GRAPH, blocks, model)
        share_data(d / DECODE_GRAPH, d / GRAPH)
        share_data(d / LAB_GRAPH, d / GRAPH)
    share_data(d / FP32_DECODE_GRAPH, d / FP32_GRAPH)
    share_data(d / FP32_LAB_GRAPH, d / FP32_GRAPH)
    lens = export_lens(model, d, quantized=blocks is not None)
    decode = {GRAPH: decode_entry(model, d, DECODE_GRAPH)} if blocks is not None else {}
    decode[FP32_GRAPH] = decode_entry(model, d, FP32_DECODE_GRAPH)
    labs = {g: {**lab, "graph": _entry(d / (LAB_GRAPH if g == GRAPH else FP32_LAB_GRAPH))}
            for g in decode}
    with_lens = {g: {**head, "decode": decode[g], "lab": labs[g],
                     **({"lens": lens[g]} if g in lens else {})} for g in decode}
    fp32 = _form(model, d, d / FP32_GRAPH, "fp32", with_lens[FP32_GRAPH])
    web = fp32
    if blocks is not None:
        web = {**_form(model, d, d / GRAPH, QUANTIZED, with_lens[GRAPH]), "fp32": FP32_MANIFEST}
        (d / FP32_MANIFEST).write_text(json.dumps(fp32, indent=1))
    web["export_seconds"] = round(time.perf_counter() - started, 1)
    (d / MANIFEST).write_text(json.dumps(web, indent=1))
    return web
