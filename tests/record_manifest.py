"""What a reader sees of every record, written down: for each family's tiny checkpoint
(`tiny_checkpoint.ROWS`) and for the embedded model, each record's name, op text, shape and dtype,
and a hash of its values, for a prefill and one decode step that reads the cache. Two manifests
made on one machine before and after a change to the library say what the change moved.

    python tests/record_manifest.py OUT.json [FAMILY ...]   # every family, then the embedded model
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_checkpoint import ROWS, make_tiny_checkpoint  # noqa: E402

T = 11


def records(model, ids) -> list[list]:
    """[name, op, shape, dtype, sha256 of the values] of a prefill, then of one decode step."""
    from llmtrace_book import Trace

    out = []
    cache = model.new_cache(ids.shape[1] + 1)
    for label, step_ids, start in (("prefill", ids, 0), ("decode", ids[:, -1:], ids.shape[1])):
        trace = Trace(keep_values=True, label=label)
        model.forward(step_ids, trace, cache, start)
        for r in trace.records:
            t = r.tensor
            digest = hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()
            out.append([label, r.name, r.op, list(r.shape), r.dtype, digest[:16]])
    return out


def manifest(families=None) -> dict:
    from llmtrace_book import load_model

    torch.set_num_threads(1)
    result = {}
    ids = torch.randint(3, 32000, (1, T), generator=torch.Generator().manual_seed(5))
    with tempfile.TemporaryDirectory() as tmp:
        for f in families or ROWS:
            d = make_tiny_checkpoint(Path(tmp) / f, family=f)
            result[f] = records(load_model(d), ids)
    if not families:
        model = load_model("embedded")
        result["embedded"] = records(model, model.encode("The capital of France is"))
    return result


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(manifest(sys.argv[2:] or None), indent=0))
