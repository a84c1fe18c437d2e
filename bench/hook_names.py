"""Where this library's records live in TransformerLens and in nnsight: each pair found by running
all three on the same fp32 weights of the embedded model and comparing the tensors.

    make hook-names     # in the bench's own venv (requirements-bench.txt), as bench-peers is
    python -m bench.hook_names [--out notebooks/data/hook_names.json]

For every record of the prompt's trace outside the layers and in layer 0, the script looks for
the tensors of the same values in TransformerLens's `run_with_cache` on a `TransformerBridge`
(its cache's names) and in nnsight's `tracer.cache()` of every module (the module's path, which
is Hugging Face's module tree): equal to the record as it is, with heads and positions swapped
([B, T, H, hd] against [B, H, T, hd]), with the heads merged ([B, T, H*hd]) or split, or, for a norm's
mean of squares, as its square root with eps added (the scale TransformerLens hooks). Only the
tensors with more than one value are compared, to fp32's tolerance. The table goes to a JSON
file that the interpretability chapter shows, with the versions that made it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from llmtrace_book import load_model
from llmtrace_book.disk_cache import atomic_path

from . import peers
from .peers import _version, lens_tool, nnsight_tool, tensors_in

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "notebooks" / "data" / "hook_names.json"
PROMPT = "The capital of France is"


def ways(ours: torch.Tensor, eps: float):
    """(how, the record as the other tool would hold it) for each layout compared."""
    yield "same", ours
    if ours.dim() == 4:
        swapped = ours.transpose(1, 2)  # [B, H, T, hd] <-> [B, T, H, hd]
        yield "heads and positions swapped", swapped
        yield "heads merged", ours.flatten(2)  # [B, T, H, hd] -> [B, T, H*hd]
        yield "heads merged", swapped.flatten(2)  # [B, H, T, hd] -> [B, T, H*hd]
    if ours.shape[-1:] == (1,):
        yield "sqrt(mean_sq + eps)", (ours + eps).sqrt()


def matches(ours: torch.Tensor, theirs: dict[str, torch.Tensor], eps: float) -> list[dict]:
    found = []
    for name, t in theirs.items():
        if not t.is_floating_point() or t.numel() < 2 or float(t.std()) == 0:
            continue
        for how, mine in ways(ours, eps):
            if mine.shape == t.shape and torch.allclose(mine, t.float(), rtol=1e-4, atol=1e-4):
                found.append({"name": name, "how": how})
                break
        else:  # theirs per head, ours merged: [B, T, H, hd] against [B, T, H*hd]
            if (t.dim() == ours.dim() + 1 == 4 and t.flatten(2).shape == ours.shape
                    and torch.allclose(ours, t.flatten(2).float(), rtol=1e-4, atol=1e-4)):
                found.append({"name": name, "how": "heads split"})
    return found


def hidden_states_are(hidden, every: dict[str, torch.Tensor]) -> list[str | None]:
    """The record each of HF's `output_hidden_states` equals (None: none does)."""
    return [next((n for n, t in every.items()
                  if t.shape == h.shape and torch.allclose(t, h, rtol=1e-4, atol=1e-4)), None)
            for h in hidden]


def table(out: Path = OUT) -> dict:
    model = load_model("embedded")
    peers.MODEL[0] = model
    ids = model.encode(PROMPT)
    _, trace = model.run(PROMPT)
    ours = {r.name: trace[r.name] for r in trace.records
            if (not r.name.startswith("layers.") or r.name.startswith("layers.0."))
            and trace[r.name].is_floating_point() and trace[r.name].dim() >= 2}
    lens = lens_tool(ids)
    _, cache = lens.run()
    tl = {k: v for k, v in cache.items()}
    site = nnsight_tool(ids)
    _, modules = site.run()
    ns = {}
    for k in modules.keys():
        for i, t in enumerate(tensors_in(modules[k].output)):
            ns[k if i == 0 else f"{k}[{i}]"] = t
    eps = model.config.norm_eps
    hf = peers.hf_copy()
    with torch.inference_mode():
        hidden = hf(ids, output_hidden_states=True, use_cache=False).hidden_states
    every = {r.name: trace[r.name] for r in trace.records if trace[r.name].is_floating_point()}
    rows = [{"record": name, "shape": list(t.shape),
             "transformer_lens": matches(t, tl, eps), "nnsight": matches(t, ns, eps)}
            for name, t in ours.items()]
    result = {"model": model.label, "prompt": PROMPT,
              "versions": {m: _version(m) for m in ("torch", "transformers", "transformer_lens",
                                                    "nnsight")},
              "rows": rows, "hidden_states": hidden_states_are(hidden, every)}
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(result, indent=1) + "\n")
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT, help="the JSON file to write")
    args = p.parse_args(argv)
    for module in ("transformer_lens", "nnsight"):
        if _version(module) is None:
            sys.exit(f"error: {module} is not installed here: run `make hook-names`, which "
                     f"builds the bench's venv with it")
    r = table(args.out)
    for row in r["rows"]:
        tl = ", ".join(m["name"] for m in row["transformer_lens"]) or "-"
        ns = ", ".join(m["name"] for m in row["nnsight"]) or "-"
        print(f"{row['record']:32} {tl:50} {ns}")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
