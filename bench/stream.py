"""How fast, and in how much memory, llmtrace runs a model streamed from disk, beside HF's offload.

    python -m bench.stream [--config llama-3.2-3b] [--tokens 6] [--rounds 3] [--json PATH]

A checkpoint of the config's shapes (Llama-3.2-3B's by default, 6.4 GB) with random bf16 weights
is written once into the cache by the library's own writer. Each side then runs in a process of
its own, on every core, over the same seeded random prompt of --tokens ids. HF transformers loads
it with accelerate's disk offload: `device_map="auto"` under a CPU memory limit that leaves most
layers on "disk", which accelerate reads from the safetensors at every forward pass. llmtrace
loads it with `load_model(d, dtype="bfloat16", stream=True)` and runs `model.run(ids,
names=["lm_head"])`. Each process reports its load time, its first forward pass, the median of
--rounds passes after it, its peak resident memory (VmHWM) and the last position's logits, whose
argmax both sides should agree on. The checkpoint's files are dropped from the page cache before
each side starts, so both load as a first run does; where the RAM holds the checkpoint, the
passes after the first read it from the page cache, not the device. The figures are kept in the
cache's stream.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from llmtrace_book import LlmTraceError
from llmtrace_book.config import Config
from llmtrace_book.disk_cache import atomic_path, cache_dir, usable, write_manifest
from llmtrace_book.weights.hf import save_hf
from llmtrace_book.weights.names import expected_shapes

from .bench import ROOT, provenance, save

# meta-llama/Llama-3.2-3B's config.json where it differs from Llama-3.2-1B's (the same vocabulary,
# tied head, RoPE base and llama3 scaling), for as long as the library has no preset of it
LLAMA_3_2_3B = dict(hidden_size=3072, n_layers=28, n_heads=24, n_kv_heads=8, head_dim=128,
                    ffn_size=8192)
SHARD_BYTES = 2 * 10**9
SEED = 0
CPU_LAYERS = 2  # decoder layers HF may keep in memory; the rest go to "disk"
GOAL_TIME = 1.5  # llmtrace's forward pass within this many times HF's offloaded one
GOAL_MEMORY = 1.0  # and no more peak memory than HF's

CHILD = r"""
import json, os, re, resource, statistics, sys, time
import torch
torch.set_num_threads(os.cpu_count())
side, d, ids, rounds, out = sys.argv[1:6]
ids, rounds = torch.tensor([json.loads(ids)]), int(rounds)
figures = {}
def resident():
    # in MiB: the peak (VmHWM), now (VmRSS), and of that the mapped file pages (safetensors'
    # mmap). The peak is read here, not from getrusage's ru_maxrss, which a child inherits from
    # its parent across exec: it would be at least the parent's own peak (the checkpoint's writer)
    try:
        status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    except OSError:
        return {}
    return {k: int(status[k].split()[0]) / 1024 for k in ("VmHWM", "VmRSS", "RssFile")
            if k in status}
if side == "hf":
    from transformers import AutoModelForCausalLM
    offload, cpu_bytes = sys.argv[6], int(sys.argv[7])
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(d, device_map="auto", dtype=torch.bfloat16,
                                                 max_memory={"cpu": cpu_bytes},
                                                 offload_folder=offload)
    load = time.perf_counter() - t
    model.eval()
    where = model.hf_device_map
    layers = [str(v) for k, v in where.items() if re.fullmatch(r"model\.layers\.\d+", k)]
    figures["layers_on"] = {dev: layers.count(dev) for dev in sorted(set(layers))}
    figures["others_on"] = {k: str(v) for k, v in where.items()
                            if not re.fullmatch(r"model\.layers\.\d+", k)}
    # the offloaded weights are not in memory (on the meta device) until a pass reads them
    figures["meta_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters()
                                if p.device.type == "meta")
    figures["offload_folder_bytes"] = sum(f.stat().st_size for f in os.scandir(offload))
    def forward():
        with torch.inference_mode():
            return model(ids, use_cache=False).logits
else:
    from llmtrace_book import load_model
    t = time.perf_counter()
    model = load_model(d, dtype="bfloat16", stream=True)
    load = time.perf_counter() - t
    def forward():
        return model.run(ids, names=["lm_head"])[0]
figures["resident_after_load_mib"] = resident()
t = time.perf_counter()
forward()  # the warm-up: the first pass, which reads from the device what the load left there
first = time.perf_counter() - t
times = []
for _ in range(rounds):
    t = time.perf_counter()
    logits = forward()
    times.append(time.perf_counter() - t)
last = logits[0, -1].float()
torch.save(last, out)
top = last.topk(2).values
print(json.dumps({**figures, "load_s": load, "first_s": first,
                  "forward_s": statistics.median(times),
                  "forward_rounds_s": times, "argmax": int(last.argmax()),
                  "top2_gap": float(top[0] - top[1]), "threads": torch.get_num_threads(),
                  "resident_after_passes_mib": resident(),
                  "rss_mib": resident().get("VmHWM", resource.getrusage(
                      resource.RUSAGE_SELF).ru_maxrss / 1024)}))
"""


def bench_config(name: str) -> Config:
    try:
        return Config.from_name(name)
    except LlmTraceError:
        if name.lower() != "llama-3.2-3b":
            raise
    return Config.from_name("llama-3.2-1b").replace(name="llama-3.2-3b", **LLAMA_3_2_3B)


def checkpoint_bytes(c: Config) -> int:
    return sum(math.prod(shape) for shape in expected_shapes(c).values()) * 2  # bf16


def checkpoint(c: Config) -> Path:
    """The config's random bf16 checkpoint in the cache, written the first time: every tensor
    drawn from one seeded generator in bf16, so no fp32 copy of the model is ever held. Its
    manifest, written last, says it is whole; a run killed half-way leaves only a temporary."""
    d = cache_dir() / f"bench-stream-{c.name}-bf16"
    if usable(d) is None:
        return d
    need, free = checkpoint_bytes(c) + 2**30, shutil.disk_usage(cache_dir()).free
    if free < need:
        raise SystemExit(f"error: the cache {cache_dir()} has {free / 2**30:.1f} GiB free, the "
                         f"checkpoint needs {need / 2**30:.1f}: free some space, or set "
                         f"LLMTRACE_CACHE to another disk")
    print(f"writing {c.name}'s random bf16 checkpoint ({checkpoint_bytes(c) / 1e9:.2f} GB) "
          f"into {d} (once)", flush=True)
    g = torch.Generator().manual_seed(SEED)
    sd = {}
    for name, shape in expected_shapes(c).items():
        t = torch.empty(shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight"):  # norms that change nothing (0 where 1 is added)
            t.fill_(0.0 if c.norm_offset else 1.0)
        else:
            t.normal_(0.0, 0.02, generator=g)
        sd[name] = t
    with atomic_path(d, directory=True) as tmp:
        save_hf(tmp, c, sd, max_shard_bytes=SHARD_BYTES)
        del sd
        write_manifest(tmp)
    return d


def evict(d: Path) -> None:
    """Drop the checkpoint's files from the page cache (their clean pages: no privilege needed),
    so that the side which runs second does not load from memory what the first read from disk."""
    if not hasattr(os, "posix_fadvise"):
        return
    for f in d.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # written pages are dirty until on disk, and dirty pages stay
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cpu_limit(c: Config) -> int:
    """HF's CPU memory limit: room for the embedding (tied with the LM head) and at least
    CPU_LAYERS layers. Accelerate keeps the largest module still to place free beside what it
    places: the embedding's own size while it places the embedding, then one layer's."""
    shapes = expected_shapes(c)
    embed = math.prod(shapes["model.embed_tokens.weight"]) * 2
    layer = sum(math.prod(s) for k, s in shapes.items() if k.startswith("model.layers.0.")) * 2
    return max(2 * embed, embed + (CPU_LAYERS + 1) * layer) + 2**20


class SideFailed(Exception):
    pass


def run_side(side: str, d: Path, ids: list[int], rounds: int, out: Path, *extra) -> dict:
    evict(d)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "lib") + os.pathsep
           + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", CHILD, side, str(d), json.dumps(ids), str(rounds),
                        str(out), *map(str, extra)], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        why = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
        raise SideFailed(f"the {side} side's process failed: {why}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run(c: Config, tokens: int, rounds: int) -> dict:
    d = checkpoint(c)
    ids = torch.randint(0, c.vocab_size, (tokens,),
                        generator=torch.Generator().manual_seed(SEED)).tolist()
    offload = cache_dir() / f"bench-stream-offload-{c.name}"
    r = {"config": c.name, "tokens": tokens, "rounds": rounds, "ids": ids, "checkpoint": str(d),
         "checkpoint_bytes": checkpoint_bytes(c), "cpu_limit_bytes": cpu_limit(c),
         "llmtrace": None, **provenance()}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.rmtree(offload, ignore_errors=True)
        offload.mkdir()
        try:
            r["hf"] = run_side("hf", d, ids, rounds, Path(tmp) / "hf.pt", offload, cpu_limit(c))
        finally:
            shutil.rmtree(offload, ignore_errors=True)  # whatever accelerate copied there
        try:  # HF's figures are still worth reporting if llmtrace's side breaks
            r["llmtrace"] = run_side("llmtrace", d, ids, rounds, Path(tmp) / "llmtrace.pt")
        except SideFailed as e:
            r["llmtrace_failed"] = str(e)
        else:
            hf, ours = (torch.load(Path(tmp) / f"{s}.pt") for s in ("hf", "llmtrace"))
            r["logits_max_diff"] = float((hf - ours).abs().max())
    if r["llmtrace"] is not None:
        hf, ours = r["hf"], r["llmtrace"]
        r["load_ratio"] = ours["load_s"] / hf["load_s"]
        r["time_ratio"] = ours["forward_s"] / hf["forward_s"]
        r["memory_ratio"] = ours["rss_mib"] / hf["rss_mib"]
        r["argmax_agree"] = ours["argmax"] == hf["argmax"]
    return r


def report(r: dict) -> str:
    hf = r["hf"]
    placed = ", ".join(f"{n} on {dev!r}" for dev, n in hf["layers_on"].items())
    others = ", ".join(f"{k} on {v!r}" for k, v in hf["others_on"].items())
    lines = [f"{r['config']}: random bf16 weights, {r['checkpoint_bytes'] / 1e9:.2f} GB; a "
             f"{r['tokens']}-token prompt, median of {r['rounds']} passes, {hf['threads']} threads",
             f"HF's offload under a CPU limit of {r['cpu_limit_bytes'] / 2**20:,.0f} MiB: layers "
             f"{placed}; {others}; {hf['meta_bytes'] / 1e9:.2f} GB of weights left on disk",
             f"{'':<28}{'load s':>10}{'first pass s':>14}{'forward s':>12}{'peak MiB':>11}"]

    def row(label, f):
        lines.append(f"{label:<28}{f['load_s']:>10.2f}{f['first_s']:>14.2f}"
                     f"{f['forward_s']:>12.2f}{f['rss_mib']:>11,.0f}")

    row("HF + accelerate disk offload", hf)
    if r["llmtrace"] is None:
        lines.append(f"llmtrace's streamed side did not run to the end ({r['llmtrace_failed']}): "
                     f"HF's figures only")
        return "\n".join(lines)
    ours = r["llmtrace"]
    row("llmtrace streamed", ours)

    def mark(ok):
        return "ok" if ok else "MISSED"

    lines.append(f"llmtrace / HF: load {r['load_ratio']:.2f}x; forward {r['time_ratio']:.2f}x "
                 f"(goal <= {GOAL_TIME:g}x) {mark(r['time_ratio'] <= GOAL_TIME)}; "
                 f"peak memory {r['memory_ratio']:.2f}x (goal <= {GOAL_MEMORY:g}x) "
                 f"{mark(r['memory_ratio'] <= GOAL_MEMORY)}")
    if r["argmax_agree"]:
        lines.append(f"the last position's argmax: {hf['argmax']} on both "
                     f"(logits differ by at most {r['logits_max_diff']:.3g})")
    else:
        lines.append(f"the last position's argmax DIFFERS: HF {hf['argmax']} (top-2 gap "
                     f"{hf['top2_gap']:.3g}), llmtrace {ours['argmax']} (gap "
                     f"{ours['top2_gap']:.3g}); logits differ by up to "
                     f"{r['logits_max_diff']:.3g}")
    return "\n".join(lines)


def default_path() -> Path:
    """Where the figures are kept: stream.json in the cache, beside bench.json."""
    return cache_dir() / "stream.json"


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.stream", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="llama-3.2-3b",
                   help="the shapes of the checkpoint: llama-3.2-3b (default) or a preset's name")
    p.add_argument("--tokens", type=int, default=6, help="the random prompt's length (default 6)")
    p.add_argument("--rounds", type=int, default=3,
                   help="forward passes timed after the warm-up (default 3)")
    p.add_argument("--json", default=None,
                   help="where to write the figures (default: stream.json in the cache)")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.rounds < 1:
        p.error("--tokens and --rounds must be at least 1")
    started, path = time.time(), Path(args.json or default_path())
    try:
        r = run(bench_config(args.config), args.tokens, args.rounds)
    except (LlmTraceError, SideFailed) as e:
        sys.exit(f"error: {e}")
    save(r, path)  # bench.bench's: written whole, or not at all
    print(f"{report(r)}\n(took {time.time() - started:.0f} s; the figures are in {path})")
    sys.exit(1 if "llmtrace_failed" in r else 0)


if __name__ == "__main__":
    main()
