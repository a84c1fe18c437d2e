"""The book's glossary of trace names against the names a trace records: neither can drift."""

import re
from pathlib import Path

import torch

from llmtrace import Trace, sample, trace_shapes

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
    """The names in the first column of the glossary's tables (that under the heading
    `section`, else all but Gemma 4's). A short name after the first one (`k_proj` after
    `layers.N.attn.q_proj`) completes with a prefix of the first."""
    names = []
    text = GLOSSARY.read_text()
    parts = text.split("\n## ")
    # every table but Gemma 4's, whose names the embedded model's trace does not record
    kept = [p for p in parts if p.startswith(f"{section}\n")] if section else \
        [p for p in parts if not p.startswith("Gemma 4's records\n")]
    for line in "\n".join(kept).splitlines():
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
