"""The book's glossary of trace names against the names a trace records: neither can drift."""

import re
from pathlib import Path

import torch

from llmtrace_book import Trace, sample, trace_shapes

GLOSSARY = Path(__file__).resolve().parents[1] / "book" / "glossary.md"


def recorded_names() -> set[str]:
    """Every name a forward pass and a top-k / top-p sampling step record, layer index as N."""
    prefill, decode = trace_shapes("tinyllama-1.1b", 6, 1)
    names = {re.sub(r"^layers\.\d+\.", "layers.N.", n) for n in prefill.names + decode.names}
    for t in trace_shapes("deepseek-v3", 6, 1):  # latent attention, DeepSeek's experts
        names |= {re.sub(r"^layers\.\d+\.", "layers.N.", n) for n in t.names}
    step = Trace()
    sample(torch.randn(100), 0.8, top_k=10, top_p=0.9, generator=torch.Generator(), trace=step)
    return names | set(step.names)


def glossary_names(known: set[str], section: str | None = None) -> list[str]:
    """The names in the first column of the glossary's tables (None: the walk's and
    DeepSeek-V3's, not Gemma 4's or Qwen3-Next's, whose names the embedded model's trace does
    not record; else the table under the heading `section`). A short name after the first one
    (`k_proj` after `layers.N.attn.q_proj`) completes with a prefix of the first."""
    names, text = [], GLOSSARY.read_text()
    parts = text.split("\n## ")
    if section is None:
        text = "\n".join(p for p in parts
                         if not p.startswith(("Gemma 4's records\n", "Qwen3-Next's records\n")))
    elif any(p.startswith(f"{section}\n") for p in parts):
        text = "\n".join(p for p in parts if p.startswith(f"{section}\n"))
    else:
        text = text.split(f"\n### {section}")[1].split("\n#")[0]
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        first, *short = re.findall(r"`([^`]+)`", line.split("|")[1])
        names.append(first)
        parts = first.split(".")
        for s in short:
            candidates = [".".join(parts[:i] + [s]) for i in range(len(parts))]
            names.append(next((c for c in candidates if c in known), s))
    return names


def test_glossary_lists_every_recorded_name():
    known = recorded_names()
    listed = glossary_names(known)
    assert len(listed) == len(set(listed))  # each name once
    assert set(listed) - known == set()  # nothing the trace does not record
    assert known - set(listed) == set()  # nothing the trace records left out


def test_glossary_lists_qwen3_next_records():
    """Qwen3-Next's table: every name its preset's trace records beyond TinyLlama's walk, each
    shape as the table gives it."""
    prefill, decode = trace_shapes("qwen3-next-80b-a3b", 6, 1)
    names = {re.sub(r"^layers\.\d+\.", "layers.N.", n) for n in prefill.names + decode.names}
    own = names - recorded_names()
    moe = {n for n in own if n.startswith("layers.N.mlp.") and not n.startswith(
        ("layers.N.mlp.shared", "layers.N.mlp.routed"))}  # the experts' records
    listed = glossary_names(names, "Qwen3-Next")
    assert len(listed) == len(set(listed))
    assert set(listed) == own - moe
    table = GLOSSARY.read_text().split("### Qwen3-Next")[1]
    assert f"`{list(prefill.shape('layers.0.attn.state'))}`" in table
    assert f"`{list(prefill.shape('layers.0.attn.qkvz'))}`" in table
def test_glossary_lists_gemma4s_own_records():
    """Its section lists what gemma-4-e2b's trace records and gemma-3-270m's does not, with
    the shapes of that trace."""
    def named(config):
        (prefill,) = trace_shapes(config, 6, 0)
        return {re.sub(r"^layers\.\d+\.", "layers.N.", r.name): r.shape for r in prefill}

    gemma4, gemma3 = named("gemma-4-e2b"), named("gemma-3-270m")
    own = set(gemma4) - set(gemma3)
    listed = glossary_names(own, "Gemma 4's records")
    assert len(listed) == len(set(listed)) and set(listed) == own
    text = GLOSSARY.read_text().split("## Gemma 4's records")[1]
    for line in text.splitlines():
        if line.startswith("| `layers.N.resid_ple`"):
            assert str(list(gemma4["layers.N.resid_ple"])) in line
