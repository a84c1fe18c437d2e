"""The benchmark's bookkeeping (its timings are not asserted: they belong to the machine), the
trace's memory accounting, and glibc keeping the memory a traced pass frees."""

import platform
import subprocess
import sys

import pytest

from llmtrace import bench
from llmtrace.cost import decode_bytes

CYCLES = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from llmtrace.memory import keep_freed_memory
    assert keep_freed_memory()
def cycle():  # hold 100 tensors of 2.25 MiB (the size of one layer's attention scores at 256 tokens), free them
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    held = [torch.ones(9 * 256 * 256) for _ in range(100)]
    del held
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(*[cycle() for _ in range(3)])
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_freed_memory_is_reused_not_faulted_in_again():
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", CYCLES, mode], capture_output=True, text=True, check=True)
        return list(map(int, out.stdout.split()))

    default, keep = faults("default"), faults("keep")
    pages = 100 * 9 * 256 * 256 * 4 // 4096  # 57,600 pages of 4 KiB
    assert default[0] > 0.9 * pages and keep[0] > 0.9 * pages  # the first cycle must fault every page in
    assert default[1] > 0.5 * pages  # glibc's default hands the memory back: the next cycle faults it in again
    assert max(keep[1:]) < 0.05 * pages  # kept: the next cycles reuse it


def test_trace_bytes_count_shared_memory_once(prompt_trace):
    _, trace = prompt_trace
    kept = [r.tensor for r in trace if r.tensor is not None]
    naive = sum(t.numel() * t.element_size() for t in kept)
    # q is a view of q_proj, and the one causal mask is recorded in every layer
    assert trace["layers.0.attn.q"].untyped_storage().data_ptr() == trace["layers.0.attn.q_proj"].data_ptr()
    assert trace["layers.7.attn.causal_mask"].data_ptr() == trace["layers.0.attn.causal_mask"].data_ptr()
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    assert trace.nbytes() == sum(unique.values()) < naive


def test_bench_figures_and_report(embedded, tmp_path):
    r = bench.latest(embedded)  # make book's quick run (kept in the cache), or a quick run now
    assert r["model"] == embedded.config.name
    kv = r["kv_cache"]
    n = kv["new_tokens"]
    assert kv["positions_with_cache"] == 6 + n - 1  # counted: the prompt once, then one position per step
    assert kv["positions_without_cache"] == sum(range(6, 6 + n))  # the whole sequence, every step
    need = decode_bytes(embedded.config, r["decode_bound"]["context"])
    assert r["decode_bound"]["bytes_per_step"] == need["total"]
    assert r["forward"][6]["trace_records"] == r["forward"][256]["trace_records"] == len(embedded.run("Paris")[1])
    text = bench.report(r)
    for line in ["shapes only / off", "<= 1.05x", "every value / HF plain forward", "<= 1.2x", "<= 1.1x",
                 "HF generate eager", "HF generate sdpa", ">= 1.0", "measured bandwidth", ">= 50%",
                 "KV cache", "tinyllama-1.1b", "llama-2-70b", "resident", "TransformerLens"]:
        assert line in text
    bench.save(r, tmp_path / "bench.json")
    assert bench.load(tmp_path / "bench.json") == r  # the forward figures keep their integer keys


def test_bench_cli_rejects_zero_threads():
    out = subprocess.run([sys.executable, "-m", "llmtrace.bench", "--threads", "0"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip() == "error: threads must be at least 1, got 0"
