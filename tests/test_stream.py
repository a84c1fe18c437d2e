"""A checkpoint larger than the memory a process may use, traced with its layers streamed from
disk, in a subprocess under a limit the test sets: RLIMIT_DATA, which Linux counts against the
process's heap and its private mappings (the safetensors files that safetensors maps are among
them), so reading the whole checkpoint cannot fit under it. The checkpoint is sharded about a
layer to a file, since safetensors maps a whole file when it opens one. The streamed run's logits and greedy
tokens equal the unstreamed run's bit for bit, and its peak resident memory stays under the
limit. Asked to hold the whole model under the same limit, the load is refused in one line
that names streaming; with too little room even for that, in one line that says so; a trace
that would keep more than fits, in one line that names `names=`."""

import json
import math
import subprocess
import sys

import pytest
import torch

from llmtrace_book import Config, generate, load_model
from llmtrace_book.memory import RESERVE
from llmtrace_book.weights.hf import save_hf
from llmtrace_book.weights.names import expected_shapes

MB = 2**20
# 16 layers of 60 MB in fp32 beside 34 MB of tables: about 1 GB on disk
CONFIG = dict(vocab_size=4096, hidden_size=1024, n_layers=16, n_heads=8, n_kv_heads=2,
              head_dim=128, ffn_size=4096, max_positions=512, tied_lm_head=False)
ROOM = 480 * MB  # what the child may add to its data after its imports: past RESERVE, 224 MB
IDS = [[5, 17, 300, 2048, 7, 99, 1024, 3]]

CHILD = r"""
import json, re, resource, sys
import torch
torch.set_num_threads(1)
from llmtrace_book import LlmTraceError, generate, load_model
path, room, stream, ids, out, prompt_len = sys.argv[1:7]
vm_data = int(re.search(r"VmData:\s+(\d+) kB", open("/proc/self/status").read())[1]) * 1024
limit = vm_data + int(room)  # the limit, set on this process before anything is loaded
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
try:
    model = load_model(path, stream=json.loads(stream))
    ids = torch.tensor(json.loads(ids))
    logits, trace = model.run(ids, names=["lm_head", "layers.0.attn.weights"])
    g = generate(model, ids, 3, stop_at_eos=False, trace=False)
    if int(prompt_len):  # a long prompt whose every value the trace would keep
        model.run(torch.arange(int(prompt_len))[None] % 4096)
    torch.save({"logits": logits, "ids": g.ids, "weights": trace["layers.0.attn.weights"]}, out)
    # VmHWM, this process's own peak (a child's ru_maxrss starts at its parent's)
    peak = int(re.search(r"VmHWM:\s+(\d+) kB", open("/proc/self/status").read())[1]) * 1024
    print(json.dumps({"runs": model.runs, "peak": peak, "limit": limit}))
except LlmTraceError as e:
    print(json.dumps({"refused": str(e), "limit": limit}))
"""


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """(directory, bytes on disk) of a random Llama checkpoint of about 1 GB in fp32."""
    c = Config.from_name("tinyllama-1.1b").replace(name="big", **CONFIG)
    g = torch.Generator().manual_seed(0)
    sd = {name: (torch.ones(shape) if name.endswith("norm.weight") else
                 torch.randn(shape, generator=g) * 0.02)
          for name, shape in expected_shapes(c).items()}
    # shards of about a layer: RLIMIT_DATA counts a file's whole mapping, which safetensors
    # makes when it opens the file (resident memory counts only the pages read)
    d = save_hf(tmp_path_factory.mktemp("big") / "big", c, sd, max_shard_bytes=64 * MB)
    size = sum(4 * math.prod(t.shape) for t in sd.values())
    return d, size


def child(d, room: int, stream, out, prompt_len: int = 0) -> dict:
    run = subprocess.run([sys.executable, "-c", CHILD, str(d), str(room), json.dumps(stream),
                          json.dumps(IDS), str(out), str(prompt_len)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def whole(big):
    """The unstreamed run in this process, with no limit."""
    model = load_model(big[0], stream=False)
    ids = torch.tensor(IDS)
    logits, trace = model.run(ids, names=["lm_head", "layers.0.attn.weights"])
    g = generate(model, ids, 3, stop_at_eos=False, trace=False)
    return logits, g.ids, trace["layers.0.attn.weights"]


def test_a_checkpoint_larger_than_the_limit_traces_streamed(big, whole, tmp_path):
    d, size = big
    got = child(d, ROOM, None, tmp_path / "out.pt")  # asked nothing: it streams by itself
    assert "refused" not in got, got["refused"]
    assert size > got["limit"] > ROOM, (size, got)  # the checkpoint is larger than the limit
    assert "layers streamed from disk" in got["runs"]
    out = torch.load(tmp_path / "out.pt")
    assert torch.equal(out["logits"], whole[0])  # bit for bit
    assert out["ids"] == whole[1]  # decode with the cache, streamed
    assert torch.equal(out["weights"], whole[2])
    assert got["peak"] < got["limit"], (got["peak"] / MB, got["limit"] / MB)


def test_asked_to_hold_the_whole_it_refuses_and_names_streaming(big, tmp_path):
    got = child(big[0], ROOM, False, tmp_path / "out.pt")
    line = got["refused"]
    assert "will not fit in memory (whole)" in line and "\n" not in line
    assert "stream the layers from disk (stream=True, --stream)" in line
    assert "load it in bfloat16 (dtype='bfloat16', --dtype bfloat16)" not in line  # 0.5 GB > room
    assert not (tmp_path / "out.pt").exists()


def test_with_too_little_room_even_for_one_layer_it_says_so(big, tmp_path):
    got = child(big[0], RESERVE + 50 * MB, None, tmp_path / "out.pt")
    line = got["refused"]
    assert "will not fit in memory (whole or streamed)" in line, line
    assert "not even a layer at a time fits" in line or "bfloat16" in line


def test_a_trace_too_big_for_the_limit_is_refused_before_it_runs(big, tmp_path):
    got = child(big[0], ROOM, True, tmp_path / "out.pt", prompt_len=512)
    line = got["refused"]
    assert "a trace keeping these values of 512 positions" in line and "names=" in line, line
