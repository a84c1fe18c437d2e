"""The book's exercises page (book/exercises.md), written from the registry:

    python notebooks/exercises/page.py            # from the repository's root (make book does it)
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILDERS = ("attention_from_weights", "block_from_weights", "generate_with_cache",
            "forward_from_weights", "head_logit_attribution")

HEAD = """# Exercises

Chapter 1, each stage chapter, the whole machine's chapter, the patching chapter and the appendix
on today's models end with exercises that `check` verifies: you write a stage yourself, and the
trace checks it. Your function runs on the very tensors that the stage received when the running
model read "The capital of France is", and what it returns is compared with what the stage
produced. This page is written from the exercises' registry (`notebooks/exercises`).

## How to use `check`

In JupyterLab (`make lab`), the chapters' kernels run in `notebooks/`, where the exercises live:

```python
from exercises import check, solution, NAMES

def rms_normalize(x, gain, eps):
    \"\"\"x [B, T, D], gain [D] -> [B, T, D]\"\"\"
    ...  # your code here

_ = check("rms_normalize", rms_normalize, model=model)  # the verdict is printed
```

In a script run from the repository's root, put the notebooks' folder on the path first:
`import sys; sys.path.insert(0, "notebooks")`, then the same import.

`check(name, fn, model=...)` prints one line and returns `True` or `False`:

- `… rms_normalize: not written yet` while the body is still `...` (or `pass`, or
  `raise NotImplementedError`); a function that runs and returns `None` is told so;
- `✓ rms_normalize: matches layers.0.attn_norm [...] within 1e-05` when every element agrees
  with the recorded one to that fraction of the tensor's largest value (a few exercises compare
  lists, exactly);
- `✗ rms_normalize: ...` otherwise, with the first difference, and a hint when your result is
  what a common mistake gives: a missing `1/sqrt(head_dim)`, a mask off by one (or NaN from
  `0 * -inf`), the other RoPE pair convention, softmax over the wrong axis, `eps` outside the
  square root, top-p cut before top-k, a decode loop that forgets the cache position, a
  generation that runs the whole sequence at every step...

Your function gets copies of the inputs, and one that changes an input in place fails (the model
would pass that change on); `check` never stops the notebook: an exception, `sys.exit()`, a wrong
name or a wrong model become a `✗` line, and a function still running after 30 seconds is
reported as too slow (where the platform's timer allows it). `model=` is the model of the page
(`start_chapter` loads it); without it, `check` loads `load_model()`, which follows
`LLMTRACE_MODEL`. Every reference solution, `solution(name)`, passes on every family the library
computes (Llama, Llama 3, Mistral, Qwen2, Qwen3, Gemma 3); its docstring states the exercise:
`help(solution("top_p"))`. In a chapter, the hints sit above the exercise, folded, and the
solution below it, folded too.

## The exercises

Each receives plain tensors (or lists, functions, the model's weights and config) and returns
plain tensors. Shapes use `B` (batch), `T` (positions), `D` (hidden size), `H` and `KV` (query
and key/value heads), `hd` (head size), `F` (FFN size) and `V` (vocabulary). *Lines* counts the
reference solution's lines of code (no docstring, comments or blank lines).

| chapter | you write | lines |
|---|---|---|
"""


def signature(fn) -> str:
    return f"{fn.__name__}({', '.join(inspect.signature(fn).parameters)})"


def climb(names, chapters, sizes) -> str:
    """How the exercises climb, in words, from their sizes."""
    small = [n for n in names if sizes[n] <= 3]
    builders = [n for n in names if n in BUILDERS]
    early = [n for n in names if chapters[n] <= 2]
    text = (f"How they climb: {len(small)} of the {len(names)} are three lines or fewer, "
            f"one step of a stage on the tensors it received. They do not grow steadily: "
            + ", ".join(f"`{n}` (chapter {chapters[n]}) takes {sizes[n]}" for n in early)
            + ", loops over the config or a word. The climb is in the builders, which make "
            "a part of the machine from the weights alone and are checked against the "
            "trace: " + ", ".join(f"`{n}` ({sizes[n]} lines, chapter {chapters[n]})"
                                  for n in builders)
            + ". `block_from_weights` and `forward_from_weights` call chapter 6's "
            "`attention_from_weights`; the others stand alone.")
    return text


def page() -> str:
    sys.path.insert(0, str(ROOT / "notebooks"))
    from exercises import CHAPTERS, NAMES, SIZES, solution

    notebooks = {int(p.stem[:2]): p.name for p in (ROOT / "notebooks").glob("[0-9]*.ipynb")}
    rows = [f"| [{CHAPTERS[n]}](../notebooks/{notebooks[CHAPTERS[n]]}) | "
            f"`{signature(solution(n))}` | {SIZES[n]} |" for n in NAMES]
    return HEAD + "\n".join(rows) + "\n\n" + climb(NAMES, CHAPTERS, SIZES) + "\n"


if __name__ == "__main__":
    out = ROOT / "book" / "exercises.md"
    out.write_text(page())
    print(out)
