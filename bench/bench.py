"""How fast is llmtrace, measured against HF transformers and against the memory bandwidth limit.

    make bench        # or: python -m llmtrace.bench [--quick] [--threads N] [--json PATH]

Threads are pinned; every time is a median of repeated runs, and every ratio the median of its
per-round ratios (the variants run in turn within each round), all measured in this one run; each
line prints its target. `run()` returns the figures as a dict and `report()` prints them: the cost
chapter calls both with quick=True, so the book shows what its build machine measured. The HF
comparison needs `transformers` (installed with the test requirements).
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

from . import NO_TRACE, Trace, generate, load_model
from .cost import decode_bytes
from .errors import LlmTraceError
from .model import trace_shapes
from .models import hf_reference

PROMPT = "The capital of France is"


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
        return statistics.median(x / y for x, y in zip(self.times[a], self.times[b]))


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


def bench_forward(model, hf, repeats: dict[int, int]) -> dict:
    """Prompt length -> repeats."""
    out = {}
    for n, repeat in repeats.items():
        ids = prompt_ids(model, n)

        def hf_forward():
            with torch.inference_mode():
                hf(ids, use_cache=False)

        r = interleaved({"off": lambda: model.forward(ids, NO_TRACE),
                         "shapes": lambda: model.forward(ids, Trace(keep_values=False)),
                         "values": lambda: model.forward(ids, Trace()),
                         "hf": hf_forward}, repeat)
        trace = Trace()
        model.forward(ids, trace)
        out[n] = {"off_s": r.seconds("off"), "shapes_s": r.seconds("shapes"), "values_s": r.seconds("values"),
                  "hf_eager_s": r.seconds("hf"), "shapes_vs_off": r.ratio("shapes", "off"),
                  "values_vs_off": r.ratio("values", "off"), "values_vs_hf": r.ratio("values", "hf"),
                  "off_vs_hf": r.ratio("off", "hf"), "page_faults_off": r.page_faults("off"),
                  "page_faults_values": r.page_faults("values"), "trace_bytes": trace.nbytes(),
                  "trace_records": len(trace)}
    return out


def blas_decode_ceiling(model, repeat, threads: int) -> float:
    """Tokens per second if a decode step were nothing but its matrix-vector products: F.linear on
    one token for every weight matrix of the model, in order, on `threads` threads. The BLAS's own
    limit on this machine."""
    w = model.weights
    mats = [m for lw in w.layers for m in (lw.q_proj, lw.k_proj, lw.v_proj, lw.o_proj, lw.gate, lw.up, lw.down)]
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

    fns = {"ours": lambda: generate(model, ids, new_tokens, trace=False, stop_at_eos=False)}
    fns.update({attn: (lambda hf=hf: hf_generate(hf)) for attn, hf in hfs.items()})
    r = interleaved(fns, repeat)
    traced = median_time(lambda: generate(model, ids, new_tokens, stop_at_eos=False), max(1, repeat // 2))
    out = {"new_tokens": new_tokens, "ours_tok_s": new_tokens / r.seconds("ours"),
           "ours_traced_tok_s": new_tokens / traced}
    for attn in hfs:
        out[f"hf_{attn}_tok_s"] = new_tokens / r.seconds(attn)
        out[f"ours_vs_hf_{attn}"] = r.ratio(attn, "ours")  # HF's time / ours = our speed / HF's
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
    out = {"tokens": n, "ours_tok_s": n / r.seconds("ours"), "ours_traced_tok_s": n / r.seconds("traced")}
    out.update({f"hf_{attn}_tok_s": n / r.seconds(attn) for attn in hfs})
    return out


def bench_cache(model, new_tokens) -> dict:
    ids = prompt_ids(model, 6)
    with_cache = generate(model, ids, new_tokens, trace=False, stop_at_eos=False)
    without = generate(model, ids, new_tokens, trace=False, stop_at_eos=False, use_cache=False)
    assert with_cache.new_ids == without.new_ids
    return {"new_tokens": new_tokens, "positions_with_cache": with_cache.positions_processed,
            "positions_without_cache": without.positions_processed, "seconds_with_cache": with_cache.seconds,
            "seconds_without_cache": without.seconds,
            "positions_ratio": without.positions_processed / with_cache.positions_processed,
            "time_ratio": without.seconds / with_cache.seconds}


def bench_meta() -> dict:
    out = {}
    for name in ["tinyllama-1.1b", "llama-2-70b"]:
        start = time.perf_counter()
        trace_shapes(name, 6, 1)
        first = time.perf_counter() - start
        out[name] = {"first_s": first, "warm_s": median_time(lambda: trace_shapes(name, 6, 1), 3, warmup=False)}
    return out


def memory_of_traced_run(model_spec: str) -> dict:
    """A fresh process: resident memory after loading the model, then after tracing the prompt with
    every value kept (VmRSS: now; VmHWM: the peak so far); then the time of its first and second
    traced pass over 256 tokens (the first must get its memory from the kernel)."""
    code = ("import sys, time, torch\n"
            "def rss():\n"
            "    f = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
            "    return [int(f[k].split()[0]) // 1024 for k in ('VmRSS', 'VmHWM')]\n"
            "from llmtrace import load_model, Trace\n"
            "from llmtrace.bench import prompt_ids\n"
            f"m = load_model({model_spec!r}); a = rss()\n"
            "logits, trace = m.run('The capital of France is'); b = rss()\n"
            "ids = prompt_ids(m, 256); t = []\n"
            "for _ in range(2):\n"
            "    start = time.perf_counter(); m.forward(ids, Trace()); t.append(time.perf_counter() - start)\n"
            "print(*a, *b, *t)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    rss_load, peak_load, rss_run, peak_run = map(int, out[:4])
    first, second = map(float, out[4:])
    return {"rss_after_load_mib": rss_load, "peak_after_load_mib": peak_load, "rss_after_traced_run_mib": rss_run,
            "peak_after_traced_run_mib": peak_run, "first_traced_256_s": first, "second_traced_256_s": second}


def run(model=None, quick: bool = False, threads: int | None = None) -> dict:
    """Every figure of the benchmark, measured now. quick: fewer repeats and tokens (about a minute
    and a half instead of five)."""
    threads = os.cpu_count() if threads is None else threads
    if threads < 1:
        raise LlmTraceError(f"threads must be at least 1, got {threads}")
    torch.set_num_threads(threads)
    # repeats, new tokens for decode, new tokens for the KV-cache comparison; the forward passes, whose
    # ratios carry the tightest targets, get more rounds (the 6-token one is short and noisy)
    repeat, new_tokens, kv_tokens = (3, 16, 30) if quick else (7, 50, 100)
    forward_repeats = {6: 30, 256: 7} if quick else {6: 40, 256: 9}
    model = model or load_model(os.environ.get("LLMTRACE_MODEL", "embedded"))
    c = model.config
    hfs = {attn: hf_reference(model, attn) for attn in ("eager", "sdpa")}
    started = time.perf_counter()
    r = {"model": c.name, "threads": torch.get_num_threads(), "torch": torch.__version__,
         "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "quick": quick,
         "date": time.strftime("%Y-%m-%d %H:%M")}
    r["bandwidth_gb_s"] = memory_bandwidth() / 1e9
    r["forward"] = bench_forward(model, hfs["eager"], forward_repeats)
    r["decode"] = bench_decode(model, hfs, new_tokens, repeat)
    r["prefill"] = bench_prefill(model, hfs, 256, repeat)
    context = 6 + new_tokens // 2  # the average cache length over the decode run
    need = decode_bytes(c, context)
    b = {"bytes_per_step": need["total"], "weights_bytes": need["weights"], "kv_bytes": need["kv_cache"],
         "context": context, "bound_tok_s": r["bandwidth_gb_s"] * 1e9 / need["total"],
         "blas_ceiling_tok_s": blas_decode_ceiling(model, repeat, r["threads"]),
         "blas_ceiling_1_thread_tok_s": blas_decode_ceiling(model, repeat, 1)}
    b["fraction"] = r["decode"]["ours_tok_s"] / b["bound_tok_s"]
    b["fraction_of_blas"] = r["decode"]["ours_tok_s"] / b["blas_ceiling_tok_s"]
    b["blas_gb_s"] = b["blas_ceiling_tok_s"] * need["weights"] / 1e9
    r["decode_bound"] = b
    r["kv_cache"] = bench_cache(model, kv_tokens)
    r["meta"] = bench_meta()
    r["memory"] = memory_of_traced_run("embedded" if model.name == "smollm2-135m" else model.source)
    r["seconds"] = time.perf_counter() - started
    return r


def default_path() -> Path:
    """Where `make bench` keeps its figures: bench.json in the cache (the checkout's .cache/)."""
    from .cache import cache_dir

    return cache_dir() / "bench.json"


def save(r: dict, path: Path) -> None:
    from .cache import atomic_path

    with atomic_path(Path(path)) as tmp:
        tmp.write_text(json.dumps(r, indent=2))


def load(path: Path) -> dict:
    r = json.loads(Path(path).read_text())
    r["forward"] = {int(n): f for n, f in r["forward"].items()}  # JSON keys are strings
    return r


def latest(model=None) -> dict:
    """The figures of the last `make bench` (or `make book`'s quick run) on this machine, if it
    benchmarked this model; otherwise a quick run now, kept for next time."""
    path = default_path()
    name = model.config.name if model is not None else None
    if path.is_file():
        r = load(path)
        if name in (None, r["model"]):
            return r
    r = run(model, quick=True)
    save(r, path)
    return r


def report(r) -> str:
    f6, f256, d, pf, b, kv, m, mem = (r["forward"][6], r["forward"][256], r["decode"], r["prefill"],
                                      r["decode_bound"], r["kv_cache"], r["meta"], r["memory"])
    ok = lambda good: "ok" if good else "MISSED"  # noqa: E731
    lines = [
        f"llmtrace benchmark: {r['model']}, {r['threads']} threads, torch {r['torch']}, {r['cpus']} CPUs, "
        f"{r['date']}{' (quick)' if r['quick'] else ''}",
        "",
        "1. trace overhead (forward pass, median)              measured     target",
    ]
    for n, f in ((6, f6), (256, f256)):
        target = 1.2 if n == 6 else 1.1
        lines += [
            f"   {n:>3} tokens: tracing off {f['off_s'] * 1e3:8.1f} ms; HF eager {f['hf_eager_s'] * 1e3:8.1f} ms",
            f"      shapes only / off                               {f['shapes_vs_off']:6.3f}x    <= 1.05x  {ok(f['shapes_vs_off'] <= 1.05)}",
            f"      every value / off                               {f['values_vs_off']:6.3f}x "
            f"   (minor page faults per pass: {f['page_faults_values']:,.0f} vs {f['page_faults_off']:,.0f} off)",
            f"      every value / HF plain forward                  {f['values_vs_hf']:6.3f}x    <= {target}x   {ok(f['values_vs_hf'] <= target)}",
            f"      trace size: {f['trace_bytes'] / 2**20:8.1f} MiB in {f['trace_records']} records"
            + (" (TransformerLens's cache: about 520 MiB)" if n == 256 else ""),
        ]
    lines += [
        f"   a fresh process: first traced pass over 256 tokens {mem['first_traced_256_s'] * 1e3:6.0f} ms "
        f"(its memory comes from the kernel), second {mem['second_traced_256_s'] * 1e3:6.0f} ms",
        "",
        f"2. greedy decode, {d['new_tokens']} new tokens (tokens/s)",
        f"   llmtrace, untraced {d['ours_tok_s']:7.1f}; traced (every value) {d['ours_traced_tok_s']:7.1f}",
        f"   HF generate eager  {d['hf_eager_tok_s']:7.1f}  ratio {d['ours_vs_hf_eager']:5.2f}    >= 1.0   {ok(d['ours_vs_hf_eager'] >= 1.0)}",
        f"   HF generate sdpa   {d['hf_sdpa_tok_s']:7.1f}  ratio {d['ours_vs_hf_sdpa']:5.2f}    >= 1.0   {ok(d['ours_vs_hf_sdpa'] >= 1.0)}",
        f"   prefill of {pf['tokens']} tokens: llmtrace {pf['ours_tok_s']:5.0f} tok/s, traced {pf['ours_traced_tok_s']:5.0f}; "
        f"HF eager {pf['hf_eager_tok_s']:5.0f}; HF sdpa {pf['hf_sdpa_tok_s']:5.0f}",
        "",
        "3. against the memory-bandwidth limit",
        f"   measured bandwidth (1 GiB streaming read)  {r['bandwidth_gb_s']:6.1f} GB/s",
        f"   bytes per decode step: weights {b['weights_bytes'] / 1e6:6.1f} MB + KV cache {b['kv_bytes'] / 1e6:5.2f} MB "
        f"(context {b['context']})",
        f"   bound {b['bound_tok_s']:6.1f} tok/s; reached {d['ours_tok_s']:6.1f} = {b['fraction']:.0%}      >= 50%   {ok(b['fraction'] >= 0.5)}",
        f"   the BLAS alone (F.linear on one token, every weight matrix in turn): {b['blas_ceiling_tok_s']:.1f} tok/s "
        f"= {b['blas_gb_s']:.1f} GB/s of weights; with 1 thread {b['blas_ceiling_1_thread_tok_s']:.1f} tok/s",
        f"   decode reaches {b['fraction_of_blas']:.0%} of the BLAS alone",
        "",
        f"4. KV cache, {kv['new_tokens']} new tokens: positions {kv['positions_with_cache']} with vs "
        f"{kv['positions_without_cache']} without ({kv['positions_ratio']:.1f}x); time {kv['seconds_with_cache']:.2f} s vs "
        f"{kv['seconds_without_cache']:.2f} s ({kv['time_ratio']:.1f}x)",
        "",
        "5. shape-only tracing on the meta device (prefill of 6 tokens + 1 decode step)",
    ]
    for name, t in m.items():
        lines.append(f"   {name:15} first call {t['first_s']:5.2f} s, then {t['warm_s']:5.2f} s")
    lines += [
        "",
        f"6. memory (a fresh process): resident {mem['rss_after_load_mib']} MiB after loading the model "
        f"(peak {mem['peak_after_load_mib']}), {mem['rss_after_traced_run_mib']} MiB after a fully "
        f"traced run of the prompt (peak {mem['peak_after_traced_run_mib']})",
        f"   the trace itself: {f6['trace_bytes'] / 2**20:.1f} MiB with every value at 6 tokens, "
        f"{f256['trace_bytes'] / 2**20:.0f} MiB at 256 tokens, 0 bytes with shapes only",
        f"\n(benchmark took {r['seconds']:.0f} s)",
    ]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(prog="python -m llmtrace.bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats and tokens (about 90 s instead of 300)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads to pin (default: every CPU)")
    p.add_argument("--json", default=None, help="where to write the figures (default: bench.json in the cache, "
                   "which the book's cost chapter reads)")
    args = p.parse_args()
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
