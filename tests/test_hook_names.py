"""The table of where this library's records live in TransformerLens and nnsight
(notebooks/data/hook_names.json, written by `make hook-names` in the bench's venv, which has both)
still holds for this library and for Hugging Face's modules, which nnsight names: every record it
lists is traced with its shape, every HF module it names returns that record's values in the
layout it says, HF's `output_hidden_states` are the records it says, and it was made with the
versions requirements-bench.txt pins."""

import json
import re
from pathlib import Path

import pytest
import torch

from bench.hook_names import PROMPT, hidden_states_are, ways

ROOT = Path(__file__).resolve().parents[1]
TABLE = json.loads((ROOT / "notebooks" / "data" / "hook_names.json").read_text())


def test_made_with_the_pinned_versions():
    pins = dict(re.findall(r"^([\w-]+)==([\w.+]+)", (ROOT / "requirements-bench.txt").read_text(),
                           re.M))
    for module in ("transformers", "transformer_lens", "nnsight"):
        assert TABLE["versions"][module] == pins[module.replace("_", "-")], (
            f"{module}: the table was made with {TABLE['versions'][module]}, the bench pins "
            f"{pins[module.replace('_', '-')]}: run `make hook-names`")


@pytest.fixture(scope="module")
def traced(embedded):
    _, trace = embedded.run(TABLE["prompt"])
    return trace


def test_every_record_it_lists_is_traced_with_its_shape(traced):
    assert TABLE["prompt"] == PROMPT and len(TABLE["rows"]) > 20
    for row in TABLE["rows"]:
        assert list(traced.shape(row["record"])) == row["shape"], row["record"]
    found = {m["name"] for row in TABLE["rows"] for m in row["transformer_lens"]}
    assert {"blocks.0.hook_resid_pre", "blocks.0.attn.hook_z", "blocks.0.ln1.hook_scale",
            "blocks.0.attn.hook_pattern", "blocks.0.hook_resid_post"} <= found


def test_hf_modules_return_the_records_it_says(embedded, hf_reference, traced):
    ids = embedded.encode(TABLE["prompt"])
    seen, handles = {}, []
    rows = [(row, m) for row in TABLE["rows"] for m in row["nnsight"]]
    assert len(rows) > 15
    for row, m in rows:
        path, _, index = m["name"].partition("[")
        module = hf_reference.get_submodule(path.removeprefix("model").removeprefix("."))
        handles.append(module.register_forward_hook(
            lambda mod, args, out, key=m["name"], i=int(index.rstrip("]") or 0):
            seen.__setitem__(key, out if isinstance(out, torch.Tensor) else out[i])))
    try:
        with torch.no_grad():
            hidden = hf_reference(ids, output_hidden_states=True).hidden_states
    finally:
        for h in handles:
            h.remove()
    eps = embedded.config.norm_eps
    for row, m in rows:
        ours, theirs = traced[row["record"]], seen[m["name"]]
        mine = dict(ways(ours, eps))[m["how"]] if m["how"] != "heads merged" else next(
            t for how, t in ways(ours, eps) if how == m["how"] and t.shape == theirs.shape)
        assert mine.shape == theirs.shape and torch.allclose(mine, theirs, rtol=1e-4, atol=1e-4), (
            row["record"], m)
    every = {r.name: traced[r.name] for r in traced.records if traced[r.name].is_floating_point()}
    assert hidden_states_are(hidden, every) == TABLE["hidden_states"]
    assert TABLE["hidden_states"][-1] == "final_norm"  # HF's last one is after the final norm
