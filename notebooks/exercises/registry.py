"""One registry of exercises, and `check`, which runs a learner's function on what a stage of the
running model received and says, in one line, whether it made what the stage made.

Each chapter's file registers its exercises with `@exercise(chapter, solution)` on a function
that builds the exercise's `Case` for a model: the inputs the stage received (from a traced pass
of the prompt), what it produced, how to compare, and the typical mistakes with their hints.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import os
import signal
import textwrap
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from llmtrace_book import LlmTraceError
from llmtrace_book.model import Model

from .verdicts import first_line, generic_hint, same_error

PROMPT = "The capital of France is"
LIMIT_SECONDS = 30.0  # a learner's function still running after this is reported as too slow


@dataclass
class Case:
    """One exercise on one model: `call(fn)` runs fn on fresh copies of the recorded inputs
    (through `run`) and returns what it made; `want` is what the model made; `compare(got,
    want)` says how they differ (None: they match); `what` names what matched, for the pass
    line; `mistakes` are (a wrong version, its hint); `diagnose(got)` reads a hint off the
    result itself."""
    call: Callable[[Callable], Any]
    want: Any
    what: str
    compare: Callable[[Any, Any], str | None]
    mistakes: list[tuple[Callable, str]] = field(default_factory=list)
    diagnose: Callable[[Any], str | None] | None = None
    accepted: Callable[[Any], str | None] | None = None  # a different right answer: its note


@dataclass
class Exercise:
    name: str
    chapter: int
    solution: Callable
    build: Callable[[Model], Case]


REGISTRY: dict[str, Exercise] = {}
RENAMED = {"embed": "embed_tokens", "rms_norm": "rms_normalize", "rope_cos_sin": "rope_angles",
           "causal_mask": "future_mask", "repeat_kv": "expand_kv_heads", "swiglu": "gated_ffn",
           "window_mask": "sliding_window_mask"}  # the names that were the library's


def exercise(chapter: int, solution: Callable):
    """Register the decorated case builder as the exercise named after `solution`, the
    reference answer of chapter `chapter` (its docstring states the exercise)."""
    def register(build):
        name = solution.__name__
        if name in REGISTRY:
            raise ValueError(f"two exercises named {name!r}")
        REGISTRY[name] = Exercise(name, chapter, solution, build)
        return build
    return register


def size(fn: Callable) -> int:
    """Lines of code of a function: without its signature, docstring, comments and blanks."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    body = tree.body[1:] if isinstance(tree.body[0], ast.Expr) and isinstance(
        getattr(tree.body[0], "value", None), ast.Constant) else tree.body
    lines = set()
    for node in body:
        for sub in ast.walk(node):
            if hasattr(sub, "lineno"):
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    source = inspect.getsource(fn).splitlines()
    first = tree.lineno - 1  # ast's line numbers count from the dedented source's first line
    return sum(1 for n in lines if source[n - 1 - first].strip()
               and not source[n - 1 - first].strip().startswith("#"))


# --- running the learner's function ------------------------------------------------------------

class Stub(Exception):
    """The function is still the stub (its body `...`, `pass` or NotImplementedError)."""


class ReturnedNone(Exception):
    """The function ran and returned None."""


class Edited(Exception):
    """The function changed one of its inputs in place."""


class TooSlow(Exception):
    """The function was still running after LIMIT_SECONDS."""


def is_stub(fn) -> bool:
    """Is fn's body only a docstring and `...`, `pass` or `raise NotImplementedError`?"""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        node = next(n for n in ast.walk(tree)
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    except Exception:  # noqa: BLE001: no source: a body that compiles to `return None` alone
        code = getattr(fn, "__code__", None)
        return code is not None and code.co_code == (lambda: None).__code__.co_code
    if isinstance(node, ast.Lambda):
        return False
    for stmt in node.body:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue  # a docstring, or `...`
        if isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, ast.Raise) and "NotImplementedError" in ast.unparse(stmt):
            continue
        return False
    return True


def copy_inputs(x, memo=None):
    """Fresh copies of the inputs (tensors cloned; a tensor seen twice, as a tied head, stays one
    tensor), so that nothing a learner does reaches the model."""
    memo = {} if memo is None else memo
    if isinstance(x, torch.Tensor):
        if id(x) not in memo:
            memo[id(x)] = x.detach().clone()
        return memo[id(x)]
    if isinstance(x, (list, tuple)):
        return type(x)(copy_inputs(v, memo) for v in x)
    if isinstance(x, dict):
        return {k: copy_inputs(v, memo) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type) \
            and not x.__dataclass_params__.frozen:
        return dataclasses.replace(x, **{f.name: copy_inputs(getattr(x, f.name), memo)
                                         for f in dataclasses.fields(x) if f.init})
    return x


def edited(before, after, where: str) -> str | None:
    """The first input the call changed in place, by name (`x`, `w.q_proj`), or None."""
    if isinstance(before, torch.Tensor):
        if not isinstance(after, torch.Tensor) or after.shape != before.shape \
                or not torch.equal(after, before):
            return where
        return None
    if isinstance(before, (list, tuple)):
        if not isinstance(after, (list, tuple)) or len(after) != len(before):
            return where
        for i, (b, a) in enumerate(zip(before, after)):
            if (hit := edited(b, a, f"{where}[{i}]")):
                return hit
        return None
    if isinstance(before, dict):
        for k in before:
            if (hit := edited(before[k], after.get(k) if isinstance(after, dict) else None,
                              f"{where}[{k!r}]")):
                return hit
        return None
    if dataclasses.is_dataclass(before) and not isinstance(before, type):
        for f in dataclasses.fields(before):
            if (hit := edited(getattr(before, f.name), getattr(after, f.name, None),
                              f"{where}.{f.name}")):
                return hit
    return None


EXPECTED: list[str] = []  # the argument names of the exercise being checked


def arg_names(fn, n: int) -> list[str]:
    """The names fn gives its first n arguments (`argument 3` past them, or for `*args`)."""
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    try:
        names = [p.name for p in inspect.signature(fn).parameters.values() if p.kind in plain]
    except (TypeError, ValueError):
        names = []
    names += EXPECTED[len(names):n]  # `*args`: the exercise's own names
    return (names + [f"argument {i + 1}" for i in range(len(names), n)])[:n]


def run(fn, *args, names: list[str] | None = None, may_edit: dict | None = None,
        copies_out: list | None = None):
    """fn(*fresh copies of args): what it returned. Raises Stub or ReturnedNone for None,
    Edited when it changed an input in place (`may_edit`: {name: check(before, after) -> a
    problem or None} for inputs it may write into)."""
    names = names or arg_names(fn, len(args))
    copies = copy_inputs(args)
    if copies_out is not None:
        copies_out.extend(copies)  # what fn was given, as it left them
    out = fn(*copies)
    for name, before, after in zip(names, args, copies):
        if may_edit and name in may_edit:
            problem = may_edit[name](before, after)
            if problem:
                raise Edited(problem)
            continue
        if (hit := edited(before, after, name)):
            raise Edited(f"your function changed its input `{hit}` in place: work on a copy "
                         f"(`.clone()`) or write the result into a new tensor")
    if out is None:
        raise Stub if is_stub(fn) else ReturnedNone
    return out


def caller(*args, may_edit: dict | None = None):
    """call(fn) = run(fn, *args): the usual Case.call."""
    return lambda fn: run(fn, *args, may_edit=may_edit)


@contextmanager
def time_limit(seconds: float):
    """TooSlow after `seconds`, where a timer signal can interrupt this thread (the main thread
    of a kernel or a script on Unix); elsewhere, no limit."""
    usable = (hasattr(signal, "setitimer") and seconds
              and threading.current_thread() is threading.main_thread())
    if not usable:
        yield
        return

    def stop(signum, frame):
        raise TooSlow
    old = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# --- per-model data ----------------------------------------------------------------------------

_models: dict[str, Model] = {}  # load_model() per LLMTRACE_MODEL value
_data: dict[int, tuple[Model, dict]] = {}  # id(model) -> (model, {"trace": ..., name: Case})


def default_model() -> Model:
    from llmtrace_book import load_model

    key = os.environ.get("LLMTRACE_MODEL", "")
    if key not in _models:
        _models[key] = load_model()
    return _models[key]


def store(model: Model) -> dict:
    if id(model) not in _data or _data[id(model)][0] is not model:
        _data[id(model)] = (model, {})
    return _data[id(model)][1]


def trace_of(model: Model):
    """The traced pass of the prompt every exercise reads (made once per model)."""
    s = store(model)
    if "trace" not in s:
        s["logits"], s["trace"] = model.run(PROMPT)  # [1, T, V], the trace
    return s["trace"]


def stream_into(model: Model, layer: int) -> torch.Tensor:
    """The residual stream entering a layer (Gemma's starts from the scaled rows)."""
    trace = trace_of(model)
    if layer:
        return trace[f"layers.{layer - 1}.resid_out"]
    return trace["embed.scaled"] if "embed.scaled" in trace else trace["embed"]


def plain_llama(model: Model) -> bool:
    """Are the model's layers Llama's, as the chapters write them (RoPE scaling aside)?"""
    c = model.config
    return not (c.qk_norm or c.qkv_bias or c.sliding_window or c.sandwich_norm
                or c.norm_offset or c.mlp_act != "silu" or c.attn_scale or c.embed_scale
                or c.layer_types)


def case_of(name: str, model: Model) -> Case:
    s = store(model)
    if name not in s:
        s[name] = REGISTRY[name].build(model)
    return s[name]


# --- the verdict ---------------------------------------------------------------------------------

def mistake_hint(case: Case, got, exc: BaseException | None) -> str | None:
    """The hint of the first known mistake that gives the same result (or raises the same
    error) as the learner's function, and is a mistake on this model (differs from `want`)."""
    for wrong, hint in case.mistakes:
        try:
            theirs = case.call(wrong)
        except (Stub, ReturnedNone, Edited, TooSlow):
            continue
        except Exception as e:  # noqa: BLE001: a mistake may fail as the learner's did
            if exc is not None and same_error(e, exc):
                return hint
            continue
        if exc is None:
            try:
                if case.compare(theirs, case.want) is None:
                    continue  # not a mistake on this model (eps too small to matter...)
                if case.compare(got, theirs) is None:
                    return hint
            except Exception:  # noqa: BLE001
                continue
    return None


def _main(x):
    """The tensor a generic hint looks at."""
    return x[0] if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor) else x


def _tolerance(case: Case) -> str:
    rtol = getattr(case.compare, "rtol", None)
    return "exactly" if rtol is None else f"within {rtol:.0e}"


def _name_problem(name) -> str | None:
    if not isinstance(name, str):
        return (f"✗ an exercise's name is a string, such as 'rms_normalize'; got "
                f"{type(name).__name__}")
    if name in REGISTRY:
        return None
    if name in RENAMED:
        return f"✗ {name}: this exercise is now called {RENAMED[name]!r}"
    close = difflib.get_close_matches(name, list(REGISTRY), n=3, cutoff=0.5)
    near = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    return f"✗ no exercise named {name!r}: {near}the names are in NAMES"


def _model_problem(name: str, model) -> str | None:
    if not isinstance(model, Model):
        return (f"✗ {name}: model must be an llmtrace model (from load_model()), got "
                f"{type(model).__name__}")
    if model.is_meta:
        return (f"✗ {name}: {model.name} is on the meta device, which holds shapes, not "
                f"values: check on a model with weights (load_model())")
    return None


def check(name: str, fn: Callable, model=None) -> bool:
    """Run fn on the recorded inputs of exercise `name`, compare with the recorded output, print
    one line and return True on a match. Never raises, but for KeyboardInterrupt."""
    try:
        return _check(name, fn, model)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001: the notebook must go on
        print(f"✗ {name if isinstance(name, str) else 'check'}: the check itself failed: "
              f"{first_line(e)}")
        return False


def _check(name, fn, model) -> bool:
    problem = _name_problem(name)
    if problem:
        print(problem)
        return False
    if not callable(fn):
        print(f"✗ {name}: give check a function, got {type(fn).__name__}")
        return False
    try:
        model = model if model is not None else default_model()
    except Exception as e:  # noqa: BLE001
        print(f"✗ {name}: no model to check on: {first_line(e)}")
        return False
    problem = _model_problem(name, model)
    if problem:
        print(problem)
        return False
    try:
        case = case_of(name, model)
    except Exception as e:  # noqa: BLE001
        print(f"✗ {name}: the check could not run on this model: {first_line(e)}")
        return False
    EXPECTED[:] = list(inspect.signature(REGISTRY[name].solution).parameters)
    try:
        with time_limit(LIMIT_SECONDS):
            got = case.call(fn)
    except (Stub, NotImplementedError):
        print(f"… {name}: not written yet: replace the stub with your code")
        return False
    except ReturnedNone:
        print(f"✗ {name}: your function returned None: did you forget `return`?")
        return False
    except Edited as e:
        print(f"✗ {name}: {e}")
        return False
    except TooSlow:
        print(f"✗ {name}: your function was still running after {LIMIT_SECONDS:g} s: "
              f"too slow (a loop that never ends?)")
        return False
    except SystemExit:
        print(f"✗ {name}: your function called sys.exit() (or exit()): return a result "
              f"instead")
        return False
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001: the learner's error, in one line
        hint = mistake_hint(case, None, e) if isinstance(e, Exception) else None
        print(f"✗ {name}: your function raised {first_line(e)}"
              + (f"; hint: {hint}" if hint else ""))
        return False
    try:
        problem = case.compare(got, case.want)
    except Exception as e:  # noqa: BLE001: an output of an unexpected kind
        problem = f"the result could not be compared ({first_line(e)})"
    note = None
    if problem is not None and case.accepted is not None:
        try:
            note = case.accepted(got)
        except Exception:  # noqa: BLE001
            note = None
    if problem is None or note:
        print(f"✓ {name}: matches {case.what} {_tolerance(case)}"
              + (f" ({note})" if note else ""))
        return True
    try:
        hint = (case.diagnose(got) if case.diagnose else None) \
            or mistake_hint(case, got, None) or generic_hint(_main(got), _main(case.want))
    except Exception:  # noqa: BLE001: no hint rather than no verdict
        hint = None
    print(f"✗ {name}: {problem}" + (f"; hint: {hint}" if hint else ""))
    return False


def solution(name: str) -> Callable:
    """The reference function of an exercise; its docstring states the exercise."""
    problem = _name_problem(name)
    if problem:
        raise LlmTraceError(problem.lstrip("✗ "))
    return REGISTRY[name].solution
