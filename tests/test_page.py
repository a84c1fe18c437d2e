"""The page that runs the reader's own prompt (book/your_prompt.md), in headless Chromium, from a
loopback server that the tests start and stop: a copy of the built book (hard links) served as a
static host serves it, with no cross-origin isolation, so the model runs on one thread.

The page loads once. It starts with a weight chunk removed, and must say so in one line; the
chunk put back, the next run loads the model and runs: three prompts, each checked against
Python's `model.run` and `generate` (ids, record names and shapes, the top 10, the logits within
the tolerance the page states, the greedy continuation), and the logit lens against the
library's `lens_grid`. Then the faults, each one line and the page still working, the tokenizer's
ids on awkward text, the sampler's kept set against the library's, Run pressed on the page and
what it shows, and every request made by the page and its workers: none leaves the origin."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from bench.serve import serve
from browser import Browser
from llmtrace_book import generate
from llmtrace_book.lens import lens_grid
from llmtrace_book.sampling import warp
from llmtrace_book.tokenize import display_piece

HTML = Path(__file__).resolve().parents[1] / "_build" / "html"
PAGE = "book/your_prompt.html"
WEB = "_static/web"
PROMPTS = {  # prompt: greedy tokens to compare
    "The capital of Germany is": 6,
    "Ünïcödé façade — 東京, Москва 🤖🇫🇷   runs of  spaces\n\nand 1234 digits:": 3,
    "<|im_start|>user\nWhat is the tallest mountain?<|im_end|>\n<|im_start|>assistant\n": 3,
}
TOKENIZER_STRINGS = [
    "The capital of France is", "naïve café, Ünïcödé — 東京, Москва, ελληνικά",
    "emoji 🤖🇫🇷👍🏽 and a family 👨‍👩‍👧", "runs   of    spaces     and\ttabs ",
    "new\nlines\n\n\nand\r\nCRLF", "digits 1234567890, 3.14159 and 2026-12-01",
    "<|im_start|>user\nHi<|im_end|>", " leading and trailing  ", "x",
]


def manifest() -> dict:
    """The built book's web.json: the page's files, their sizes and hashes."""
    return json.loads((HTML / WEB / "web.json").read_text())


MISSING = "model.onnx.data.001"  # removed before the page opens, put back before the first run


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The built book, hard-linked into a temporary directory, with one weight chunk removed."""
    web = HTML / WEB / "web.json"
    assert web.is_file(), f"no model export in the built book ({web}): run `make book`"
    assert MISSING in [c["file"] for c in manifest()["chunks"]]
    root = tmp_path_factory.mktemp("site") / "html"
    shutil.copytree(HTML, root, copy_function=link)
    (root / WEB / MISSING).unlink()
    return root


def link(src, dst) -> None:
    """A hard link (a copy where the temporary directory is on another file system)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


@pytest.fixture(scope="module")
def page(site):
    """The page, opened once: (browser, server url, what it said before the first run)."""
    browser = Browser()
    with serve(site, isolated=False) as server:
        browser.goto(f"{server.url}/{PAGE}")
        failed = browser.js("llmtrace.ready.then(() => 'loaded', e => e.message)", timeout=120)
        shown = browser.js("document.getElementById('lt-error').textContent")
        yield browser, server.url, {"failed": failed, "shown": shown}
        browser.close()


def js(browser, expression: str, timeout: float = 180):
    """An expression's value, awaited, through JSON (typed arrays become lists)."""
    out = browser.js(f"""(async () => JSON.stringify(await ({expression}), (k, v) =>
        ArrayBuffer.isView(v) ? Array.from(v) : v))()""", timeout=timeout)
    return json.loads(out)


RUN = """llmtrace.run({prompt}, {{maxNewTokens: {n}}}).then(r => ({{
    ids: r.ids, pieces: r.pieces, records: r.records, top: r.top, logits: r.logits,
    generated: r.generated, timings: r.timings, model: r.model, weights: r.weights}}))"""


@pytest.fixture(scope="module")
def runs(page, site, embedded):
    """The chunk put back, then the three prompts run in the page (the first loads the model)."""
    browser, _, _ = page
    link(HTML / WEB / MISSING, site / WEB / MISSING)
    return {p: js(browser, RUN.format(prompt=json.dumps(p), n=n)) for p, n in PROMPTS.items()}


def test_a_missing_chunk_is_one_line_on_the_page(page):
    _, _, before = page
    line = before["failed"]
    assert f"weight chunk {MISSING} is missing from the book (HTTP 404)" in line, line
    assert "\n" not in line and "make book" in line
    assert before["shown"] == line  # the same line on the page


def test_after_the_chunk_is_back_the_next_run_works(runs, page):
    browser, _, _ = page
    first = runs[next(iter(PROMPTS))]
    assert first["timings"]["load_ms"] > 0 and len(first["records"]) > 100
    status = browser.js("document.getElementById('lt-status').textContent")
    assert status.startswith("ready:")
    # the line says in words which weights run and how closely; the figures are folded below
    stated = js(browser, "[llmtrace.info.model, llmtrace.info.weights, llmtrace.info.weights_in_"
                         "words, String(llmtrace.info.tolerance.logits)]")
    model, weights, in_words, tolerance = stated
    assert in_words and in_words != weights and "MatMulNBits" not in status
    assert status.startswith(f"ready: {model} runs in this page, {in_words}"), status
    assert f"to within {tolerance}" in status, status
    details = browser.js("[document.getElementById('lt-status-details').hidden, "
                         "document.getElementById('lt-status-details').open, "
                         "document.getElementById('lt-details').textContent]")
    assert details[:2] == [False, False], details  # shown, folded
    assert f"weights {weights}" in details[2] and f"within {tolerance} of the book's" in details[2]


@pytest.mark.parametrize("prompt", list(PROMPTS))
def test_the_page_computes_what_python_computes(runs, page, embedded, prompt):
    r = runs[prompt]
    tolerance = page[0].js("llmtrace.info.tolerance.logits")
    assert 0 < tolerance <= 1e-3
    ids = embedded.encode(prompt)[0].tolist()
    assert r["ids"] == ids
    assert r["pieces"] == [display_piece(embedded.tokenizer, i) for i in ids]

    logits, trace = embedded.run(prompt)
    assert [x["name"] for x in r["records"]] == [x.name for x in trace.records]
    assert [x["shape"] for x in r["records"]] == [list(x.shape) for x in trace.records]

    last = logits[0, -1]  # [V]
    page_logits = torch.tensor(r["logits"])
    assert page_logits.shape == last.shape
    assert float((page_logits - last).abs().max()) <= tolerance
    assert [t["id"] for t in r["top"]] == last.topk(10).indices.tolist()
    probs = torch.softmax(last.double(), -1)
    for t in r["top"]:
        assert abs(t["prob"] - float(probs[t["id"]])) < 1e-4
        assert t["piece"] == display_piece(embedded.tokenizer, t["id"])

    g = generate(embedded, prompt, max_new_tokens=PROMPTS[prompt], trace=False)
    assert r["generated"] == g.new_ids


@pytest.mark.parametrize("prompt", list(PROMPTS)[:2])  # all its positions, then the last few
def test_the_pages_logit_lens_is_the_librarys(page, runs, clicked, embedded, prompt):
    """The first prompt's lens is the one Run computed (`clicked`); the second's, longer than
    the positions the lens shows, is asked for."""
    browser = page[0]
    got = js(browser, "llmtrace.lens()" if prompt == clicked
             else f"llmtrace.run({json.dumps(prompt)}).then(() => llmtrace.lens())")
    _, trace = embedded.run(prompt)
    grid = lens_grid(embedded, trace)  # [L, T] each
    T, shown = grid.top_ids.shape[1], browser.js("llmtrace.info.lens.positions")
    assert got["positions"] == list(range(max(0, T - shown), T))
    assert got["ids"] == grid.top_ids[:, got["positions"]].tolist()
    probs = torch.tensor(got["probs"]) - grid.top_probs[:, got["positions"]]
    assert float(probs.abs().max()) < 1e-4
    assert got["pieces"][-1][-1] == display_piece(embedded.tokenizer, got["ids"][-1][-1])


def test_the_tokenizer_gives_pythons_ids(page, runs, embedded):
    browser = page[0]
    got = js(browser, f"Promise.all({json.dumps(TOKENIZER_STRINGS)}.map(llmtrace.encode))")
    assert got == [embedded.encode(s)[0].tolist() for s in TOKENIZER_STRINGS]


@pytest.mark.parametrize("temperature, top_k, top_p", [
    (0.7, 50, 0.9), (1.0, None, 0.5), (1.3, 5, None), (0.6, None, 0.97), (2.0, 1000, 0.99)])
def test_the_pages_sampler_keeps_what_the_library_keeps(page, runs, temperature, top_k, top_p):
    logits = runs[next(iter(PROMPTS))]["logits"]
    opts = json.dumps({"temperature": temperature, "topK": top_k, "topP": top_p})
    kept = js(page[0], f"llmtrace.warp({json.dumps(logits)}, {opts}).kept")
    python = warp(torch.tensor(logits), temperature, top_k, top_p)  # [V], 0 where not kept
    assert sorted(kept) == python.nonzero()[:, 0].tolist()
    assert all(logits[a] >= logits[b] for a, b in zip(kept, kept[1:]))  # most likely first


def test_a_sampled_continuation_follows_its_seed(page, runs):
    run = """llmtrace.run("Once upon a time", {{maxNewTokens: 3, temperature: 0.9, topK: 40,
        topP: 0.95, seed: {seed}}}).then(r => r.generated)"""
    a, b, c = (js(page[0], run.format(seed=s)) for s in (7, 7, 8))
    assert a == b and len(a) == 3
    assert a != c


@pytest.mark.parametrize("prompt, opts, line", [
    ("", {}, "the prompt is empty: type at least one character"),
    ("a" + " a" * 8190, {"maxNewTokens": 5},
     "8191 prompt tokens + 5 new ones exceed the model's context of 8192"),
    ("word " * 400, {}, "past this page's limit of 512.0 MB"),
    ("Hi", {"maxNewTokens": 21}, "maxNewTokens must be a whole number from 0 to 20, got 21"),
    ("Hi", {"topP": 0}, "topP must be in (0, 1]"),
    ("Hi", {"top_k": 3}, "unknown option top_k: the options are maxNewTokens"),
])
def test_bad_input_is_one_line_and_the_next_run_works(page, runs, prompt, opts, line):
    browser = page[0]
    got = js(browser, f"llmtrace.run({json.dumps(prompt)}, {json.dumps(opts)})"
                      ".then(() => 'ran', e => e.message)")
    assert line in got and "\n" not in got, got
    assert js(browser, 'llmtrace.run("Hi").then(r => r.ids.length)') == 1


@pytest.mark.parametrize("prompt, got", [
    ("{a: 1}", "an object"), ("{f: () => 1}", "an object"), ("42", "a number"),
    ("null", "null"), ("undefined", "undefined"), ('["Hi"]', "an array"),
])
def test_a_prompt_that_is_not_text_is_one_line(page, runs, prompt, got):
    """Refused by the page before anything is posted to the worker: posted, an object that
    cannot be cloned rejected with the browser's DOMException and its request stayed waiting
    (`llmtrace.waiting`, the requests the worker has not answered)."""
    browser = page[0]
    before = browser.js("llmtrace.waiting")
    lines = js(browser, f"""Promise.all([llmtrace.run({prompt}), llmtrace.encode({prompt})]
        .map(p => p.then(() => "ran", e => `${{e.constructor.name}}: ${{e.message}}`)))""")
    assert lines[0].startswith(f"Error: the prompt must be a string, got {got}: "), lines
    assert lines[1].startswith(f"Error: the text to encode must be a string, got {got}: "), lines
    assert not any("\n" in line for line in lines)
    assert before == 0 and browser.js("llmtrace.waiting") == before
    assert js(browser, 'llmtrace.run("Hi").then(r => r.ids.length)') == 1


@pytest.fixture(scope="module")
def clicked(page, runs):
    """Run pressed twice at once on the page, with the first prompt: the second press is
    refused, the first one's results (the lens too) are shown. -> the prompt."""
    prompt = next(iter(PROMPTS))
    page[2]["clicked"] = click_run(page[0], prompt, twice=True)
    return prompt


def test_a_second_run_while_one_is_going_is_refused(page, runs, clicked):
    browser = page[0]
    first, second = js(browser, """(async () => {
        const a = llmtrace.run("The capital of Italy is", {maxNewTokens: 2});
        const b = llmtrace.run("Hi").then(() => "ran", e => e.message);
        return [(await a).generated.length, await b];
    })()""")
    assert 1 <= first <= 2 and second.startswith("a run is already going")
    # the same by the button: the line on the page, and the first run's results in place
    refused, after = page[2]["clicked"]
    assert refused.startswith("a run is already going") and after == refused
    top = browser.js("document.querySelector('#lt-top tbody td:nth-child(2)').textContent")
    assert top == runs[clicked]["top"][0]["piece"].replace(" ", "␣")


def click_run(browser, prompt: str, twice: bool = False) -> list[str]:
    """Run pressed on the page (twice at once, if asked), until its results are shown: the
    error line just after the press, and at the end."""
    return js(browser, f"""(async () => {{
        const el = id => document.getElementById(id);
        el("lt-prompt").value = {json.dumps(prompt)};
        el("lt-max-new").value = "2";
        el("lt-run").click();
        if ({json.dumps(twice)}) el("lt-run").click();
        const line = el("lt-error").textContent;
        for (let i = 0; i < 1200 && !el("lt-status").textContent.startsWith("ready"); i++)
            await new Promise(r => setTimeout(r, 50));
        await new Promise(r => setTimeout(r, 500));  // plotly draws
        return [line, el("lt-error").textContent];
    }})()""")


def test_the_page_shows_the_trace(page, runs, clicked, embedded):
    """After a Run by the button: the tokens, the data flow folded by layer (one fold a layer,
    a row a record), a record's histogram, the logit lens and the attention pattern drawn by
    plotly.js; a new layer chosen redraws the attention; nothing wider than the window."""
    browser, prompt = page[0], clicked
    seen = js(browser, """(async () => {
        const el = id => document.getElementById(id);
        const drawn = id => el(id).querySelector(".main-svg") !== null;
        const before = el("lt-attn-plot").innerHTML;
        el("lt-attn-layer").value = el("lt-attn-layer").options[5].value;
        el("lt-attn-layer").dispatchEvent(new Event("change"));
        await new Promise(r => setTimeout(r, 500));
        return {tokens: el("lt-tokens").querySelectorAll("tbody tr").length,
                folds: el("lt-flow").querySelectorAll("details").length,
                rows: el("lt-flow").querySelectorAll("tbody tr").length,
                histogram: drawn("lt-record-plot"), attention: drawn("lt-attn-plot"),
                lens: drawn("lt-lens-plot"),
                redrawn: el("lt-attn-plot").innerHTML !== before,
                wide: document.documentElement.scrollWidth - innerWidth};
    })()""")
    n_records = len(runs[prompt]["records"])
    assert seen["tokens"] == len(embedded.encode(prompt)[0])
    assert seen["folds"] == embedded.config.n_layers and seen["rows"] == n_records
    assert seen["histogram"] and seen["attention"] and seen["lens"] and seen["redrawn"]
    assert seen["wide"] <= 0


def test_the_map_lights_the_chosen_record(page, runs, clicked):
    """Every record of the trace sits on the map's stages; a record chosen in the data flow
    lights its stage in its layer and links its chapter; a stage pressed opens its first
    record in that layer; a record outside the layers lights its stage outside the frame."""
    browser = page[0]
    names = [r["name"] for r in runs[clicked]["records"]]
    off_map = js(browser, f"""import(new URL("../_static/your_prompt/map.mjs", location.href)
        .href).then(m => {json.dumps(names)}.filter(n => m.stage_of(n) === null))""")
    assert off_map == []
    seen = js(browser, """(async () => {
        const el = id => document.getElementById(id);
        const wait = () => new Promise(r => setTimeout(r, 300));
        const lit = () => Array.from(el("lt-map").querySelectorAll(".lt-lit"),
                                     b => b.dataset.stage);
        const state = () => ({lit: lit(), record: el("lt-record-name").value,
            layer: el("lt-record-layer").value,
            frame: el("lt-map").querySelector(".lt-map-layer-title").textContent,
            link: el("lt-map-line").querySelector("a")?.getAttribute("href") ?? null});
        Array.from(el("lt-flow").querySelectorAll("a"))
            .find(a => a.textContent === "layers.3.attn.rope_q").click();
        await wait();
        const from_flow = state();
        el("lt-map").querySelector(".lt-map-layer [data-stage=mlp]").click();
        await wait();
        const from_map = state();
        el("lt-map").querySelector("[data-stage=lm_head]").click();
        await wait();
        return [from_flow, from_map, state()];
    })()""")
    flow, mapped, head = seen
    assert flow["lit"] == ["rope"] and flow["record"] == "layers.3.attn.rope_q", flow
    assert flow["frame"].startswith("layer 3 (of 30") and flow["link"].endswith("06_rope.html")
    assert (HTML / "notebooks" / "06_rope.html").is_file()
    assert mapped["lit"] == ["mlp"] and mapped["record"] == "layers.3.mlp.gate", mapped
    assert mapped["link"].endswith("07_ffn.html") and mapped["layer"] == "layer 3"
    assert head["lit"] == ["lm_head"] and head["record"] == "lm_head", head
    assert head["layer"] == "outside the layers" and head["link"].endswith("09_lm_head.html")


def test_every_view_links_the_chapter_that_teaches_it(page, runs):
    """Each section of the page links at least one chapter, and every chapter it links exists."""
    sections = js(page[0], """Array.from(document.querySelectorAll("section"))
        .filter(s => s.querySelector(":scope > h2")).map(s => [
            s.querySelector(":scope > h2").textContent.replace("#", "").trim(),
            Array.from(s.querySelectorAll("a[href*='notebooks/']"), a => a.getAttribute("href")
                .split("#")[0])])""")
    assert len(sections) >= 8, sections
    for title, links in sections:
        assert links, f"the section {title!r} links no chapter"
        for href in links:
            assert (HTML / "book" / href).resolve().is_file(), (title, href)


# --- the lab: chapter 14's interventions in the page -----------------------------------------

CLEAN, CORRUPT = "The capital of France is", "The capital of Germany is"


def lab_reference(embedded):
    """The pair's clean and corrupted runs in Python: ids, traces, answers, m."""
    from llmtrace_book import Trace

    names = ["layers.*.attn.weighted_sum", "layers.*.resid_out", "embed"]
    ids, other = embedded.encode(CLEAN), embedded.encode(CORRUPT)
    traces = [Trace(names=names), Trace(names=names)]
    last = [embedded.forward(x, t)[0, -1] for x, t in zip((ids, other), traces)]
    a, b = int(last[0].argmax()), int(last[1].argmax())
    return ids, other, traces, (a, b), [float(x[a] - x[b]) for x in last], last


def test_the_pages_interventions_are_the_librarys(page, runs, embedded):
    """One head patched from the clean run into the corrupted one (denoising), the same head
    noised, an MLP zero-ablated and a pattern made uniform: the page's m and normalized effect
    against `Patched` in Python; and no intervention against the page's own run."""
    from llmtrace_book.trace import Patched

    browser = page[0]
    tolerance = browser.js("llmtrace.info.tolerance.logits")
    ids, other, traces, (a, b), (m_clean, m_corr), last = lab_reference(embedded)
    T = ids.shape[1]
    name = "layers.23.attn.weighted_sum"
    call = "llmtrace.intervene({{prompt: {p}, other: {o}, direction: {d}, interventions: {x}}})"

    def page_run(direction, interventions):
        return js(browser, call.format(p=json.dumps(CLEAN), o=json.dumps(CORRUPT),
                                       d=json.dumps(direction), x=json.dumps(interventions)))

    def put_head(source):
        def fn(t):
            t = t.clone()
            t[:, 4, -1] = source[name][0, 4, -1]
            return t
        return fn

    none = page_run("denoise", [])
    assert none["answers"] == [a, b] and abs(none["normalized"]) < 1e-3
    assert float((torch.tensor(none["logits"]) - last[1]).abs().max()) <= tolerance
    head = [{"kind": "heads", "layer": 23, "head": 4, "position": T - 1, "source": "other"}]
    cases = [("denoise", head, other, {name: put_head(traces[0])}),
             ("noise", head, ids, {name: put_head(traces[1])}),
             ("denoise", [{"kind": "mlp", "layer": 29, "source": "zero"}], other,
              {"layers.29.mlp.down": lambda t: torch.zeros_like(t)}),
             # the patched run's own mean over the positions, in the clean run
             ("noise", [{"kind": "heads", "layer": 23, "head": 4, "source": "mean"}], ids,
              {name: lambda t: torch.cat([t[:, :4], t[:, 4:5].mean(2, keepdim=True)
                                          .expand(-1, -1, T, -1), t[:, 5:]], dim=1)}),
             ("denoise", [{"kind": "pattern", "layer": 23, "head": 4, "source": "uniform"}],
              other, {"layers.23.attn.weights": lambda t: torch.cat(
                  [t[:, :4], (torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None])
                   .expand(1, 1, T, T), t[:, 5:]], dim=1)})]
    for direction, interventions, run_ids, patch in cases:
        got = page_run(direction, interventions)
        want = embedded.forward(run_ids, Patched(patch))[0, -1]
        m = float(want[a] - want[b])
        assert abs(got["m"] - m) < 1e-3, (direction, interventions)
        effect = (m_clean - m) / (m_clean - m_corr) if direction == "noise" else \
            (m - m_corr) / (m_clean - m_corr)
        assert abs(got["normalized"] - effect) < 1e-3
        assert [t["id"] for t in got["top"][:3]] == want.topk(3).indices.tolist()


def test_the_pages_sweeps_are_the_librarys(page, runs, embedded):
    """The residual stream by layer and position, and the heads by layer and head at the last
    position, each run patched alone, against the library's batched `Patched` runs."""
    from llmtrace_book.trace import Patched

    browser = page[0]
    ids, other, traces, (a, b), (m_clean, m_corr), _ = lab_reference(embedded)
    c = embedded.config
    T, L, H = ids.shape[1], c.n_layers, c.n_heads
    streams = ["embed"] + [f"layers.{l}.resid_out" for l in range(L - 1)]
    sweep = "llmtrace.sweep({{prompt: {p}, other: {o}, kind: {k}, position: {pos}}})"
    for kind, cols in [("resid", T), ("heads", H)]:
        got = js(browser, sweep.format(p=json.dumps(CLEAN), o=json.dumps(CORRUPT),
                                       k=json.dumps(kind), pos=T - 1), timeout=300)
        assert (got["rows"], got["cols"]) == (L, cols) and got["direction"] == "denoise"
        rows = [(l, j) for l in range(L) for j in range(cols)]
        patch = {}
        for l in range(L):
            def put(t, l=l):
                t = t.clone()
                for r, (m, j) in enumerate(rows):
                    if m != l:
                        continue
                    if kind == "resid":
                        t[r, j] = traces[0][streams[l]][0, j]
                    else:
                        t[r, j, -1] = traces[0][f"layers.{l}.attn.weighted_sum"][0, j, -1]
                return t
            patch[streams[l] if kind == "resid" else f"layers.{l}.attn.weighted_sum"] = put
        want = embedded.forward(other.expand(len(rows), -1), Patched(patch))[:, -1]
        effect = (want[:, a] - want[:, b] - m_corr) / (m_clean - m_corr)
        assert float((torch.tensor(got["values"]) - effect).abs().max()) < 1e-3, kind


@pytest.mark.parametrize("options, line", [
    ({"prompt": CLEAN, "other": "The capital of the United Kingdom is"}, "as many tokens"),
    ({"prompt": CLEAN, "other": CORRUPT, "answers": [" Paris is", " Berlin"]}, "not one"),
    ({"prompt": CLEAN, "other": CORRUPT, "interventions": [
        {"kind": "heads", "layer": 99, "head": 0}]}, "layer 99 is out of range"),
    ({"prompt": CLEAN, "other": CORRUPT, "interventions": [
        {"kind": "heads", "layer": 0, "head": 9}]}, "head 9 is out of range"),
    ({"prompt": CLEAN, "other": CORRUPT, "direction": "sideways"}, "not \"sideways\""),
    ({"prompt": CLEAN, "other": CORRUPT, "interventions": [{"kind": "neurons", "layer": 0}]},
     "not neurons"),
])
def test_bad_lab_input_is_one_line_and_the_next_call_works(page, runs, options, line):
    browser = page[0]
    got = browser.js(f"llmtrace.intervene({json.dumps(options)}).then(() => 'ran', "
                     "e => e.message)", timeout=120)
    assert line in got and "\n" not in got, got
    again = js(browser, f"llmtrace.intervene({json.dumps({'prompt': CLEAN, 'other': CORRUPT})})")
    assert abs(again["normalized"]) < 1e-3


def test_a_second_sweep_while_one_runs_is_refused(page, runs):
    browser = page[0]
    got = browser.js(f"""(async () => {{
        const one = llmtrace.sweep({{prompt: {json.dumps(CLEAN)}, other: {json.dumps(CORRUPT)}}});
        const two = await llmtrace.sweep({{prompt: {json.dumps(CLEAN)},
                                          other: {json.dumps(CORRUPT)}}})
            .then(() => "ran", e => e.message);
        await one;
        return two;
    }})()""", timeout=300)
    assert "one thing at a time" in got.lower() or "already" in got.lower(), got


def test_the_lab_on_the_page_intervenes_and_sweeps(page, runs, clicked, embedded):
    """The lab's own controls: Intervene with the defaults (head 23.4's output, denoising)
    says the normalized effect; Sweep draws the layer-by-head heatmap, its direction in the
    title; the record is chosen by layer, then name; a sink is named where a head has one."""
    browser = page[0]
    browser.js("document.getElementById('lt-lab-run').click()")
    text = browser.js("""new Promise(done => { const t = setInterval(() => {
        const s = document.getElementById('lt-lab-result').textContent;
        if (s) { clearInterval(t); done(s); } }, 100); })""", timeout=120)
    assert "normalized" in text and "restored (0: the corrupted run" in text, text
    browser.js("document.getElementById('lt-lab-sweep-kind').value = 'heads';"
               "document.getElementById('lt-lab-sweep').click()")
    title = browser.js("""new Promise(done => { const t = setInterval(() => {
        const p = document.getElementById('lt-lab-plot');
        if (p.data && p.data.length) { clearInterval(t); done(p.layout.title.text); } }, 200);
        })""", timeout=300)
    assert "denoising" in title and "each head's output" in title, title
    shape = browser.js("(() => { const z = document.getElementById('lt-lab-plot').data[0].z;"
                       " return [z.length, z[0].length]; })()")
    assert shape == [30, 9]
    layers = browser.js("Array.from(document.getElementById('lt-record-layer').options, "
                        "o => o.value)")
    assert layers[0] == "outside the layers" and layers[1:3] == ["layer 0", "layer 1"]
    # a head with a sink on the shown prompt, found in Python, is named on the page
    _, trace = embedded.run(clicked)
    w = torch.stack([trace[f"layers.{l}.attn.weights"][0] for l in range(30)])  # [L, H, T, T]
    on_first = w[:, :, 1:, 0].mean(-1)  # [L, H]
    l, h = divmod(int(on_first.flatten().argmax()), w.shape[1])
    assert on_first[l, h] > 0.5
    browser.js(f"document.getElementById('lt-attn-layer').value = '{l}';"
               f"document.getElementById('lt-attn-head').value = '{h}';"
               "document.getElementById('lt-attn-layer').dispatchEvent(new Event('change'))")
    note = browser.js("""new Promise(done => setTimeout(() =>
        done(document.getElementById('lt-attn-note').textContent), 500))""")
    assert "attention sink" in note and f"{float(on_first[l, h]):.2f}" in note, note


@pytest.mark.parametrize("change, line", [
    ("cut", "weight chunk {file} is cut short: 1000000 of {size} bytes"),
    ("alter", "weight chunk {file} was altered: its SHA-256 is"),
])
def test_a_cut_or_altered_chunk_is_one_line(page, runs, site, change, line):
    """A fresh copy of the page's worker loads from a chunk cut short or altered (a copy in
    place of the hard link); the page's own model goes on working."""
    browser = page[0]
    first = manifest()["chunks"][0]
    line = line.format(**first)
    chunk = site / WEB / first["file"]
    data = (HTML / WEB / chunk.name).read_bytes()[: 1_000_000 if change == "cut" else None]
    chunk.unlink()
    chunk.write_bytes(data if change == "cut" else bytes([data[0] ^ 1]) + data[1:])
    try:
        got = js(browser, """new Promise(done => {
            const w = new Worker("../_static/your_prompt/worker.mjs", {type: "module"});
            w.onmessage = e => { if (e.data.id) { w.terminate(); done(e.data.error); } };
            w.postMessage({id: 1, kind: "load"});
        })""")
    finally:
        chunk.unlink()
        link(HTML / WEB / chunk.name, chunk)
    assert got.startswith(line) and "\n" not in got, got
    assert js(browser, 'llmtrace.run("Hi").then(r => r.ids.length)') == 1


def test_no_request_leaves_the_origin(page, runs):
    browser, url, _ = page
    seen = browser.requests()
    assert any(u.endswith("/ort-wasm-simd-threaded.wasm") for u in seen)
    assert any(u.endswith(f"/{MISSING}") for u in seen)  # the worker's requests are seen
    outside = [u for u in seen if not u.startswith((url + "/", "data:", "blob:"))]
    assert not outside, outside


def test_a_form_of_weights_the_page_lacks_is_refused_by_name(page, runs):
    browser, url, _ = page
    browser.goto(f"{url}/{PAGE}?weights=fp64")
    got = browser.js("llmtrace.ready.then(() => 'loaded', e => e.message)")
    assert got.startswith("weights=fp64 in the page's address is not a form this page has: "
                          "use weights=fp32"), got


def test_without_webassembly_the_page_says_so(page, runs):
    """Last: the page again, in a browser whose pages have no WebAssembly."""
    browser, url, _ = page
    browser.call("Page.addScriptToEvaluateOnNewDocument", session=True,
                 source="delete globalThis.WebAssembly")
    browser.goto(f"{url}/{PAGE}")
    got = browser.js("llmtrace.ready.then(() => 'loaded', e => e.message)")
    assert got.startswith("this browser has no WebAssembly, which runs the model")
    assert browser.js("document.getElementById('lt-error').textContent") == got


def test_opened_from_a_file_the_page_says_to_serve_it(page, runs, site):
    """Opened from disk, where browsers load no module and no WebAssembly: one line says how to
    serve the book."""
    browser = page[0]
    browser.goto((site / PAGE).as_uri())
    got = browser.js("document.getElementById('lt-error').textContent")
    assert got.startswith("this page runs the model with WebAssembly, which browsers do not load "
                          "from file:// pages: serve the book with `make serve`"), got

