"""How fast is llmtrace, measured against HF transformers and against the memory bandwidth limit.

    make bench                      # or: .venv/bin/python bench/bench.py [--quick] [--json PATH]

Every figure is a median of repeated runs on pinned threads, all measured in this one run; each
line prints its target. The JSON file (default _build/bench/bench.json) feeds the book's cost chapter.
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

from llmtrace import NO_TRACE, Trace, generate, load_model
from llmtrace.cost import decode_bytes
from llmtrace.model import trace_shapes

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"


def interleaved(fns: dict, repeat: int) -> dict:
    """Median seconds of each variant, run in turn within every repeat, so that the machine's
    drift over time (frequency, other load) falls on all of them alike."""
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
    return {k: (statistics.median(times[k]), statistics.median(faults[k])) for k in fns}


def median_time(fn, repeat: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth(gib: float = 1.0, repeat: int = 5) -> float:
    """Bytes per second of a streaming read far larger than any cache: a sum over `gib` GiB."""
    x = torch.ones(int(gib * 2**30) // 4)
    seconds = median_time(lambda: x.sum(), repeat)
    return x.numel() * 4 / seconds


def prompt_ids(model, n: int) -> torch.Tensor:
    """The prompt, repeated until it is n tokens long."""
    ids = model.tokenizer.encode((PROMPT + " Paris. ") * n)[:n]
    return torch.tensor([ids])


def hf_model(model, attn: str):
    from transformers import LlamaForCausalLM

    from llmtrace.models import embedded_checkpoint

    return LlamaForCausalLM.from_pretrained(embedded_checkpoint(), attn_implementation=attn,
                                            dtype=torch.float32).eval()


def bench_forward(model, hf, lengths, repeat) -> dict:
    out = {}
    for n in lengths:
        ids = prompt_ids(model, n)

        def hf_forward():
            with torch.inference_mode():
                hf(ids, use_cache=False)

        r = interleaved({"off": lambda: model.forward(ids, NO_TRACE),
                         "shapes": lambda: model.forward(ids, Trace(keep_values=False)),
                         "values": lambda: model.forward(ids, Trace()),
                         "hf": hf_forward}, repeat)
        (t_off, f_off), (t_shapes, _), (t_values, f_values), (t_hf, _) = r["off"], r["shapes"], r["values"], r["hf"]
        trace = Trace()
        model.forward(ids, trace)
        out[n] = {"off_s": t_off, "shapes_s": t_shapes, "values_s": t_values, "hf_eager_s": t_hf,
                  "shapes_vs_off": t_shapes / t_off, "values_vs_off": t_values / t_off,
                  "values_vs_hf": t_values / t_hf, "off_vs_hf": t_off / t_hf,
                  "page_faults_off": f_off, "page_faults_values": f_values,
                  "trace_bytes": trace.nbytes(), "trace_records": len(trace)}
    return out


def blas_decode_ceiling(model, repeat) -> float:
    """Tokens per second if a decode step were nothing but its matrix-vector products: F.linear on
    one token for every weight matrix of the model, in order. The BLAS's own limit on this machine."""
    w = model.weights
    mats = [m for lw in w.layers for m in (lw.q_proj, lw.k_proj, lw.v_proj, lw.o_proj, lw.gate, lw.up, lw.down)]
    mats.append(w.lm_head)
    x = {m.shape[1]: torch.randn(1, 1, m.shape[1]) for m in mats}

    def step():
        for m in mats:
            torch.nn.functional.linear(x[m.shape[1]], m)

    return 1 / median_time(step, repeat)


def bench_decode(model, hfs, new_tokens, repeat) -> dict:
    ids = prompt_ids(model, 6)
    ours = median_time(lambda: generate(model, ids, new_tokens, trace=False, stop_at_eos=False), repeat)
    traced = median_time(lambda: generate(model, ids, new_tokens, stop_at_eos=False), max(1, repeat // 2))
    out = {"new_tokens": new_tokens, "ours_tok_s": new_tokens / ours, "ours_traced_tok_s": new_tokens / traced}
    for attn, hf in hfs.items():
        with torch.inference_mode():
            t = median_time(lambda: hf.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                do_sample=False, pad_token_id=model.config.eos_id), repeat)
        out[f"hf_{attn}_tok_s"] = new_tokens / t
        out[f"ours_vs_hf_{attn}"] = t / ours
    return out


def bench_prefill(model, hfs, n, repeat) -> dict:
    ids = prompt_ids(model, n)
    t = median_time(lambda: model.forward(ids, NO_TRACE, model.new_cache(n)), repeat)
    out = {"tokens": n, "ours_tok_s": n / t}
    for attn, hf in hfs.items():
        with torch.inference_mode():
            out[f"hf_{attn}_tok_s"] = n / median_time(lambda: hf(ids), repeat)
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
        out[name] = {"first_s": first, "warm_s": median_time(lambda: trace_shapes(name, 6, 1), 3, warmup=0)}
    return out


def memory_of_traced_run() -> dict:
    """Resident memory of a fresh process: after loading the embedded model, then after tracing the
    prompt with every value kept (VmRSS: now; VmHWM: the peak so far)."""
    code = ("import sys\n"
            "def rss():\n"
            "    f = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
            "    return [int(f[k].split()[0]) // 1024 for k in ('VmRSS', 'VmHWM')]\n"
            "from llmtrace import load_model\n"
            "m = load_model('embedded'); a = rss()\n"
            "logits, trace = m.run('The capital of France is'); b = rss()\n"
            "print(*a, *b)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    rss_load, peak_load, rss_run, peak_run = map(int, out)
    return {"rss_after_load_mib": rss_load, "peak_after_load_mib": peak_load, "rss_after_traced_run_mib": rss_run,
            "peak_after_traced_run_mib": peak_run}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats and tokens (a smoke run)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--json", default=str(ROOT / "_build" / "bench" / "bench.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    repeat, new_tokens = (3, 20) if args.quick else (7, 50)

    model = load_model(os.environ.get("LLMTRACE_MODEL", "embedded"))
    c = model.config
    hfs = {attn: hf_model(model, attn) for attn in ("eager", "sdpa")}
    started = time.perf_counter()
    r = {"model": c.name, "threads": torch.get_num_threads(), "torch": torch.__version__,
         "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count()}
    r["bandwidth_gb_s"] = memory_bandwidth() / 1e9
    r["forward"] = bench_forward(model, hfs["eager"], [6, 256], repeat)
    r["decode"] = bench_decode(model, hfs, new_tokens, repeat)
    r["prefill"] = bench_prefill(model, hfs, 256, repeat)
    context = 6 + new_tokens // 2  # the average cache length over the decode run
    need = decode_bytes(c, context)
    r["decode_bound"] = {"bytes_per_step": need["total"], "weights_bytes": need["weights"],
                         "kv_bytes": need["kv_cache"], "context": context,
                         "bound_tok_s": r["bandwidth_gb_s"] * 1e9 / need["total"]}
    r["decode_bound"]["fraction"] = r["decode"]["ours_tok_s"] / r["decode_bound"]["bound_tok_s"]
    r["decode_bound"]["blas_ceiling_tok_s"] = blas_decode_ceiling(model, repeat)
    r["decode_bound"]["fraction_of_blas"] = r["decode"]["ours_tok_s"] / r["decode_bound"]["blas_ceiling_tok_s"]
    r["kv_cache"] = bench_cache(model, 100 if not args.quick else 30)
    r["meta"] = bench_meta()
    r["memory"] = memory_of_traced_run()
    r["seconds"] = time.perf_counter() - started

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(r, indent=2))
    print(report(r))
    print(f"\nwritten to {args.json}")


def report(r) -> str:
    f6, f256, d, pf, b, kv, m = (r["forward"][6], r["forward"][256], r["decode"], r["prefill"], r["decode_bound"],
                                 r["kv_cache"], r["meta"])
    ok = lambda good: "ok" if good else "MISSED"  # noqa: E731
    lines = [
        f"llmtrace benchmark: {r['model']}, {r['threads']} threads, torch {r['torch']}, {r['cpus']} CPUs",
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
            f"      trace size: {f['trace_bytes'] / 2**20:8.1f} MiB in {f['trace_records']} records "
            f"(TransformerLens's cache at 256 tokens: about 520 MiB)",
        ]
    lines += [
        "",
        f"2. greedy decode, {d['new_tokens']} new tokens (tokens/s)",
        f"   llmtrace, untraced {d['ours_tok_s']:7.1f}; traced (every value) {d['ours_traced_tok_s']:7.1f}",
        f"   HF generate eager  {d['hf_eager_tok_s']:7.1f}  ratio {d['ours_vs_hf_eager']:5.2f}    >= 1.0   {ok(d['ours_vs_hf_eager'] >= 1.0)}",
        f"   HF generate sdpa   {d['hf_sdpa_tok_s']:7.1f}  ratio {d['ours_vs_hf_sdpa']:5.2f}    >= 1.0   {ok(d['ours_vs_hf_sdpa'] >= 1.0)}",
        f"   prefill of {pf['tokens']} tokens: llmtrace {pf['ours_tok_s']:7.0f} tok/s; HF eager {pf['hf_eager_tok_s']:7.0f}; "
        f"HF sdpa {pf['hf_sdpa_tok_s']:7.0f}",
        "",
        "3. against the memory-bandwidth limit",
        f"   measured bandwidth (1 GiB streaming read)  {r['bandwidth_gb_s']:6.1f} GB/s",
        f"   bytes per decode step: weights {b['weights_bytes'] / 1e6:6.1f} MB + KV cache {b['kv_bytes'] / 1e6:5.2f} MB "
        f"(context {b['context']})",
        f"   bound {b['bound_tok_s']:6.1f} tok/s; reached {d['ours_tok_s']:6.1f} = {b['fraction']:.0%}      >= 50%   {ok(b['fraction'] >= 0.5)}",
        f"   the BLAS alone (F.linear, one token, every weight matrix in turn): {b['blas_ceiling_tok_s']:.1f} tok/s; "
        f"decode reaches {b['fraction_of_blas']:.0%} of it",
        "",
        f"4. KV cache, {kv['new_tokens']} new tokens: positions {kv['positions_with_cache']} with vs "
        f"{kv['positions_without_cache']} without ({kv['positions_ratio']:.1f}x); time {kv['seconds_with_cache']:.2f} s vs "
        f"{kv['seconds_without_cache']:.2f} s ({kv['time_ratio']:.1f}x)",
        "",
        "5. shape-only tracing on the meta device (prefill + 1 decode step)",
    ]
    for name, t in m.items():
        lines.append(f"   {name:15} first call {t['first_s']:5.2f} s, then {t['warm_s']:5.2f} s")
    lines += [
        "",
        f"6. memory (a fresh process): resident {r['memory']['rss_after_load_mib']} MiB after loading the model "
        f"(peak {r['memory']['peak_after_load_mib']}), {r['memory']['rss_after_traced_run_mib']} MiB after a fully "
        f"traced run of the prompt (peak {r['memory']['peak_after_traced_run_mib']})",
        f"   the trace itself: {f6['trace_bytes'] / 2**20:.1f} MiB with every value at 6 tokens, "
        f"{f256['trace_bytes'] / 2**20:.0f} MiB at 256 tokens, 0 bytes with shapes only",
        f"\n(benchmark took {r['seconds']:.0f} s)",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
