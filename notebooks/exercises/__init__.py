"""The book's exercises: write a stage of the machine yourself, and check it on the trace's own
tensors. From the notebooks' folder (where JupyterLab's kernels run):

    from exercises import check, solution, NAMES

and from a script at the repository's root: `sys.path.insert(0, "notebooks")` first.

`check(name, fn, model=None)` runs `fn` on the inputs that the named stage received in a traced
pass of the running model (`load_model()`, which follows `LLMTRACE_MODEL`; or `model=`),
compares what it returns with what the stage produced, prints one line and returns True or
False: ✓ what matched and to what tolerance; ✗ the first difference, with a hint when the result
is a common mistake's; … while `fn` is still a stub (its body `...`, `pass` or `raise
NotImplementedError`). It never raises (KeyboardInterrupt aside). `solution(name)` returns a
reference function that passes on every family the library computes (OLMo 2 aside: no norm
before its sublayers); its docstring is the exercise. `CHAPTERS[name]` is the chapter an exercise belongs to, `SIZES[name]` the lines of its
reference solution.

Each chapter's file (`ch04_rmsnorm.py`...) holds its exercises: the solution, the check's case
(what the stage received and produced) and the hints; `registry.py` runs them, `verdicts.py`
words the verdicts, `page.py` writes the exercises page of the book.
"""

from . import (ch01_model, ch02_tokenization, ch03_embedding, ch04_rmsnorm,  # noqa: F401
               ch05_attention, ch06_rope, ch07_ffn, ch08_stack, ch09_lm_head, ch10_sampling,
               ch11_decode_loop, ch13_whole_machine, ch14_inside_the_layers, ch15_induction,
               ch17_todays_models)
from .registry import REGISTRY, check, plain_llama, size, solution

NAMES = sorted(REGISTRY, key=lambda n: REGISTRY[n].chapter)  # in the book's order
CHAPTERS = {name: REGISTRY[name].chapter for name in NAMES}
SIZES = {name: size(REGISTRY[name].solution) for name in NAMES}

__all__ = ["CHAPTERS", "NAMES", "SIZES", "check", "plain_llama", "solution"]
