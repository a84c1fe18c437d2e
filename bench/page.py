"""How fast the page "Your own prompt" runs the model, in headless Chromium, beside Python.

    make bench    # or, after `make book`: python -m bench.page [--single-thread] [--weights fp32]

The built book is served from 127.0.0.1 (bench/serve.py: cross-origin isolated, so onnxruntime-web
may use every core; --single-thread serves it as a plain static host does). A fresh browser
profile opens the page once and the figures are read from the page's own timings
(`window.llmtrace.run(...).timings`), the DevTools protocol (every byte the page and its workers
downloaded) and /proc (the peak resident memory of the tab's renderer process, where its workers
run too). Python's figures come from a child process on the same threads: `load_model`,
`model.run` (the whole trace), `generate` and its peak resident memory. Each line prints its
target and the page's figure over Python's, and the figures are kept in the cache's page.json,
which the cost chapter shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llmtrace_book.disk_cache import atomic_path, cache_dir

from .bench import provenance
from .serve import ROOT, serve

HTML = ROOT / "_build" / "html"
PAGE = "book/your_prompt.html"
PROMPT = "The capital of France is the"  # six tokens on the embedded model (checked)
LAB_PAIR = ("The capital city of France is", "The capital city of Germany is")  # 6 tokens each
CONTINUE = "Once upon a time, in a small village,"  # 20 greedy tokens with no end token
EXPLAINER_MB = 630  # Transformer Explainer downloads about this for GPT-2 small
REPEAT = 5

PYTHON = r"""
import json, os, resource, statistics, sys, time
import torch
torch.set_num_threads(int(sys.argv[1]))
from llmtrace_book import generate, load_model
t = time.perf_counter()
model = load_model("embedded")
load = time.perf_counter() - t
prompt, more, repeat = sys.argv[2], sys.argv[3], int(sys.argv[4])
assert model.encode(prompt).shape[1] == 6, "the bench's prompt is not 6 tokens"
def timed(fn):
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)
trace = timed(lambda: model.run(prompt))
greedy = timed(lambda: generate(model, more, max_new_tokens=20, trace=False))
g = generate(model, more, max_new_tokens=20, trace=False)
# the lab's figures, as the library computes them: one head patched (Patched), and each sweep's
# runs batched in one pass (the page batches them SWEEP_ROWS at a time)
from llmtrace_book.trace import Patched
other = model.encode(sys.argv[5])
c = model.config
T, L, H = other.shape[1], c.n_layers, c.n_heads
def head_in(t):
    t = t.clone()
    t[:, 4, -1] = 0
    return t
lab_one = timed(lambda: model.forward(other, Patched({"layers.23.attn.weighted_sum": head_in})))
lab_resid = timed(lambda: model.forward(other.expand(L * T, -1)))
lab_heads = timed(lambda: model.forward(other.expand(L * H, -1)))
print(json.dumps({"load_s": load, "trace_s": trace, "greedy_s": greedy,
                  "lab_one_s": lab_one, "lab_resid_s": lab_resid, "lab_heads_s": lab_heads,
                  "greedy_ids": g.new_ids, "rss_mib":
                  resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def python_figures(threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "LLMTRACE_MODEL": "embedded",
           "PYTHONPATH": str(ROOT / "lib") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", PYTHON, str(threads), PROMPT, CONTINUE,
                          str(REPEAT), LAB_PAIR[1]], capture_output=True, text=True, env=env,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def renderer_peak_mib(root_pid: int) -> float:
    """The largest peak resident memory (VmHWM) among Chromium's renderer processes: the tab."""
    children, peak = {}, 0.0
    for d in Path("/proc").iterdir():
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(d.name))
        except (OSError, ValueError, IndexError):
            continue
    todo = [root_pid]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if b"--type=renderer" in cmd:
            hwm = next(line for line in status.splitlines() if line.startswith("VmHWM"))
            peak = max(peak, int(hwm.split()[1]) / 1024)
    return peak


def page_figures(isolated: bool, form: str | None) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from browser import Browser  # the tests' DevTools driver

    browser = Browser()
    try:
        with serve(HTML, isolated=isolated) as server:
            browser.goto(f"{server.url}/{PAGE}" + (f"?weights={form}" if form else ""))
            info = browser.js("llmtrace.ready.then(i => ({threads: i.threads, weights: "
                              "i.weights, model: i.model}), e => ({error: e.message}))",
                              timeout=300)
            if "error" in info:
                raise SystemExit(f"error: the page did not load the model: {info['error']}")
            load_ms = browser.js("llmtrace.run('Hi').then(r => r.timings.load_ms)")
            run = f"llmtrace.run({json.dumps(PROMPT)}).then(r => [r.ids.length, " \
                  "r.timings.prefill_ms])"
            traces = [browser.js(run, timeout=120) for _ in range(REPEAT + 1)][1:]
            assert all(n == 6 for n, _ in traces), traces
            more = f"llmtrace.run({json.dumps(CONTINUE)}, {{maxNewTokens: 20}}).then(r => " \
                   "[r.generated, r.timings.prefill_ms + r.timings.decode_ms])"
            greedy = [browser.js(more, timeout=300) for _ in range(3)]
            pair = f"prompt: {json.dumps(LAB_PAIR[0])}, other: {json.dumps(LAB_PAIR[1])}"
            one = (f"llmtrace.intervene({{{pair}, interventions: [{{kind: 'heads', layer: 23, "
                   "head: 4, position: 5, source: 'zero'}]}).then(r => r.lab_ms)")
            lab_one = [browser.js(one, timeout=120) for _ in range(REPEAT + 1)][1:]
            lab_resid = browser.js(f"llmtrace.sweep({{{pair}, kind: 'resid'}})"
                                   ".then(r => r.sweep_ms)", timeout=600)
            lab_heads = browser.js(f"llmtrace.sweep({{{pair}, kind: 'heads'}})"
                                   ".then(r => r.sweep_ms)", timeout=600)
            received = sum(e["params"].get("encodedDataLength", 0) for e in browser.events
                           if e.get("method") == "Network.loadingFinished")
            return {**info, "load_s": load_ms / 1000,
                    "trace_s": statistics.median(t for _, t in traces) / 1000,
                    "greedy_s": statistics.median(t for _, t in greedy) / 1000,
                    "greedy_ids": greedy[0][0], "rss_mib": renderer_peak_mib(browser.proc.pid),
                    "lab_one_s": statistics.median(lab_one) / 1000,
                    "lab_resid_s": lab_resid / 1000, "lab_heads_s": lab_heads / 1000,
                    "downloaded_mb": received / 2**20}
    finally:
        browser.close()


def report(page: dict, py: dict, isolated: bool, threads: int) -> str:
    how = "cross-origin isolated" if isolated else "a plain static host, no isolation"
    lines = [f"the page: {page['model']}, weights {page['weights']}, headless Chromium, "
             f"onnxruntime-web on {page['threads']} thread(s) ({how}); "
             f"Python: PyTorch on {threads} thread(s)",
             f"{'figure':<36}{'page':>10}{'target':>12}{'Python':>10}{'page/Python':>13}"]

    def line(label, value, unit, target, python, fmt="{:.2f}"):
        ok = "" if target is None else ("  ok" if value <= target else "  MISSED")
        tgt = "" if target is None else f"<= {target:g} {unit}"
        lines.append(f"{label:<36}{fmt.format(value) + ' ' + unit:>10}{tgt:>12}"
                     f"{fmt.format(python) + ' ' + unit:>10}{value / python:>12.1f}x{ok}")

    line("model ready after the page opens", page["load_s"], "s", 20, py["load_s"])
    line("a 6-token prompt's whole trace", page["trace_s"], "s", 2, py["trace_s"])
    line("20 greedy tokens", page["greedy_s"], "s", 10, py["greedy_s"])
    line("the lab: one head ablated", page["lab_one_s"], "s", 0.5, py["lab_one_s"])
    line("the lab: stream sweep (30 x 6 runs)", page["lab_resid_s"], "s", 10, py["lab_resid_s"])
    line("the lab: head sweep (270 runs)", page["lab_heads_s"], "s", 20, py["lab_heads_s"])
    line("peak memory (tab / process)", page["rss_mib"] / 1024, "GB", 2, py["rss_mib"] / 1024)
    lines.append(f"{'bytes downloaded':<36}{page['downloaded_mb']:>7.0f} MB"
                 f"{'':>12}  Transformer Explainer ~{EXPLAINER_MB} MB for GPT-2 small: "
                 f"{page['downloaded_mb'] / EXPLAINER_MB:.2f}x")
    same = page["greedy_ids"] == py["greedy_ids"]
    lines.append(f"the 20 greedy tokens {'equal' if same else 'DIFFER from'} Python's")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.page", description=__doc__.splitlines()[0])
    p.add_argument("--single-thread", action="store_true",
                   help="serve with no cross-origin isolation: the page runs on one thread")
    p.add_argument("--weights", choices=["fp32"], default=None,
                   help="the page's other form of the weights (default: the export's own)")
    args = p.parse_args(argv)
    if not (HTML / "_static" / "web" / "web.json").is_file():
        print(f"error: no built book with the model's export in {HTML}: run `make book` first",
              file=sys.stderr)
        sys.exit(2)
    started = time.time()
    page = page_figures(not args.single_thread, args.weights)
    threads = page["threads"]
    py = python_figures(threads)
    print(report(page, py, not args.single_thread, threads))
    save({**page, "python": py, "isolated": not args.single_thread, **provenance()})
    print(f"(took {time.time() - started:.0f} s; the figures are in {default_path()})")


def default_path() -> Path:
    """Where the page's figures are kept: page.json in the cache, beside bench.json."""
    return cache_dir() / "page.json"


def save(figures: dict) -> None:
    with atomic_path(default_path()) as tmp:
        tmp.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
