"""The benchmark's bookkeeping on fixed, tiny inputs (its timings are not asserted: they belong to
the machine), the trace's memory accounting, and glibc keeping the memory a traced pass frees."""

import platform
import subprocess
import sys

import pytest
import torch

from bench import bench

CYCLES = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from llmtrace_book.memory import keep_freed_memory
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
    kept = [r.tensor for r in trace if r.kept and not r.recomputed]
    naive = sum(t.numel() * t.element_size() for t in kept)
    # q is a view of q_proj, and the one causal mask is recorded in every layer
    assert trace["layers.0.attn.q"].untyped_storage().data_ptr() == trace["layers.0.attn.q_proj"].data_ptr()
    assert trace["layers.7.attn.causal_mask"].data_ptr() == trace["layers.0.attn.causal_mask"].data_ptr()
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    assert trace.nbytes() == sum(unique.values()) < naive


def test_ratios_are_taken_per_round():
    """Round 2 ran while the machine was twice as slow: per-round ratios cancel that out."""
    t = bench.Timings({"a": [1.0, 2.0, 1.1], "b": [2.0, 4.0, 2.0]},
                      {"a": [0, 10, 0], "b": [0, 0, 0]})
    assert t.seconds("a") == 1.1 and t.page_faults("a") == 0
    assert t.ratio("a", "b") == 0.5  # the median of 0.5, 0.5, 0.55


def test_timings_of_interleaved_variants():
    calls = []
    t = bench.interleaved({"x": lambda: calls.append("x"), "y": lambda: calls.append("y")}, 3)
    assert calls == ["x", "y", "x", "y", "y", "x", "x", "y"]  # a warm-up, then a rotating order
    assert len(t.times["x"]) == len(t.faults["y"]) == 3


def test_kv_cache_counts(tiny):
    kv = bench.bench_cache(tiny, 10)
    T = kv["prompt_tokens"]
    assert T == 6  # BOS + 5 pieces with TinyLlama's tokenizer
    assert kv["positions_with_cache"] == T + 9  # the last new token is never fed back
    assert kv["positions_without_cache"] == sum(range(T, T + 10))


def test_figures_keep_their_provenance(tmp_path):
    p = bench.provenance()
    assert len(p["commit"]) == 40 and isinstance(p["dirty"], bool) and p["cpus"] >= 1
    assert p["torch"] == torch.__version__ and p["cpu"]
    assert bench.git_commit(tmp_path) == (None, False)  # not a checkout
    r = {**p, "forward": {6: {"off_s": 0.1}, 256: {"off_s": 2.0}}}
    bench.save(r, tmp_path / "bench.json")
    assert bench.load(tmp_path / "bench.json") == r  # the forward figures keep their integer keys


def test_bench_rejects_zero_threads(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--threads", "0", "--json", "/nonexistent/bench.json"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == "error: threads must be at least 1, got 0"


def test_peers_table_says_which_peer_was_skipped():
    from bench import peers
    a = torch.zeros(4, 8)
    assert peers.held([a, a[1], a.view(32), torch.zeros(3)]) == 4 * 8 * 4 + 3 * 4  # each storage once
    assert len(peers.tensors_in({"x": (a, [a, 1]), "y": None})) == 2
    row = {"tool": "llmtrace, every value", "held_mib": 495.4, "tensors": 905, "vs_hf": 0.961,
           "spread": [0.9, 0.961, 1.05], "page_faults": 24584.5, "max_logit_diff": 0.0}
    r = {"tokens": 256, "threads": 2, "rows": [row, {"tool": "nnsight", "missing": True}]}
    lines = peers.table(r).splitlines()
    assert lines[2] == "| llmtrace, every value | 0.961x (0.900-1.050) | 495.4 MiB | 905 | 24,584 | 0 |"
    assert lines[3] == "| nnsight | not installed: skipped | | | | |"
def test_the_671b_trace_is_reported_against_its_target():
    from bench.bench import META_671B_TARGET_S, report_meta

    m = {"deepseek-v3": {"first_s": 3.0, "warm_s": 2.5}}
    assert "0.30x   target < 1x   ok" in report_meta(m)
    m["deepseek-v3"]["first_s"] = META_671B_TARGET_S + 1
    assert report_meta(m).endswith("MISSED")
