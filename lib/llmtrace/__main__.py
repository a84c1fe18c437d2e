"""python -m llmtrace "The capital of France is": the trace table, then the generated text."""

from __future__ import annotations

import argparse
import json
import signal
import sys

import torch

from .errors import LlmTraceError


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m llmtrace", description=__doc__)
    p.add_argument("prompt", help="the text to continue")
    p.add_argument("--model", default=None,
                   help="auto (default, or $LLMTRACE_MODEL), embedded, tinyllama, a HF directory or a .gguf file")
    p.add_argument("--max-new-tokens", type=int, default=20)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=1, help="layers shown in full in the table (default 1)")
    p.add_argument("--all-layers", action="store_true", help="show every layer in the table")
    p.add_argument("--shapes-only", action="store_true",
                   help="trace TinyLlama-1.1B's shapes on the meta device, no weights needed "
                        "(--model may name another preset: llama-2-7b, llama-2-70b, smollm2-135m)")
    p.add_argument("--lens", action="store_true",
                   help="instead of the trace table, the logit lens: the top token after every "
                        "layer at every position, and the greedy token's p at the last position")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p.parse_args(argv)


def check_args(args) -> None:
    from .sampling import check_sampling

    if not args.prompt:
        raise LlmTraceError("the prompt is empty: give at least one character of text")
    if args.max_new_tokens < 1:
        raise LlmTraceError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    check_sampling(args.temperature, args.top_k, args.top_p)
    if args.lens and args.shapes_only:
        raise LlmTraceError("--lens needs values and --shapes-only has none: drop one of the two")
    if args.shapes_only:
        shapes_config(args.model)
    elif args.model is not None:
        from .models import check_name

        check_name(args.model)


def shapes_config(model: str | None):
    """--shapes-only traces a preset: TinyLlama-1.1B unless --model names another one."""
    from .config import Config

    return Config.from_name("tinyllama-1.1b" if model in (None, "auto", "tinyllama") else model)


def top_candidates(tokenizer, logits: torch.Tensor, n: int = 10) -> list[dict]:
    from .tokenize import display_piece

    probs = torch.softmax(logits.float(), -1)
    top = probs.topk(n)
    return [{"id": int(i), "piece": display_piece(tokenizer, int(i)), "logit": round(float(logits[i]), 4),
             "prob": round(float(p), 6)} for p, i in zip(top.values, top.indices)]


def run_shapes_only(args) -> dict:
    """Shapes of a config with no weights: TinyLlama-1.1B unless --model names another preset."""
    from .model import trace_shapes
    from .tokenize import display_piece

    config = shapes_config(args.model)
    if config.vocab_size == 32000:  # TinyLlama and the Llama-2 presets share Llama-2's tokenizer
        from .weights.tokenizer_llama import llama_tokenizer

        tok = llama_tokenizer()
    else:
        from .models import load_model

        tok = load_model("embedded").tokenizer
    ids = torch.tensor([tok.encode(args.prompt)])  # [1, T]
    prefill, decode = trace_shapes(config, ids, decode_steps=1)
    return {"model": config.name, "source": "meta device (shapes only)", "config": config.to_dict(),
            "input_ids": ids[0].tolist(), "input_pieces": [display_piece(tok, i) for i in ids[0].tolist()],
            "trace": prefill, "decode_trace": decode, "generation": None}


def run_live(args) -> dict:
    from .generate import generate
    from .models import load_model
    from .tokenize import display_piece

    model = load_model(args.model)
    g = generate(model, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed,
                 keep_values=args.lens, names="layers.*.resid_out")  # values only for the lens
    tok = model.tokenizer
    out = {"model": model.name, "source": model.source, "config": model.config.to_dict(),
            "input_ids": g.prompt_ids, "input_pieces": [display_piece(tok, i) for i in g.prompt_ids],
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
    def cell(piece):
        text = repr(piece)
        return text if len(text) <= width else text[: width - 1] + "…"

    header = ["layer"] + [cell(p) for p in pieces] + [f"p({lens['greedy_piece']!r})"]
    rows = [[str(i)] + [cell(p) for p in row] + [f"{lens['greedy_probs'][i]:.4f}"]
            for i, row in enumerate(lens["top_pieces"])]
    widths = [max(len(r[j]) for r in [header] + rows) for j in range(len(header))]
    lines = ["  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip() for r in [header] + rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    if hasattr(signal, "SIGPIPE"):  # `python -m llmtrace ... | head` ends quietly, as other CLIs do
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_args(args)  # before loading anything: bad flags fail at once
        out = run_shapes_only(args) if args.shapes_only else run_live(args)
    except LlmTraceError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    trace, g, decode = out.pop("trace"), out.pop("generation"), out.pop("decode_trace", None)
    if args.json:
        out["trace"] = trace.to_dicts()
        if decode is not None:
            out["decode_trace"] = decode.to_dicts()
        if g is not None:
            out.update(generated_ids=g.new_ids, generated_text=g.text, stop_reason=g.stop_reason)
        print(json.dumps(out, ensure_ascii=False))
        return 0
    c = out["config"]
    print(f"model: {out['model']} ({out['source']}): {c['n_layers']} layers, hidden {c['hidden_size']}, "
          f"heads {c['n_heads']}/{c['n_kv_heads']}, vocab {c['vocab_size']}")
    print("input: " + " ".join(f"{i}:{p!r}" for i, p in zip(out["input_ids"], out["input_pieces"])))
    print()
    if "lens" in out:
        print("logit lens: the top token after each layer (rows) at each position (columns);")
        print("last column: p of the greedy token at the last position")
        print(lens_text(out["lens"], out["input_pieces"]))
    else:
        print(trace.table(layers=None if args.all_layers else args.layers))
        print(f"\ntotal multiply-adds: {trace.total_macs:,}")
    if decode is not None:
        print("\nprefill vs the first decode step (layer 0; the cache already holds the prompt):")
        print(trace.compare(decode, "layers.0.*"))
    if g is not None:
        print("\ntop candidates for the first new token:")
        for row in out["top10"]:
            print(f"  {row['id']:>6}  {row['piece']!r:<14} logit {row['logit']:8.3f}  p {row['prob']:.4f}")
        print(f"\ngenerated ({len(g.new_ids)} tokens, stopped at {g.stop_reason}):")
        print(args.prompt + g.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
