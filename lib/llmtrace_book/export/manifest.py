"""The page's manifest and the files it lists: what web.json names and how each file is checked.

web.json (and web-fp32.json) lists every file a form of the export needs, each with its size and
SHA-256 (`_entry`): the graphs, the tokenizer's two files, and the one data file of the main
graph cut into chunks of at most CHUNK_BYTES (`split`). `verify` checks them as the page does
before it runs anything, and `session` opens a graph on them as the page does: the chunks joined
in memory and handed over under the data file's one name.

The lowest module of `llmtrace_book.export`: the names here (files, the graphs' input and logits) are
the ones every other module writes or reads.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

from ..errors import LlmTraceError

FORMAT = 1  # web.json's layout; the page refuses another
GRAPH = "model.onnx"  # the page's form; its external data is one file, model.onnx.data
FP32_GRAPH, FP32_MANIFEST = "model-fp32.onnx", "web-fp32.json"  # fp32, kept beside it
CHUNK_BYTES = 50_000_000  # at most 50 MB a file: what static hosts serve
TOKENIZER, TOKENIZER_CONFIG, MANIFEST = "tokenizer.json", "tokenizer_config.json", "web.json"
INPUT, LOGITS = "ids", "lm_head"


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


def listed_files(web: dict) -> list[dict]:
    """Every file a manifest lists: graphs, chunks, the tokenizer's two."""
    return [web["graph"], *web["chunks"], web["tokenizer"], web["tokenizer_config"],
            *(web[g]["graph"] for g in ("decode", "lens", "lab") if g in web)]


def verify(d: Path, manifest: str = MANIFEST) -> dict:
    """web.json (or another manifest), after checking that every file it lists has its size
    and SHA-256 (what the page checks before it runs anything)."""
    try:
        web = json.loads((d / manifest).read_text())
        files = listed_files(web)
    except (OSError, ValueError, KeyError, TypeError):
        raise LlmTraceError(f"{d / manifest} is missing or unreadable: "
                            f"make it again with python -m llmtrace_book.export --rebuild") from None
    again = "make the export again (python -m llmtrace_book.export --rebuild)"
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
