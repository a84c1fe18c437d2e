"""The disk cache: one validity rule (`usable`) for what a conversion leaves, and every fault it
must survive: a killed or half-written conversion, content changed at the same size, a stale
temporary, two converters at once, a cache that is a file, read-only or full."""

import errno
import json
import os
import shutil
import subprocess
import threading
import time

import pytest
import torch

import llmtrace_book.load as loader
from helpers import PROMPT, one_line
from llmtrace_book import Config, LlmTraceError
from llmtrace_book.disk_cache import MANIFEST, cache_dir, usable


# --- the cache ------------------------------------------------------------------------------
@pytest.fixture
def cache(tmp_path, monkeypatch, embedded):
    """An empty cache, and a conversion that takes no ten seconds: a 1-layer model with the
    embedded vocabulary stands in for the GGUF. `calls` counts conversions."""
    from llmtrace_book.weights.names import expected_shapes

    monkeypatch.setenv("LLMTRACE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_embedded", None)
    config = Config("smollm2-135m", 49152, 64, 1, 4, 2, 128, 256, tied_lm_head=True)
    sd = {k: torch.randn(s) for k, s in expected_shapes(config).items()}
    calls = []

    def fake_load_gguf(path=None, name=None):
        calls.append(time.perf_counter())
        time.sleep(0.2)  # long enough for two threads to meet
        return config, sd, embedded.tokenizer
    monkeypatch.setattr("llmtrace_book.weights.gguf.load_gguf", fake_load_gguf)
    return calls


def test_cache_builds_with_a_manifest_and_readable_files(cache):
    d = loader.embedded_checkpoint()
    assert len(cache) == 1 and usable(d) is None
    assert sorted(json.loads((d / MANIFEST).read_text())["digests"]) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert {oct(f.stat().st_mode & 0o777) for f in d.iterdir()} == {"0o644"}
    assert loader.embedded_checkpoint() == d and len(cache) == 1  # valid: not built again


@pytest.mark.parametrize("damage", ["truncate", "delete config", "delete manifest", "bad manifest",
                                    "rewrite at the same size", "old manifest"])
def test_cache_fault_is_repaired_by_the_next_run(cache, damage):
    d = loader.embedded_checkpoint()
    tok = d / "tokenizer.json"
    if damage == "truncate":
        with open(d / "model.safetensors", "r+b") as f:
            f.truncate(1000)
    elif damage == "delete config":
        (d / "config.json").unlink()
    elif damage == "delete manifest":  # a conversion killed before its last file
        (d / MANIFEST).unlink()
    elif damage == "bad manifest":
        (d / MANIFEST).write_text("{")
    elif damage == "rewrite at the same size":
        tok.write_bytes(b"x" * tok.stat().st_size)  # sizes cannot see this; fingerprints do
    else:  # sizes only, as manifests were before fingerprints
        files = json.loads((d / MANIFEST).read_text())["files"]
        (d / MANIFEST).write_text(json.dumps({"files": files}))
    assert usable(d) is not None
    model = loader._load_embedded()
    assert len(cache) == 2 and usable(d) is None
    assert model.config.n_layers == 1
    assert model.tokenizer.encode(PROMPT) == [504, 3575, 282, 4649, 314]


def test_stale_temporaries_are_collected(cache):
    dead = subprocess.Popen(["true"])
    dead.wait()
    root = cache_dir()
    name = loader.embedded_checkpoint().name
    stale = root / f".{name}.{dead.pid}.abc123"
    alive = root / f".{name}.{os.getppid()}.def456"  # a conversion still running elsewhere
    for d in (stale, alive):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 1000)
    loader.embedded_checkpoint()
    assert not stale.exists() and alive.exists()


def test_two_threads_convert_and_load_once(cache):
    got = []
    def load():
        got.append(loader._load_embedded())
    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cache) == 1 and got[0] is got[1]


def test_cache_that_is_a_file(cache, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("LLMTRACE_CACHE", str(tmp_path / "afile"))
    with pytest.raises(LlmTraceError) as err:
        loader.embedded_checkpoint()
    assert "is a file, not a directory: move it away, or set LLMTRACE_CACHE" in one_line(err)
    assert cache == []


def test_read_only_cache_fails_before_the_parse(cache, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")
    monkeypatch.setattr("llmtrace_book.disk_cache.tempfile.mkstemp", refuse)
    with pytest.raises(LlmTraceError) as err:
        loader.embedded_checkpoint()
    assert "cannot write in the cache" in one_line(err) and "Permission denied" in str(err.value)
    assert cache == []  # refused before the slow parse


def test_full_cache_fails_before_the_parse(cache, monkeypatch):
    def one_mib_free(d):
        return shutil._ntuple_diskusage(2**40, 2**40 - 2**20, 2**20)
    monkeypatch.setattr("llmtrace_book.disk_cache.shutil.disk_usage", one_mib_free)
    with pytest.raises(LlmTraceError) as err:
        loader.embedded_checkpoint()
    assert "has 1 MiB free, 529 MiB are needed: free some space" in one_line(err)
    assert cache == []


def test_disk_full_while_writing_leaves_nothing(cache, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr("llmtrace_book.weights.hf.save_hf", full)
    with pytest.raises(LlmTraceError) as err:
        loader.embedded_checkpoint()
    assert "is full: free some space, or set LLMTRACE_CACHE to another disk" in one_line(err)
    assert [p.name for p in cache_dir().iterdir() if not p.name.startswith(".lock")] == []


def test_truncated_tokenizer_model_is_rebuilt(tmp_path, monkeypatch):
    from llmtrace_book.weights.tokenizer_llama import LLAMA2_BYTES, build, vocab_dir

    source, built = vocab_dir(), build(fetch=False)
    monkeypatch.setenv("LLMTRACE_CACHE", str(tmp_path))
    shutil.copytree(source, vocab_dir())
    target = tmp_path / "tinyllama" / "tokenizer.model"
    target.parent.mkdir()
    target.write_bytes(built.read_bytes()[:1000])  # cut short
    assert build(fetch=False).stat().st_size == LLAMA2_BYTES
    assert oct(target.stat().st_mode & 0o777) == "0o644"


def test_damaged_vocabulary_is_removed_and_named(tmp_path, monkeypatch):
    from llmtrace_book.weights.tokenizer_llama import VOCAB, build, vocab_dir

    monkeypatch.setenv("LLMTRACE_CACHE", str(tmp_path))
    vocab_dir().mkdir()
    (vocab_dir() / VOCAB).write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 100)
    with pytest.raises(LlmTraceError) as err:
        build(fetch=False)
    assert "was damaged (" in one_line(err) and "is now removed: run `" in str(err.value)
    assert not vocab_dir().exists()


def test_messages_name_a_command_that_exists_here(tmp_path, monkeypatch):
    from llmtrace_book.weights.tokenizer_llama import build

    monkeypatch.setenv("LLMTRACE_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # outside the checkout: there is no `make setup` here
    with pytest.raises(LlmTraceError) as err:
        build(fetch=False)
    assert "-m llmtrace_book.weights.tokenizer_llama`" in one_line(err) and "make" not in str(err.value)
