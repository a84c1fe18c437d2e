"""The device option: the best device by default, a device this machine lacks refused by name,
the trace's values kept where the user asks. The CPU and the meta device run here; the CUDA
tests run where PyTorch sees a GPU and say why they were skipped where it does not."""

import pytest
import torch

from llmtrace_book import LlmTraceError, Trace, load_model, meta_model
from llmtrace_book.check import best_device, check_device

NO_GPU = ("no CUDA GPU here (torch.cuda.is_available() is False): the cuda path runs where "
          "there is one")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)


def test_the_default_is_the_best_device_there_is():
    want = "cuda" if torch.cuda.is_available() else (
        "mps" if torch.backends.mps.is_available() else "cpu")
    assert best_device() == want and check_device(None) == torch.device(want)


@pytest.mark.parametrize("device, line", [
    ("tpu", "device 'tpu' is not one llmtrace runs on: use cpu, cuda, cuda:N or mps"),
    ("meta", "the meta device has shapes only: use meta_model"),
    ("", "device '' is not one llmtrace runs on"),
    (3.5, "device 3.5 is not one llmtrace runs on"),
])
def test_a_device_llmtrace_does_not_run_on_is_refused_by_name(device, line):
    with pytest.raises(LlmTraceError, match=line.replace("(", r"\(").replace(")", r"\)")):
        check_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_cuda_where_there_is_none_is_one_line(tiny_dir):
    with pytest.raises(LlmTraceError, match="this machine has no CUDA GPU that PyTorch can use"):
        load_model(tiny_dir, device="cuda")


def test_on_the_cpu_the_weights_cache_and_trace_are_there(tiny_dir):
    model = load_model(tiny_dir, device="cpu")
    assert model.device == torch.device("cpu") and "on cpu" in model.runs
    logits, trace = model.run(torch.tensor([[1, 5, 9]]), keep_on="cpu")
    assert logits.device.type == "cpu" and trace["layers.0.attn.q_proj"].device.type == "cpu"
    assert model.new_cache(4)[0].k.device.type == "cpu"


def test_on_the_meta_device_shapes_and_no_values():
    model = meta_model("tinyllama-1.1b")
    assert model.device.type == "meta"
    trace = Trace(keep_on="cpu")  # nothing to keep: meta tensors have no values
    logits = model.forward(torch.zeros(1, 6, dtype=torch.long), trace)
    assert logits.shape == (1, 6, 32000) and logits.device.type == "meta"
    assert trace.records[-1].shape == (1, 6, 32000) and trace.nbytes() == 0


def test_a_trace_kept_on_a_device_that_is_not_there_is_refused():
    with pytest.raises(LlmTraceError, match="device 'tpu' is not one llmtrace runs on"):
        Trace(keep_on="tpu")


@cuda
def test_on_cuda_the_logits_are_the_cpus(tiny_dir):
    ids = torch.tensor([[1, 5, 9, 300]])
    on_cpu, _ = load_model(tiny_dir, device="cpu").run(ids)
    model = load_model(tiny_dir, device="cuda")
    logits, trace = model.run(ids)
    assert logits.device.type == "cuda" and trace["layers.0.attn.q_proj"].device.type == "cuda"
    assert (logits.cpu() - on_cpu).abs().max() < 1e-4


@cuda
def test_on_cuda_a_trace_can_keep_its_values_on_the_cpu(tiny_dir):
    model = load_model(tiny_dir, device="cuda")
    logits, trace = model.run(torch.tensor([[1, 5, 9]]), keep_on="cpu")
    assert logits.device.type == "cuda" and trace["layers.0.attn.q_proj"].device.type == "cpu"


@cuda
def test_on_cuda_streamed_layers_come_to_the_gpu(tiny_dir):
    ids = torch.tensor([[1, 5, 9, 300]])
    whole, _ = load_model(tiny_dir, device="cuda", stream=False).run(ids)
    streamed, _ = load_model(tiny_dir, device="cuda", stream=True).run(ids)
    assert torch.equal(whole, streamed)
