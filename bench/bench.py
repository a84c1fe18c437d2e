"""How fast is llmtrace, measured against HF transformers and against the memory bandwidth limit.

    make bench    # or, in the checkout: python -m bench.bench [--quick] [--threads N] [--json PATH]

Threads are pinned; every time is a median of repeated runs, and every ratio the median of its
per-round ratios (the variants run in turn within each round), all measured in this one run; each
line prints its target. `run()` returns the figures as a dict, with when, where and on which commit
they were measured; `report()` prints them; `main()` also keeps them in the cache's bench.json,
which the cost chapter shows (labelled stale once the checkout has moved on). The HF comparison
needs `transformers` (installed with the test requirements).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from llmtrace_book import LlmTraceError, Trace, generate, load_model, trace_shapes
from llmtrace_book.disk_cache import atomic_path, cache_dir
from llmtrace_book.cost import decode_bytes
from llmtrace_book.trace import NO_TRACE

from .reference import hf_reference

PROMPT = "The capital of France is"
ROOT = Path(__file__).resolve().parents[1]  # the checkout


class Timings:
    """Seconds and minor page faults of each variant, one entry per round."""

    def __init__(self, times: dict, faults: dict):
        self.times, self.faults = times, faults

    def seconds(self, k) -> float:
        return statistics.median(self.times[k])

    def page_faults(self, k) -> float:
        return statistics.median(self.faults[k])

    def ratio(self, a, b) -> float:
        """Median over rounds of a's time / b's time within the same round: the machine's drift
        between rounds cancels out of it."""
        return statistics.median(self.ratios(a, b))

    def ratios(self, a, b) -> list[float]:
        return [x / y for x, y in zip(self.times[a], self.times[b])]

    def spread(self, a, b) -> list[float]:
        """[min, median, max] of the per-round ratios: how far one round can stray."""
        r = self.ratios(a, b)
        return [min(r), statistics.median(r), max(r)]


def interleaved(fns: dict, repeat: int, warmup: bool = True) -> Timings:
    """Run every variant once per round, in a rotating order, `repeat` rounds (after one warm-up
    of each), so that the machine's drift over time (frequency, other load) falls on all alike."""
    if warmup:
        for fn in fns.values():
            fn()
    times = {k: [] for k in fns}
    faults = {k: [] for k in fns}
    for i in range(repeat):
        keys = list(fns)[i % len(fns):] + list(fns)[:i % len(fns)]
        for k in keys:
            gc.collect()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - start)
            faults[k].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return Timings(times, faults)


def median_time(fn, repeat: int, warmup: bool = True) -> float:
    return interleaved({"fn": fn}, repeat, warmup).seconds("fn")


def memory_bandwidth(gib: float = 1.0, repeat: int = 5) -> float:
    """Bytes per second of a streaming read far larger than any cache: a sum over `gib` GiB."""
    x = torch.ones(int(gib * 2**30) // 4)
    seconds = median_time(lambda: x.sum(), repeat)
    return x.numel() * 4 / seconds


def prompt_ids(model, n: int) -> torch.Tensor:
    """The prompt, repeated until it is n tokens long."""
    ids = model.tokenizer.encode((PROMPT + " Paris. ") * n)[:n]
    return torch.tensor([ids])


class EveryTensorHeld(Trace):
    """A trace as it was before records could be recomputed or pooled: every record holds the
    tensor its op made, in memory malloc hands out afresh (for comparison only)."""

    def __init__(self):
        super().__init__(pool=None)

    def record(self, name, op, tensor, macs=0, recompute=None):
        return super().record(name, op, tensor, macs)


def bench_forward(model, hf, repeats: dict[int, int]) -> dict:
    """Prompt length -> repeats. In this process malloc keeps its defaults, unless the caller
    made the opt-in (`forward_keep_freed` measures that in a process of its own)."""
    out = {}
    for n, repeat in repeats.items():
        ids = prompt_ids(model, n)

        def hf_forward():
            with torch.inference_mode():
                hf(ids, use_cache=False)

        fns = {"off": lambda: model.forward(ids, NO_TRACE),
               "shapes": lambda: model.forward(ids, Trace(keep_values=False)),
               "values": lambda: model.forward(ids, Trace()),
               "hf": hf_forward}
        if n >= 256:  # where it matters: the trace as it was, every tensor held, no pool
            fns["held"] = lambda: model.forward(ids, EveryTensorHeld())
        r = interleaved(fns, repeat)
        trace, held = Trace(), EveryTensorHeld()
        model.forward(ids, trace)
        model.forward(ids, held)
        out[n] = {"off_s": r.seconds("off"), "shapes_s": r.seconds("shapes"),
                  "values_s": r.seconds("values"),
                  "hf_eager_s": r.seconds("hf"), "shapes_vs_off": r.ratio("shapes", "off"),
                  "values_vs_off": r.ratio("values", "off"),
                  "values_vs_hf": r.ratio("values", "hf"),
                  "values_rounds_within_1_1": sum(x <= 1.1 for x in r.ratios("values", "hf")),
                  "rounds": repeat,
                  "off_vs_hf": r.ratio("off", "hf"), "page_faults_off": r.page_faults("off"),
                  "page_faults_hf": r.page_faults("hf"),
                  "shapes_vs_off_spread": r.spread("shapes", "off"),
                  "values_vs_hf_spread": r.spread("values", "hf"),
                  "page_faults_values": r.page_faults("values"), "trace_bytes": trace.nbytes(),
                  "trace_records": len(trace),
                  "trace_recomputed": sum(rec.recomputed for rec in trace),
                  "held_trace_bytes": held.nbytes()}
        if "held" in fns:
            out[n].update({"held_vs_hf": r.ratio("held", "hf"),
                           "held_vs_hf_spread": r.spread("held", "hf"),
                           "page_faults_held": r.page_faults("held")})
    return out


def forward_keep_freed(repeats: dict[int, int], threads: int) -> dict:
    """`bench_forward` in a fresh process that made the opt-in (`keep_freed_memory()`, a
    process-wide malloc setting): its figures, beside the defaults' of this process."""
    code = ("import json, sys, torch\n"
            "from llmtrace_book import load_model\n"
            "from llmtrace_book.memory import keep_freed_memory\n"
            "from bench.bench import bench_forward\n"
            "from bench.reference import hf_reference\n"
            f"torch.set_num_threads({threads}); assert keep_freed_memory()\n"
            "m = load_model('embedded'); hf = hf_reference(m, 'eager')\n"
            f"print(json.dumps(bench_forward(m, hf, {repeats!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    return {int(n): f for n, f in json.loads(out.splitlines()[-1]).items()}


def blas_decode_ceiling(model, repeat, threads: int) -> float:
    """Tokens per second if a decode step were nothing but its matrix-vector products: F.linear on
    one token for every weight matrix of the model, in order, on `threads` threads. The BLAS's own
    limit on this machine."""
    w = model.weights
    mats = [m for lw in w.layers
            for m in (lw.q_proj, lw.k_proj, lw.v_proj, lw.o_proj, lw.gate, lw.up, lw.down)]
    mats.append(w.lm_head)
    x = {m.shape[1]: torch.randn(1, 1, m.shape[1]) for m in mats}

    def step():
        for m in mats:
            torch.nn.functional.linear(x[m.shape[1]], m)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return 1 / median_time(step, repeat)
    finally:
        torch.set_num_threads(before)


def bench_decode(model, hfs, new_tokens, repeat) -> dict:
    ids = prompt_ids(model, 6)

    def hf_generate(hf):
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                        pad_token_id=model.config.eos_id)

    fns = {"ours": lambda: generate(model, ids, new_tokens, stop_at_eos=False, trace=False)}
    fns.update({attn: (lambda hf=hf: hf_generate(hf)) for attn, hf in hfs.items()})
    r = interleaved(fns, repeat)
    traced = median_time(lambda: generate(model, ids, new_tokens, stop_at_eos=False),
                         max(1, repeat // 2))
    out = {"new_tokens": new_tokens, "ours_tok_s": new_tokens / r.seconds("ours"),
           "ours_traced_tok_s": new_tokens / traced}
    for attn in hfs:
        out[f"hf_{attn}_tok_s"] = new_tokens / r.seconds(attn)
        out[f"ours_vs_hf_{attn}"] = r.ratio(attn, "ours")  # HF's time / ours = our speed / HF's
        out[f"ours_vs_hf_{attn}_spread"] = r.spread(attn, "ours")
    return out


def bench_prefill(model, hfs, n, repeat) -> dict:
    ids = prompt_ids(model, n)

    def hf_forward(hf):
        with torch.inference_mode():
            hf(ids)

    fns = {"ours": lambda: model.forward(ids, NO_TRACE, model.new_cache(n)),
           "traced": lambda: model.forward(ids, Trace(), model.new_cache(n))}
    fns.update({attn: (lambda hf=hf: hf_forward(hf)) for attn, hf in hfs.items()})
    r = interleaved(fns, repeat)
    out = {"tokens": n, "ours_tok_s": n / r.seconds("ours"),
           "ours_traced_tok_s": n / r.seconds("traced")}
    out.update({f"hf_{attn}_tok_s": n / r.seconds(attn) for attn in hfs})
    return out


def bench_cache(model, new_tokens) -> dict:
    """The decode loop with and without the KV cache, on the prompt itself, as chapter 11
    runs it."""
    ids = model.encode(PROMPT)
    with_cache = generate(model, ids, new_tokens, stop_at_eos=False, trace=False)
    without = generate(model, ids, new_tokens, stop_at_eos=False, use_cache=False,
                       trace=False)
    assert with_cache.new_ids == without.new_ids
    return {"new_tokens": new_tokens, "prompt_tokens": ids.shape[1],
            "positions_with_cache": with_cache.positions_processed,
            "positions_without_cache": without.positions_processed,
            "seconds_with_cache": with_cache.seconds,
            "seconds_without_cache": without.seconds,
            "positions_ratio": without.positions_processed / with_cache.positions_processed,
            "time_ratio": without.seconds / with_cache.seconds}


# the shape trace of the largest preset, 671B parameters, must stay under this many seconds
META_671B_TARGET_S = 10.0


def bench_meta() -> dict:
    out = {}
    for name in ["tinyllama-1.1b", "llama-2-70b", "deepseek-v3"]:
        start = time.perf_counter()
        trace_shapes(name, 6, 1)
        first = time.perf_counter() - start
        out[name] = {"first_s": first,
                     "warm_s": median_time(lambda: trace_shapes(name, 6, 1), 3, warmup=False)}
    return out


def memory_of_traced_run(model_spec: str, keep_freed: bool = False) -> dict:
    """A fresh process: resident memory after loading the model, then after tracing the prompt with
    every value kept (VmRSS: now; VmHWM: the peak so far); then the time of its first and second
    traced pass over 256 tokens (the first must get its memory from the kernel; the second too,
    unless glibc keeps freed memory: keep_freed sets the opt-in, LLMTRACE_KEEP_FREED_MEMORY)."""
    code = ("import sys, time, torch\n"
            "def rss():\n"
            "    f = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
            "    return [int(f[k].split()[0]) // 1024 for k in ('VmRSS', 'VmHWM')]\n"
            "from llmtrace_book import load_model\n"
            "from bench.bench import prompt_ids\n"
            f"m = load_model({model_spec!r}); a = rss()\n"
            "logits, trace = m.run('The capital of France is'); b = rss()\n"
            "del trace; ids = prompt_ids(m, 256); t = []\n"
            "for _ in range(2):\n"
            "    start = time.perf_counter(); m.run(ids); t.append(time.perf_counter() - start)\n"
            "print(*a, *b, *t)")
    env = {**os.environ, "LLMTRACE_KEEP_FREED_MEMORY": "1" if keep_freed else "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT, env=env).stdout.split()
    rss_load, peak_load, rss_run, peak_run = map(int, out[:4])
    first, second = map(float, out[4:])
    return {"rss_after_load_mib": rss_load, "peak_after_load_mib": peak_load,
            "rss_after_traced_run_mib": rss_run, "peak_after_traced_run_mib": peak_run,
            "first_traced_256_s": first, "second_traced_256_s": second}


def chapter_seconds(name: str = "14_inside_the_layers.ipynb") -> float:
    """Wall time of one chapter executed top to bottom in a fresh kernel (`jupyter execute`,
    nothing written back): chapter 14 runs its patching sweeps batched, to stay under a minute."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "jupyter", "execute", str(ROOT / "notebooks" / name)],
                   capture_output=True, text=True, check=True, cwd=ROOT / "notebooks")
    return time.perf_counter() - start


def cpu_model() -> str:
    """The processor's name as the kernel reports it ("AMD EPYC"), else the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit(root: Path = ROOT) -> tuple[str | None, bool]:
    """(the checkout's commit, whether tracked files differ from it); (None, False) outside git."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)

    head = git("rev-parse", "HEAD")
    if head.returncode != 0:
        return None, False
    changes = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip(), bool(changes)


def provenance() -> dict:
    """When, on what and on which code the figures are measured."""
    commit, dirty = git_commit()
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_model(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "commit": commit, "dirty": dirty}


def run(model=None, quick: bool = False, threads: int | None = None) -> dict:
    """Every figure of the benchmark, measured now. quick: fewer repeats and tokens (about two
    minutes instead of seven)."""
    threads = os.cpu_count() if threads is None else threads
    if threads < 1:
        raise LlmTraceError(f"threads must be at least 1, got {threads}")
    torch.set_num_threads(threads)
    # repeats, new tokens for decode, new tokens for the KV-cache comparison; the forward passes,
    # whose ratios carry the tightest targets, get more rounds (the 6-token one is short and noisy)
    repeat, new_tokens, kv_tokens = (3, 16, 30) if quick else (7, 50, 100)
    forward_repeats = {6: 30, 256: 7} if quick else {6: 40, 256: 9}
    model = model or load_model(os.environ.get("LLMTRACE_MODEL", "embedded"))
    c = model.config
    hfs = {attn: hf_reference(model, attn) for attn in ("eager", "sdpa")}
    started = time.perf_counter()
    r = {"model": c.name, "threads": torch.get_num_threads(), "quick": quick, **provenance()}
    r["bandwidth_gb_s"] = memory_bandwidth() / 1e9
    # malloc's defaults in this process, as a reader gets them; the opt-in in its own process
    r["keep_freed_memory"] = False
    r["forward"] = bench_forward(model, hfs["eager"], forward_repeats)
    if model.name == "smollm2-135m-instruct":
        r["forward_keep_freed"] = forward_keep_freed({256: forward_repeats[256]}, threads)
    r["decode"] = bench_decode(model, hfs, new_tokens, repeat)
    r["prefill"] = bench_prefill(model, hfs, 256, repeat)
    context = 6 + new_tokens // 2  # the average cache length over the decode run
    need = decode_bytes(c, context)
    b = {"bytes_per_step": need["total"], "weights_bytes": need["weights"],
         "kv_bytes": need["kv_cache"], "context": context,
         "bound_tok_s": r["bandwidth_gb_s"] * 1e9 / need["total"],
         "blas_ceiling_tok_s": blas_decode_ceiling(model, repeat, r["threads"]),
         "blas_ceiling_1_thread_tok_s": blas_decode_ceiling(model, repeat, 1)}
    b["fraction"] = r["decode"]["ours_tok_s"] / b["bound_tok_s"]
    b["fraction_of_blas"] = r["decode"]["ours_tok_s"] / b["blas_ceiling_tok_s"]
    b["blas_gb_s"] = b["blas_ceiling_tok_s"] * need["weights"] / 1e9
    r["decode_bound"] = b
    r["kv_cache"] = bench_cache(model, kv_tokens)
    r["meta"] = bench_meta()
    spec = "embedded" if model.name == "smollm2-135m-instruct" else model.source
    r["memory"] = memory_of_traced_run(spec, keep_freed=False)
    r["memory_keep_freed"] = memory_of_traced_run(spec, keep_freed=True)
    r["chapter_14_s"] = chapter_seconds()
    r["seconds"] = time.perf_counter() - started
    return r


def default_path() -> Path:
    """Where `make bench` keeps its figures: bench.json in the cache (the checkout's .cache/)."""
    return cache_dir() / "bench.json"


def save(r: dict, path: Path) -> None:
    with atomic_path(Path(path)) as tmp:
        tmp.write_text(json.dumps(r, indent=2))


def load(path: Path) -> dict:
    r = json.loads(Path(path).read_text())
    r["forward"] = {int(n): f for n, f in r["forward"].items()}  # JSON keys are strings
    return r


def report(r) -> str:
    """The figures as text: each ratio with its target, its verdict and the spread of its rounds."""
    f6, f256, d, pf, b, kv, m, mem = (r["forward"][6], r["forward"][256], r["decode"], r["prefill"],
                                      r["decode_bound"], r["kv_cache"], r["meta"], r["memory"])

    def ratio(label, value, target="", good=None, spread=None):
        verdict = "" if good is None else ("ok" if good else "MISSED")
        rounds = f"(rounds {spread[0]:.3f}-{spread[2]:.3f})" if spread else ""
        return f"   {label:50}{value:6.3f}x   {target:9}{verdict:8}{rounds}".rstrip()

    commit = f"commit {(r['commit'] or '?')[:12]}"
    commit += " + uncommitted changes" if r["dirty"] else ""
    lines = [
        f"llmtrace benchmark: {r['model']}, {r['threads']} threads, torch {r['torch']}, {r['cpu']} "
        f"({r['cpus']} CPUs), {r['date']}{' (quick)' if r['quick'] else ''}, {commit}",
        "",
        "1. trace overhead (forward pass, median of rounds)        measured   target",
    ]
    for n, f in ((6, f6), (256, f256)):
        target = 1.2 if n == 6 else 1.1
        faults = f"{f['page_faults_values']:,.0f} vs {f['page_faults_off']:,.0f} off"
        lines += [
            f"   {n} tokens: tracing off {f['off_s'] * 1e3:.1f} ms; "
            f"HF eager {f['hf_eager_s'] * 1e3:.1f} ms; malloc's defaults",
            ratio("shapes only / off", f["shapes_vs_off"], "<= 1.05x", f["shapes_vs_off"] <= 1.05,
                  f["shapes_vs_off_spread"]),
            ratio("every value / off", f["values_vs_off"]) + f"   (page faults per pass: {faults})",
            ratio("every value / HF plain forward", f["values_vs_hf"], f"<= {target}x",
                  f["values_vs_hf"] <= target, f["values_vs_hf_spread"])
            + (f"   {f['values_rounds_within_1_1']}/{f['rounds']} rounds within 1.1x"
               if "rounds" in f and n == 256 else ""),
        ]
        if "held_vs_hf" in f:
            lines.append(ratio("  every tensor held, no pool (as before) / HF", f["held_vs_hf"],
                               spread=f["held_vs_hf_spread"])
                         + f"   (page faults {f['page_faults_held']:,.0f})")
        keep = r.get("forward_keep_freed", {}).get(n)
        if keep:
            lines.append(ratio("  every value / HF, opt-in keep_freed_memory()",
                               keep["values_vs_hf"], spread=keep["values_vs_hf_spread"])
                         + f"   (its own process; page faults {keep['page_faults_values']:,.0f})")
        size = f["trace_bytes"] / 2**20
        line = f"   trace size: {size:.1f} MiB in {f['trace_records']} records"
        if "trace_recomputed" in f:
            line += (f" ({f['trace_recomputed']} recomputed when read; every tensor held: "
                     f"{f['held_trace_bytes'] / 2**20:.1f} MiB)")
        if n == 256:
            line += f"   target <= 522 MiB (TransformerLens)   {'ok' if size <= 522 else 'MISSED'}"
        lines.append(line)
    keep = r.get("memory_keep_freed", mem)
    lines += [
        f"   a fresh process: first traced pass over 256 tokens "
        f"{mem['first_traced_256_s'] * 1e3:.0f} ms "
        f"(its memory comes from the kernel), second {mem['second_traced_256_s'] * 1e3:.0f} ms "
        f"with malloc's defaults, {keep['second_traced_256_s'] * 1e3:.0f} ms with "
        f"LLMTRACE_KEEP_FREED_MEMORY=1",
        "",
        f"2. greedy decode, {d['new_tokens']} new tokens: llmtrace {d['ours_tok_s']:.1f} tok/s "
        "untraced, "
        f"{d['ours_traced_tok_s']:.1f} traced (every value)",
    ]
    for attn in ("eager", "sdpa"):
        lines.append(ratio(f"llmtrace / HF generate {attn} ({d[f'hf_{attn}_tok_s']:.1f} tok/s)",
                           d[f"ours_vs_hf_{attn}"], ">= 1.0", d[f"ours_vs_hf_{attn}"] >= 1.0,
                           d[f"ours_vs_hf_{attn}_spread"]))
    lines += [
        f"   prefill of {pf['tokens']} tokens: llmtrace {pf['ours_tok_s']:.0f} tok/s, traced "
        f"{pf['ours_traced_tok_s']:.0f}; HF eager {pf['hf_eager_tok_s']:.0f}; "
        f"HF sdpa {pf['hf_sdpa_tok_s']:.0f}",
        "",
        "3. against the memory-bandwidth limit",
        f"   measured bandwidth (1 GiB streaming read): {r['bandwidth_gb_s']:.1f} GB/s",
        f"   bytes per decode step: weights {b['weights_bytes'] / 1e6:.1f} MB + KV cache "
        f"{b['kv_bytes'] / 1e6:.2f} MB (context {b['context']})",
        f"   bound {b['bound_tok_s']:.1f} tok/s; decode reached {d['ours_tok_s']:.1f} = "
        f"{b['fraction']:.0%}   target >= 50%   {'ok' if b['fraction'] >= 0.5 else 'MISSED'}",
        f"   the BLAS alone (F.linear on one token, every weight matrix in turn): "
        f"{b['blas_ceiling_tok_s']:.1f} tok/s = {b['blas_gb_s']:.1f} GB/s of weights; "
        f"with 1 thread {b['blas_ceiling_1_thread_tok_s']:.1f} tok/s",
        f"   decode reaches {b['fraction_of_blas']:.0%} of the BLAS alone",
        "",
        f"4. KV cache, {kv['new_tokens']} new tokens after {kv['prompt_tokens']} of prompt: "
        f"positions {kv['positions_with_cache']:,} with vs "
        f"{kv['positions_without_cache']:,} without ({kv['positions_ratio']:.1f}x); "
        f"time {kv['seconds_with_cache']:.2f} s vs {kv['seconds_without_cache']:.2f} s "
        f"({kv['time_ratio']:.1f}x)",
        "",
        report_meta(m),
    ]
    lines += [
        "",
        f"6. memory (a fresh process): resident {mem['rss_after_load_mib']} MiB after loading the "
        f"model (peak {mem['peak_after_load_mib']}), {mem['rss_after_traced_run_mib']} MiB after a "
        f"fully traced run of the prompt (peak {mem['peak_after_traced_run_mib']})",
        f"   the trace itself: {f6['trace_bytes'] / 2**20:.1f} MiB with every value at 6 tokens, "
        f"{f256['trace_bytes'] / 2**20:.0f} MiB at 256 tokens, 0 bytes with shapes only",
        *(["", f"7. chapter 14 (activation patching over 8 prompt pairs) in a fresh kernel: "
           f"{r['chapter_14_s']:.0f} s"] if "chapter_14_s" in r else []),
        f"\n(benchmark took {r['seconds']:.0f} s)",
    ]
    return "\n".join(lines)


def report_meta(m: dict) -> str:
    """Part 5: the shape traces' times, and the largest preset's against its target."""
    lines = ["5. shape-only tracing on the meta device (prefill of 6 tokens + 1 decode step)"]
    for name, t in m.items():
        lines.append(f"   {name:15} first call {t['first_s']:5.2f} s, then {t['warm_s']:5.2f} s")
    if "deepseek-v3" in m:  # 61 layers of latent attention and 256 experts
        first = m["deepseek-v3"]["first_s"]
        lines.append(f"   deepseek-v3 (671B) first call / {META_671B_TARGET_S:.0f} s: "
                     f"{first / META_671B_TARGET_S:.2f}x   target < 1x   "
                     f"{'ok' if first < META_671B_TARGET_S else 'MISSED'}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="fewer repeats and tokens (about 2 min instead of 7)")
    p.add_argument("--threads", type=int, default=os.cpu_count(),
                   help="threads to pin (default: every CPU)")
    p.add_argument("--meta", action="store_true",
                   help="only the shape traces on the meta device (part 5), printed, not saved")
    p.add_argument("--json", default=None,
                   help="where to write the figures (default: bench.json in the cache, "
                   "which the book's cost chapter reads)")
    args = p.parse_args(argv)
    if args.meta:
        m = bench_meta()
        print(report_meta(m))
        return
    try:
        r = run(quick=args.quick, threads=args.threads)
    except LlmTraceError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    path = Path(args.json) if args.json else default_path()
    save(r, path)
    print(report(r))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
