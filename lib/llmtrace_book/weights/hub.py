"""TinyLlama's weights: found locally, or fetched once by an explicit command when online."""

from __future__ import annotations

import os
from pathlib import Path

from ..disk_cache import command
from ..errors import LlmTraceError, first_line

REPOS = ("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",
         "TinyLlama/TinyLlama-1.1B-Chat-v1.0")


def fetch_command() -> str:
    """`make tinyllama` in the checkout, the Python command elsewhere."""
    return command("tinyllama", "llmtrace_book.weights.hub")


def _hf_cache_dirs() -> list[Path]:
    """Snapshot directories of TinyLlama in the local Hugging Face cache, newest first."""
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    hub = Path(os.environ.get("HF_HUB_CACHE", home / "hub"))
    found = []
    for repo in REPOS:
        snapshots = hub / f"models--{repo.replace('/', '--')}" / "snapshots"
        if snapshots.is_dir():
            found += sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    return found


def _complete(d: Path) -> bool:
    return (d / "config.json").is_file() and any(
        (d / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json"))


def find_tinyllama(required: bool = True) -> Path | None:
    """$LLMTRACE_TINYLLAMA (a directory), else the HF cache. Never touches the network."""
    explicit = os.environ.get("LLMTRACE_TINYLLAMA")
    candidates = ([Path(explicit).expanduser()] if explicit else []) + _hf_cache_dirs()
    for d in candidates:
        if _complete(d):
            return d
    if required:
        where = f"{explicit} (LLMTRACE_TINYLLAMA) nor " if explicit else ""
        raise LlmTraceError("TinyLlama's weights are not on this machine "
                            f"({where}in the Hugging Face cache): "
                            f"run `{fetch_command()}` once while online, or use --model embedded")
    return None


def download(repo: str = REPOS[0], timeout: float = 20.0) -> Path:
    """Fetch TinyLlama's safetensors, config and tokenizer into the HF cache, with a progress bar.
    Fails in one line, quickly, when the hub cannot be reached."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise LlmTraceError("huggingface_hub is not installed: "
                            "pip install huggingface_hub") from None
    try:
        path = snapshot_download(repo, allow_patterns=["config.json", "*.safetensors",
                                                       "model.safetensors.index.json",
                                                       "tokenizer.model", "tokenizer.json",
                                                       "tokenizer_config.json",
                                                       "generation_config.json"],
                                 etag_timeout=timeout)
    except Exception as e:  # the hub client raises many kinds; all mean "not fetched"
        first = first_line(e)
        raise LlmTraceError(f"could not download {repo} ({type(e).__name__}: {first[:160]}): "
                            f"this needs a connection to the Hugging Face hub") from None
    path = Path(path)
    if not _complete(path):
        raise LlmTraceError(f"{repo} at {path} has no safetensors weights: "
                            f"try the other repo, {REPOS[1]}")
    return path


if __name__ == "__main__":
    import sys

    try:
        where = download(sys.argv[1] if len(sys.argv) > 1 else REPOS[0])
    except LlmTraceError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"TinyLlama is in {where}: `--model tinyllama` (or auto) now runs it")
