"""Finding TinyLlama's weights: a directory, the local HF cache, or a clear one-line refusal."""

import socket

import pytest
import torch

from llmtrace_book import LlmTraceError, load_model
from llmtrace_book.load import embedded_checkpoint
from llmtrace_book.weights.hub import download, find_tinyllama
from helpers import PROMPT


@pytest.fixture
def no_tinyllama(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("LLMTRACE_TINYLLAMA", raising=False)
    monkeypatch.delenv("LLMTRACE_MODEL", raising=False)
    return tmp_path / "hf"


@pytest.fixture
def cached_tinyllama(no_tinyllama):
    """An HF cache laid out as huggingface_hub writes it, holding a checkpoint in TinyLlama's
    format (the embedded weights stand in: TinyLlama's cannot be downloaded here)."""
    snap = no_tinyllama / "hub" / "models--TinyLlama--TinyLlama-1.1B-Chat-v1.0" / "snapshots" / "fe8a4ea1"
    snap.mkdir(parents=True)
    for f in embedded_checkpoint().iterdir():
        (snap / f.name).symlink_to(f)
    return snap


def test_found_in_the_hf_cache(cached_tinyllama, embedded):
    assert find_tinyllama() == cached_tinyllama
    # the stand-in is not TinyLlama: under that label it is refused, by its path it loads
    for choice in ("tinyllama", "auto"):
        with pytest.raises(LlmTraceError, match="is not TinyLlama-1.1B: vocab_size=49152"):
            load_model(choice)
    model = load_model(cached_tinyllama)
    assert model.source == str(cached_tinyllama)
    ids = embedded.encode(PROMPT)
    assert torch.equal(model.run(ids, keep_values=False)[0], embedded.run(ids, keep_values=False)[0])


def test_found_by_path(no_tinyllama, monkeypatch, embedded):
    monkeypatch.setenv("LLMTRACE_TINYLLAMA", str(embedded_checkpoint()))
    assert find_tinyllama() == embedded_checkpoint()


def test_absent_says_so_without_the_network(no_tinyllama, monkeypatch):
    calls = []

    def no_network(*args, **kwargs):
        calls.append(args)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    with pytest.raises(LlmTraceError, match=r"TinyLlama's weights are not on this machine .* run `make tinyllama`"):
        load_model("tinyllama")
    assert find_tinyllama(required=False) is None
    assert calls == []  # it looked on disk only


def test_auto_falls_back_to_the_embedded_model(no_tinyllama, monkeypatch, embedded):
    assert load_model("auto") is embedded
    monkeypatch.setenv("LLMTRACE_MODEL", "embedded")
    assert load_model() is embedded
    monkeypatch.setenv("LLMTRACE_MODEL", "tinyllama")
    with pytest.raises(LlmTraceError, match="make tinyllama"):
        load_model()


def test_download_without_a_hub_fails_in_one_line(no_tinyllama, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # a closed local port: no hub here
    with pytest.raises(LlmTraceError, match="could not download TinyLlama/") as err:
        download(timeout=5)
    assert "\n" not in str(err.value)
