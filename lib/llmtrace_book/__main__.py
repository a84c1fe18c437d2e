"""python -m llmtrace_book "The capital of France is": the trace table, then the generated text."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import signal
import sys

import torch

from . import __version__
from .presets import PRESETS
from .errors import LlmTraceError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage and exits; here: one line, exit status 2
        raise LlmTraceError(f"{message}: see python -m llmtrace_book --help")


def parse_args(argv):
    p = _Parser(prog="python -m llmtrace_book", description=__doc__)
    p.add_argument("prompt", help="the text to continue")
    p.add_argument("--model", default=None,
                   help="auto (default, or $LLMTRACE_MODEL), embedded, tinyllama, "
                   "a HF directory or a .gguf file")
    p.add_argument("--dtype", default=None,
                   help="the dtype to run in: float32, bfloat16, float16 (default: the "
                        "checkpoint's own; the embedded model's is float32)")
    p.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:N or mps (default: a GPU if there is one, else cpu)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="read each layer from disk as the pass reaches it (--no-stream: hold "
                        "the whole model; default: stream only when the whole does not fit)")
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=1,
                   help="layers shown in full in the table (default 1)")
    p.add_argument("--all-layers", action="store_true", help="show every layer in the table")
    p.add_argument("--shapes-only", action="store_true",
                   help="trace TinyLlama-1.1B's shapes on the meta device, no weights needed "
                        "(--model may name another preset: " + ", ".join(sorted(PRESETS)) +
                        "; or a Hugging Face directory: its config.json's shapes)")
    p.add_argument("--lens", action="store_true",
                   help="instead of the trace table, the logit lens: the top token after every "
                        "layer at every position, and the greedy token's p at the last position")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--version", action="version", version=f"llmtrace-book {__version__}")
    return p.parse_args(argv)


def check_args(args) -> None:
    from .sampling import check_sampling

    if not args.prompt:
        raise LlmTraceError("the prompt is empty: give at least one character of text")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # bytes that were not UTF-8 reach Python as lone surrogates
        byte = ord(args.prompt[e.start]) - 0xDC00
        raise LlmTraceError(f"the prompt is not valid UTF-8 (byte {byte:#04x} at character "
                            f"{e.start}): pass UTF-8 text, e.g. under LANG=C.UTF-8") from None
    if args.max_new_tokens < 1:
        raise LlmTraceError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.layers < 1:
        raise LlmTraceError(f"--layers must be at least 1, got {args.layers} "
                            f"(--all-layers shows every layer)")
    check_sampling(args.temperature, args.top_k, args.top_p, args.seed)
    if args.model is not None and not args.model.strip():
        raise LlmTraceError(f"--model {args.model!r} is empty: use one of auto, embedded, "
                            f"tinyllama, a Hugging Face model directory or a .gguf file "
                            f"(or leave --model out)")
    if args.lens and args.shapes_only:
        raise LlmTraceError("--lens needs values and --shapes-only has none: drop one of the two")
    if args.shapes_only:
        given = [f for f, v in (("--dtype", args.dtype), ("--device", args.device),
                                ("--stream", args.stream)) if v is not None]
        if given:
            raise LlmTraceError(f"{given[0]} chooses how weights run, and --shapes-only has "
                                f"none: drop one of the two")
        shapes_config(args.model)
    else:
        from .check import check_device, check_dtype
        from .load import check_name, resolve

        check_dtype(args.dtype)
        check_device(args.device)
        check_name(resolve(args.model))


def shapes_config(model: str | None):
    """--shapes-only traces a config with no weights: TinyLlama-1.1B's, another preset's, or a
    Hugging Face checkpoint's own config.json (its directory, or the file)."""
    from pathlib import Path

    from .config import Config

    model = None if model is None else model.strip()
    if model in (None, "auto", "tinyllama"):
        return Config.from_name("tinyllama-1.1b")
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".json"):
        return Config.from_hf(path)
    if path.exists():
        raise LlmTraceError(f"--shapes-only reads a Hugging Face config.json, and {model} is "
                            f"not one nor a directory holding one: point --model at the model's "
                            f"directory, or name a preset ({', '.join(sorted(PRESETS))})")
    return Config.from_name(model)


def top_candidates(tokenizer, logits: torch.Tensor, n: int = 10) -> list[dict]:
    from .tokenize import display_piece

    probs = torch.softmax(logits.float(), -1)
    top = probs.topk(n)
    return [{"id": int(i), "piece": display_piece(tokenizer, int(i)),
             "logit": round(float(logits[i]), 4), "prob": round(float(p), 6)}
            for p, i in zip(top.values, top.indices)]


def run_shapes_only(args) -> dict:
    """Shapes of a config with no weights: TinyLlama-1.1B unless --model names another preset."""
    from .model import trace_shapes
    from .tokenize import display_piece

    config = shapes_config(args.model)
    tok, note = shapes_tokenizer(args.model, config)
    source = "meta device (shapes only)" + note
    ids = torch.tensor([tok.encode(args.prompt)])  # [1, T]
    prefill, decode = trace_shapes(config, ids, decode_steps=1)
    return {"model": config.name, "source": source, "config": config.to_dict(),
            "input_ids": ids[0].tolist(),
            "input_pieces": [display_piece(tok, i) for i in ids[0].tolist()],
            "trace": prefill, "decode_trace": decode, "generation": None}


def shapes_tokenizer(model: str | None, config):
    """The tokenizer that counts the prompt's tokens for a shapes-only run, and what to say of
    it: a checkpoint directory's own, the embedded model's, or Llama-2's (TinyLlama's), which is
    here offline and stands in for the others."""
    from pathlib import Path

    from .weights.tokenizer_llama import llama_tokenizer

    if model is not None and Path(model.strip()).expanduser().is_dir():
        from .weights.hf import load_tokenizer

        tok = load_tokenizer(Path(model.strip()).expanduser(), config)
        if tok is not None:
            return tok, ""
    elif config.name == "smollm2-135m-instruct":
        from .load import load_model

        return load_model("embedded").tokenizer, ""
    elif config.name.startswith(("tinyllama", "llama-2")):
        return llama_tokenizer(), ""
    return llama_tokenizer(), (f"; {config.name}'s own tokenizer is not on this machine: "
                               "Llama-2's stands in, so only the count of tokens is its")


def run_live(args) -> dict:
    from .generate import Tracing, generate
    from .lens import keeps_stream
    from .load import load_model
    from .tokenize import display_piece

    model = load_model(args.model, args.dtype, args.device, args.stream)
    # the CLI prints the prefill's shapes and logits: no values (but the lens's), no later steps
    # (flat memory)
    tracing = Tracing(keep_values=args.lens, names=keeps_stream, steps=1)
    g = generate(model, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                 args.seed, trace=tracing)
    tok = model.tokenizer
    out = {"model": model.name, "source": model.source, "runs": model.runs,
           "config": model.config.to_dict(),
            "input_ids": g.prompt_ids,
            "input_pieces": [display_piece(tok, i) for i in g.prompt_ids],
            "trace": g.steps[0], "generation": g,
            "top10": top_candidates(tok, g.step_logits[0]),
            "new_pieces": [display_piece(tok, i) for i in g.new_ids]}
    if args.lens:
        greedy = int(g.step_logits[0].argmax())  # the first new token under greedy decoding
        out["lens"] = lens_report(model, g.steps[0], greedy)
    return out


def lens_report(model, trace, greedy: int) -> dict:
    """The logit lens over every layer and position, and the greedy token's p at the last one."""
    from .lens import lens_grid
    from .tokenize import display_piece

    tok = model.tokenizer
    grid = lens_grid(model, trace, greedy)
    p_greedy = grid.token_probs[:, -1]  # [L]
    return {"top_ids": grid.top_ids.tolist(),
            "top_pieces": [[display_piece(tok, int(i)) for i in row] for row in grid.top_ids],
            "top_probs": [[round(float(p), 4) for p in row] for row in grid.top_probs],
            "greedy_id": greedy, "greedy_piece": display_piece(tok, greedy),
            "greedy_probs": [round(float(p), 4) for p in p_greedy]}


def lens_text(lens: dict, pieces: list[str], width: int = 12) -> str:
    """Rows: layers; columns: positions; each cell the top token, then p of the greedy token."""
    from .trace import format_rows

    def cell(piece):
        text = repr(piece)
        return text if len(text) <= width else text[: width - 1] + "…"

    header = ["layer"] + [cell(p) for p in pieces] + [f"p({lens['greedy_piece']!r})"]
    rows = [[str(i)] + [cell(p) for p in row] + [f"{lens['greedy_probs'][i]:.4f}"]
            for i, row in enumerate(lens["top_pieces"])]
    return format_rows(header, rows, rule=False)


def safe(text: str) -> str:
    """Text from a user or a model, made harmless for a terminal: control characters (an escape
    sequence could move the cursor or retitle the window) are shown as escapes, newlines kept."""
    return CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def render(args, out: dict) -> str:
    """Everything the CLI prints, as one string: written at once, or not at all."""
    trace, g, decode = out.pop("trace"), out.pop("generation"), out.pop("decode_trace", None)
    if args.json:
        out["trace"] = trace.to_dicts()
        if decode is not None:
            out["decode_trace"] = decode.to_dicts()
        if g is not None:
            out.update(generated_ids=g.new_ids, generated_text=g.text, stop_reason=g.stop_reason)
        try:
            return json.dumps(out, ensure_ascii=False, allow_nan=False)  # valid JSON or an error
        except ValueError:
            raise LlmTraceError("the output holds a number that is not finite, which JSON cannot "
                                "write: run without --json to see where") from None
    c = out["config"]
    pieces = list(zip(out["input_ids"], out["input_pieces"]))
    runs = f"; {out['runs']}" if out.get("runs") else ""  # shapes only: no weights run
    lines = [safe(f"model: {out['model']} ({out['source']}{runs}): {c['n_layers']} layers, "
                  f"hidden {c['hidden_size']}, heads {c['n_heads']}/{c['n_kv_heads']}, "
                  f"vocab {c['vocab_size']}"),
             "input: " + " ".join(f"{i}:{p!r}" for i, p in pieces), ""]
    if "lens" in out:
        lines += ["logit lens: the top token after each layer (rows) at each position (columns);",
                  "last column: p of the greedy token at the last position",
                  lens_text(out["lens"], out["input_pieces"])]
    else:
        lines += [trace.table(layers=None if args.all_layers else args.layers),
                  f"\ntotal multiply-adds: {trace.total_macs:,}"]
    if decode is not None:
        lines += ["\nprefill vs the first decode step (layer 0; the cache already holds the "
                  "prompt):", trace.compare(decode, "layers.0.*")]
    if g is not None:
        lines.append("\ntop candidates for the first new token:")
        lines += [f"  {r['id']:>6}  {r['piece']!r:<14} logit {r['logit']:8.3f}  p {r['prob']:.4f}"
                  for r in out["top10"]]
        lines += [f"\ngenerated ({len(g.new_ids)} tokens, stopped at {g.stop_reason}):",
                  safe(args.prompt + g.text)]
    return "\n".join(lines)


def write(text: str) -> None:
    """Print to stdout whatever its encoding: what it cannot encode (an ASCII terminal, a C
    locale) is written as backslash escapes rather than crashing half-way."""
    out = sys.stdout
    if out is None:  # started with stdout closed (`>&-`): Python leaves sys.stdout None
        raise OSError(errno.EBADF, "stdout is closed")
    encoding = getattr(out, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except (UnicodeEncodeError, LookupError):
        text = text.encode(encoding, "backslashreplace").decode(encoding, "replace")
    out.write(text + "\n")
    out.flush()


def fail(message: str, status: int = 2) -> int:
    if sys.stderr is not None:  # with stderr closed too, the status is all there is to say
        print(f"error: {safe(message)}".replace("\n", " "), file=sys.stderr)
    return status


def main(argv=None) -> int:
    if hasattr(signal, "SIGPIPE"):  # `python -m llmtrace_book ... | head` ends quietly, as other CLIs do
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        check_args(args)  # before loading anything: bad flags fail at once
        out = run_shapes_only(args) if args.shapes_only else run_live(args)
        text = render(args, out)
    except LlmTraceError as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except MemoryError:
        return fail("out of memory: use a shorter prompt or fewer --max-new-tokens")
    try:
        write(text)
    except KeyboardInterrupt:
        return fail("interrupted", 130)
    except OSError as e:  # a full disk, a closed terminal
        _silence_stdout()
        return fail(f"cannot write the output ({e.strerror or e}): check where stdout goes")
    return 0


def _silence_stdout() -> None:
    """After a failed write, stdout still holds the bytes it could not write, and Python would
    try again at exit and print a traceback-like warning: send them to /dev/null instead."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        return
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, fd)
    os.close(null)


if __name__ == "__main__":
    sys.exit(main())
