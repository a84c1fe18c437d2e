"""llmtrace beside TransformerLens and nnsight: a full trace of one prompt, side by side.

    make bench-peers    # builds the bench's own venv (requirements-bench.txt), then runs this
    python -m bench.peers [--tokens 256] [--rounds 15] [--threads 2] [--json PATH]

Every tool runs the same fp32 weights of the embedded model: HF `LlamaForCausalLM` eager (the
baseline), llmtrace with every value kept, TransformerLens's `run_with_cache` on a
`TransformerBridge` over its own copy of the HF model, and nnsight's `tracer.cache()` of every
module over another copy. The variants take turns in every round (`bench.interleaved`), on
pinned threads; each prints the median of its per-round time ratios to HF (and their range), the
MiB its trace or cache holds (each storage counted once), how many tensors it keeps, its minor
page faults per pass (getrusage) and the largest difference of its logits from HF's. A peer that
is not installed is said so and skipped. Each setting runs in a process of its own: malloc's
defaults here; llmtrace with the opt-in `keep_freed_memory()` in a second process, which this
one starts. The figures go to the cache's peers.json, which the cost chapter shows.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from llmtrace_book import Trace, load_model
from llmtrace_book.disk_cache import cache_dir
from llmtrace_book.load import embedded_checkpoint
from llmtrace_book.memory import keep_freed_memory

from llmtrace_book.disk_cache import atomic_path

from .bench import cpu_model, interleaved, prompt_ids, provenance
from .reference import hf_reference

PEERS = {"transformer_lens": "TransformerLens", "nnsight": "nnsight"}
ROOT = Path(__file__).resolve().parents[1]


def tensors_in(x) -> list[torch.Tensor]:
    """Every tensor in a cache's values (tensors, tuples, lists, dicts, objects with tensors)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in tensors_in(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in tensors_in(v)]
    return []


def held(tensors: list[torch.Tensor]) -> int:
    """Bytes of memory these tensors occupy, each storage once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


class Tool:
    """One way to run the pass: `run()` returns (logits [1, T, V], what it kept)."""

    def __init__(self, label: str, run, kept):
        self.label, self.run, self.kept = label, run, kept  # kept(result) -> tensors or bytes


def hf_tool(hf, ids) -> Tool:
    def run():
        with torch.inference_mode():
            return hf(ids, use_cache=False).logits, None
    return Tool("HF `LlamaForCausalLM` eager (baseline)", run, lambda kept: [])


def llmtrace_tools(model, ids) -> list[Tool]:
    def every():
        trace = Trace()
        return model.forward(ids, trace), trace

    def shapes():
        return model.forward(ids, Trace(keep_values=False)), None

    return [Tool("llmtrace, every value", every, lambda trace: trace),
            Tool("llmtrace, shapes only", shapes, lambda kept: [])]


def lens_tool(ids) -> Tool:
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoTokenizer

    directory = embedded_checkpoint()
    bridge = TransformerBridge.boot_transformers(
        str(directory), hf_model=hf_copy(), tokenizer=AutoTokenizer.from_pretrained(directory),
        device="cpu", dtype=torch.float32)

    def run():
        with torch.inference_mode():
            return bridge.run_with_cache(ids)
    return Tool("TransformerLens `run_with_cache`", run,
                lambda cache: [t for t in cache.values()])


def nnsight_tool(ids) -> Tool:
    from nnsight import LanguageModel
    from transformers import AutoTokenizer

    with warnings.catch_warnings():  # its newer class wants a repo id; this one wraps a model
        warnings.simplefilter("ignore")
        lm = LanguageModel(hf_copy(),
                           tokenizer=AutoTokenizer.from_pretrained(embedded_checkpoint()))

    def run():
        with torch.inference_mode():
            with lm.trace(ids, use_cache=False) as tracer:
                cache = tracer.cache()  # every module's output
                logits = lm.output.logits.save()
        return logits, cache
    return Tool("nnsight `tracer.cache()` of every module", run,
                lambda cache: [t for k in cache.keys() for t in tensors_in(cache[k].output)])


def hf_copy():
    """A model of its own for each peer (a bridge or hooks change the module they wrap)."""
    return hf_reference(MODEL[0], "eager")


MODEL: list = [None]


def measure(tokens: int, rounds: int, peers: bool) -> list[dict]:
    model = MODEL[0] = load_model("embedded")
    ids = prompt_ids(model, tokens)
    hf = hf_reference(model, "eager")
    tools = [hf_tool(hf, ids), *llmtrace_tools(model, ids)]
    missing = []
    for module, builder in (("transformer_lens", lens_tool), ("nnsight", nnsight_tool)):
        if not peers:
            continue
        if importlib.util.find_spec(module) is None:
            missing.append(PEERS[module])
            print(f"{PEERS[module]} is not installed here: skipped (make bench-peers "
                  f"installs it in the bench's venv)", file=sys.stderr)
            continue
        tools.append(builder(ids))
    reference, _ = tools[0].run()
    rows = []
    for tool in tools:  # what each keeps, and its logits against HF's
        logits, kept = tool.run()
        what = tool.kept(kept)
        nbytes = what.nbytes() if isinstance(what, Trace) else held(what)
        count = len(what)
        rows.append({"tool": tool.label, "held_mib": nbytes / 2**20, "tensors": count,
                     "max_logit_diff": float((logits - reference).abs().max())})
        del logits, kept, what
    timings = interleaved({t.label: (lambda t=t: t.run()) for t in tools}, rounds)
    base = tools[0].label
    for row in rows:
        label = row["tool"]
        row.update({"vs_hf": timings.ratio(label, base), "spread": timings.spread(label, base),
                    "ms": timings.seconds(label) * 1e3,
                    "page_faults": timings.page_faults(label)})
    for name in missing:
        rows.append({"tool": name, "missing": True})
    return rows


def keep_freed_rows(tokens: int, rounds: int, threads: int) -> list[dict]:
    """llmtrace with the opt-in, in a process of its own (a process-wide malloc setting)."""
    cmd = [sys.executable, "-m", "bench.peers", "--keep-freed-memory", "--tokens", str(tokens),
           "--rounds", str(rounds), "--threads", str(threads), "--json", "-"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    rows = json.loads(out.splitlines()[-1])["rows"]
    return [{**r, "tool": r["tool"] + ", `keep_freed_memory()`"} for r in rows
            if r["tool"] == "llmtrace, every value"]


def table(r: dict) -> str:
    """The rows as a Markdown table."""
    head = (f"| {r['tokens']} tokens, {r['threads']} threads | median x HF eager (range) | "
            f"held by the trace | tensors | page faults per pass | max logit diff |\n"
            "|---|---|---|---|---|---|")
    lines = [head]
    for row in r["rows"]:
        if row.get("missing"):
            lines.append(f"| {row['tool']} | not installed: skipped | | | | |")
            continue
        s = row["spread"]
        mib = f"{row['held_mib']:.1f} MiB" if row["held_mib"] else "-"
        lines.append(f"| {row['tool']} | {row['vs_hf']:.3f}x ({s[0]:.3f}-{s[2]:.3f}) | {mib} | "
                     f"{row['tensors'] or '-'} | {row['page_faults']:,.0f} | "
                     f"{row['max_logit_diff']:.1g} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--keep-freed-memory", action="store_true",
                   help="make the opt-in first, and measure HF and llmtrace only")
    p.add_argument("--json", default=None, help="where to write the figures (default: "
                   "peers.json in the cache; - for standard output)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.keep_freed_memory:
        assert keep_freed_memory(), "keep_freed_memory() needs glibc"
    rows = measure(args.tokens, args.rounds, peers=not args.keep_freed_memory)
    if not args.keep_freed_memory:
        rows[2:2] = keep_freed_rows(args.tokens, args.rounds, args.threads)
    versions = {name: _version(name) for name in ("torch", "transformers", "transformer_lens",
                                                  "nnsight")}
    r = {"tokens": args.tokens, "rounds": args.rounds, "threads": args.threads,
         "rows": rows, "versions": versions, "load": os.getloadavg(), **provenance()}
    if args.json == "-":
        print(json.dumps(r))
        return
    path = Path(args.json) if args.json else cache_dir() / "peers.json"
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(r, indent=2))
    print(f"{r['date']}, {cpu_model()} ({r['cpus']} CPUs), load {r['load'][0]:.1f}; "
          + ", ".join(f"{k} {v}" for k, v in versions.items() if v))
    print(table(r))
    print(f"\nwritten to {path}")


def _version(module: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(module.replace("_", "-"))
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
