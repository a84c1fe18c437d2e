// The page "Your own prompt" (book/your_prompt.md): a text box and Run; the model runs in a Web
// Worker (worker.mjs), and this module shows what its graphs returned: the tokens, the data
// flow, any record, the next token, the continuation, the logit lens, the attention of any layer
// and head. It also defines `window.llmtrace`, the same runs for tests and for a reader's own
// experiments:
//
//   await llmtrace.ready                      // the model loaded (a Promise)
//   const r = await llmtrace.run("The capital of Germany is", {maxNewTokens: 5})
//   r.top[0].piece, r.records.length, r.value("layers.3.attn.weights")
//   await llmtrace.lens()                     // the last run's logit lens
//   llmtrace.waiting                          // requests the worker has yet to answer
//
// Every fault ends as one line on the page (and a rejected Promise with that line as message).

import { draw_map } from "./map.mjs";
import { check_options, MAX_NEW_TOKENS, warp } from "./sampling.mjs";

const $ = id => document.getElementById(id);
// The form of the weights the address asks for: none (the export's own choice) or fp32.
const FORM = new URLSearchParams(location.search).get("weights");
const BUSY = "a run is already going: wait for it to end (its results replace these), " +
    "then press Run again";

let worker = null, next_id = 0, busy = false, info = null, load_ms = null, shown = null;
let chosen = null;  // the record the reader opened last (the embedding until then)
const waiting = new Map();

function show_error(line) {
    $("lt-error").textContent = line;
    $("lt-error").hidden = !line;
}

function show_status(line) { $("lt-status").textContent = line; }

function fmt(x, digits = 4) {
    if (!Number.isFinite(x) || Number.isInteger(x)) return String(x);
    return Math.abs(x) >= 1e4 || (x !== 0 && Math.abs(x) < 1e-3) ? x.toExponential(2)
        : x.toFixed(digits);
}

function mb(bytes) { return (bytes / 2 ** 20).toFixed(1) + " MB"; }

// What stops the page before any model file is fetched, as one line (or null).
function cannot_run() {
    if (location.protocol === "file:") {
        return "this page runs the model with WebAssembly, which browsers do not load from " +
            "file:// pages: serve the book with `make serve` and open " +
            "http://127.0.0.1:8000/book/your_prompt.html";
    }
    if (typeof WebAssembly !== "object") {
        return "this browser has no WebAssembly, which runs the model: open the page in a " +
            "browser that has it (any current Chrome, Firefox, Safari or Edge)";
    }
    if (FORM !== null && FORM !== "fp32") {
        return `weights=${FORM} in the page's address is not a form this page has: use ` +
            "weights=fp32, or no weights= for the export's own form";
    }
    if (typeof Worker !== "function") {
        return "this browser has no Web Workers, in which the model runs: open the page in a " +
            "current browser";
    }
    return null;
}

function start_worker() {
    const url = new URL("worker.mjs", import.meta.url);
    if (FORM) url.searchParams.set("weights", FORM);
    worker = new Worker(url, { type: "module" });
    worker.onmessage = e => {
        const m = e.data;
        if (m.kind === "progress") {
            const sweep = /^the sweep: (\d+) of (\d+) runs$/.exec(m.text);
            if (sweep) {  // the lab's sweep, pass by pass
                const bar = $("lt-lab-progress");
                bar.hidden = false;
                bar.max = Number(sweep[2]);
                bar.value = Number(sweep[1]);
                return show_status(m.text);
            }
            return show_status("loading " + m.text);
        }
        const w = waiting.get(m.id);
        waiting.delete(m.id);
        if (m.ok) w.resolve(m.result); else w.reject(new Error(m.error));
    };
    worker.onerror = e => {
        e.preventDefault();
        const line = `the model's worker stopped (${e.message || "no message"}): press Run ` +
            "to load the model again";
        for (const w of waiting.values()) w.reject(new Error(line));
        waiting.clear();
        worker = null;
        info = null;
    };
}

function ask(kind, fields = {}) {
    if (!worker) start_worker();
    const id = ++next_id;
    return new Promise((resolve, reject) => {
        // posted first: the answer comes in a later task, and a post that throws (a field the
        // browser cannot clone) leaves nothing waiting
        worker.postMessage({ id, kind, ...fields });
        waiting.set(id, { resolve, reject });
    });
}

// Text from the API refused here, before it is posted: an object the browser cannot clone
// would fail as its DOMException, one it can would reach the tokenizer.
function check_text(x, what, call) {
    if (typeof x === "string") return;
    const got = x === null || x === undefined ? String(x) : Array.isArray(x) ? "an array"
        : (/^[aeiou]/.test(typeof x) ? "an " : "a ") + typeof x;
    throw new Error(`${what} must be a string, got ${got}: call ${call}`);
}

function load() {
    const line = cannot_run();
    if (line) return Promise.reject(new Error(line));
    show_status("loading the model…");
    return ask("load").then(i => {
        info = i;
        load_ms ??= performance.now();  // since the page opened (its time origin)
        show_status(ready_line(i));
        $("lt-details").textContent = details_line(i);
        $("lt-status-details").hidden = false;
        show_form(i);
        return i;
    });
}

// A link to the page with the other form of the weights, if the export has one.
function show_form(i) {
    const el = $("lt-form");
    if (!i.other_form) return el.replaceChildren();
    const a = document.createElement("a");
    a.href = FORM === "fp32" ? location.pathname : location.pathname + "?weights=fp32";
    a.textContent = FORM === "fp32" ? "the export's own form instead" : "the fp32 weights instead";
    el.replaceChildren(document.createTextNode("Load "), a,
                       document.createTextNode(" (the page opens again)."));
}

// The status line in words: which model runs, in which weights, checked how; the details (the
// tolerance's figures, the download, the runtime, the limits) folded below it.
function ready_line(i) {
    const t = i.tolerance;
    const checked = t.logits !== undefined
        ? `; its logits match the book's PyTorch trace to within ${t.logits}` : "";
    return `ready: ${i.model} runs in this page, ${i.weights_in_words ?? "weights " + i.weights}` +
        `${checked}. The prompt goes no further than this tab.`;
}

function details_line(i) {
    const threads = i.threads === 1 ? "one thread (the page is not cross-origin isolated)"
        : `${i.threads} threads`;
    const t = i.tolerance;
    const measured = t.logits_measured !== undefined
        ? `, ${t.logits_measured.toExponential(1)} measured by the export` : "";
    const tol = t.logits !== undefined
        ? `; its logits lie within ${t.logits} of the book's${measured}` : "";
    return `weights ${i.weights}${tol}; ${mb(i.downloaded)} downloaded in ` +
        `${(load_ms / 1000).toFixed(1)} s; onnxruntime-web ${i.versions.onnxruntime_web} on ` +
        `${threads}; prompts up to ${i.longest_prompt} tokens (a whole trace within ` +
        `${mb(i.trace_limit)}, this page's memory limit)`;
}

// One thing at a time in the model's worker: a second one asked meanwhile is refused.
async function exclusive(fn) {
    if (busy) throw new Error(BUSY);
    busy = true;
    try {
        return await fn();
    } finally {
        busy = false;
        if (info) show_status(ready_line(info));
    }
}

async function run_now(prompt, opts) {
    check_text(prompt, "the prompt", 'llmtrace.run("your text", {maxNewTokens: 5})');
    check_options(opts);
    if (!info) {
        llmtrace.ready = load();
        await llmtrace.ready;
    }
    show_status("running…");
    const r = await ask("run", { prompt, opts });
    r.timings.load_ms = load_ms;
    r.value = name => r.values[name];
    return r;
}

function lens_now() {
    show_status("computing the logit lens…");
    return ask("lens");
}

const run = (prompt, opts = {}) => exclusive(() => run_now(prompt, opts));
const lens = () => exclusive(lens_now);

// The lab (chapter 14's interventions), in the worker: what it is asked is a plain object
async function lab_now(kind, options) {
    if (typeof options !== "object" || options === null || Array.isArray(options)) {
        throw new Error(`llmtrace.${kind} takes one object: {prompt, other, ...}`);
    }
    check_text(options.prompt, "the prompt", `llmtrace.${kind}({prompt: "your text", ...})`);
    check_text(options.other, "the other prompt", `llmtrace.${kind}({other: "text", ...})`);
    if (!info) {
        llmtrace.ready = load();
        await llmtrace.ready;
    }
    show_status(kind === "sweep" ? "sweeping…" : "running the intervention…");
    return ask(kind, { options: JSON.parse(JSON.stringify(options)) });
}

const intervene = options => exclusive(() => lab_now("intervene", options));
const sweep = options => exclusive(() => lab_now("sweep", options));

// --- what the page shows --------------------------------------------------------------------

function cell(tag, text, cls) {
    const el = document.createElement(tag);
    el.textContent = text;
    if (cls) el.className = cls;
    return el;
}

function table(head, rows) {
    const t = document.createElement("table");
    t.className = "lt-table";
    const tr = t.createTHead().insertRow();
    for (const h of head) tr.appendChild(cell("th", h));
    const body = t.createTBody();
    for (const row of rows) {
        const r = body.insertRow();
        for (const v of row) r.appendChild(v instanceof Node ? v : cell("td", String(v)));
    }
    return t;
}

function visible(piece) {  // a piece as text, its spaces and newlines made visible
    return JSON.stringify(piece).slice(1, -1).replace(/ /g, "␣");
}

function show_tokens(r) {
    const rows = r.ids.map((id, i) => [i, visible(r.pieces[i]), id]);
    $("lt-tokens").replaceChildren(table(["position", "piece", "id"], rows));
}

function show_top(r) {
    const rows = r.top.map((t, i) => [i + 1, visible(t.piece), t.id, t.prob.toFixed(4),
                                      t.logit.toFixed(3)]);
    $("lt-top").replaceChildren(
        cell("p", `The ${r.top.length} most likely next tokens after the last position ` +
                  "(softmax of its logits, the graph's output lm_head):"),
        table(["rank", "piece", "id", "probability", "logit"], rows));
}

function show_continuation(r, opts) {
    const how = !opts.temperature ? "greedy"
        : `sampled: temperature ${opts.temperature}, top-k ${opts.topK ?? "off"}, top-p ` +
          `${opts.topP ?? "off"}, seed ${opts.seed ?? 0}`;
    const el = $("lt-continuation");
    if (!r.generated.length) {
        el.replaceChildren(cell("p", "No continuation asked for (tokens to generate: 0)."));
        return;
    }
    el.replaceChildren(
        cell("p", `${r.generated.length} new tokens (${how}; stopped at ${r.stop_reason}), ` +
                  `in ${(r.timings.decode_ms / 1000).toFixed(2)} s:`),
        cell("p", r.generated_text, "lt-text"),
        table(["step", "piece", "id"],
              r.generated.map((id, i) => [i + 1, visible(r.generated_pieces[i]), id])));
}

const LAYER = /^layers\.(\d+)\.(.*)$/;

// The data flow, folded by layer: what comes before and after the layers in full, each layer
// a fold of its own (the first open). A row opens its record below.
function show_flow(r) {
    const el = $("lt-flow");
    el.replaceChildren();
    const shape = rec => "[" + rec.shape.join(", ") + "]";
    const row = rec => {
        const name = cell("td", "");
        const a = cell("a", rec.name);
        a.href = "#lt-record-section";
        a.onclick = () => show_record(shown, rec.name);
        name.appendChild(a);
        return [name, rec.op, shape(rec)];
    };
    let group = null, rows = [];
    const flush = () => {
        if (!rows.length) return;
        const t = table(["name", "operation", "shape"], rows);
        if (group === null) {
            el.appendChild(t);
        } else {
            const d = document.createElement("details");
            d.open = group === "0";
            const n = rows.length;
            d.appendChild(cell("summary", `layers.${group}: ${n} records, out ` +
                                          `${rows[n - 1][2]}`));
            d.appendChild(t);
            el.appendChild(d);
        }
        rows = [];
    };
    for (const rec of r.records) {
        const m = LAYER.exec(rec.name);
        const g = m ? m[1] : null;
        if (g !== group) { flush(); group = g; }
        rows.push(row(rec));
    }
    flush();
    if (!r.records.some(rec => rec.name === chosen)) chosen = r.records[1].name;
    const groups = ["outside the layers"];
    for (const rec of r.records) {
        const m = LAYER.exec(rec.name);
        if (m && !groups.includes(`layer ${m[1]}`)) groups.push(`layer ${m[1]}`);
    }
    $("lt-record-layer").replaceChildren(...groups.map(g => new Option(g, g)));
    $("lt-record-layer").value = group_of(chosen);
    fill_record_names(r, group_of(chosen));
}

function group_of(name) {
    const m = LAYER.exec(name);
    return m ? `layer ${m[1]}` : "outside the layers";
}

function fill_record_names(r, group) {
    const names = r.records.map(x => x.name).filter(n => group_of(n) === group);
    $("lt-record-name").replaceChildren(...names.map(n => new Option(n, n)));
    return names;
}

let plotly = null;
function with_plotly() {  // the book's own copy of plotly.js, loaded once
    plotly ??= new Promise((resolve, reject) => {
        if (window.Plotly) return resolve(window.Plotly);
        const root = document.documentElement.dataset.content_root ?? "../";
        const js = document.createElement("script");
        js.src = root + "_static/plotly.min.js";
        js.onload = () => resolve(window.Plotly);
        js.onerror = () => reject(new Error("plotly.js is missing from the book"));
        document.head.appendChild(js);
    });
    return plotly;
}

const FONT = { size: 12 };

async function show_record(r, name) {
    if (!r || !r.values[name]) return;
    chosen = name;
    if ($("lt-record-layer").value !== group_of(name)) {
        $("lt-record-layer").value = group_of(name);
        fill_record_names(r, group_of(name));
    }
    $("lt-record-name").value = name;
    draw_map($("lt-map"), r.records.map(x => x.name), name, n => show_record(shown, n));
    const rec = r.records.find(x => x.name === name);
    const v = r.values[name];
    let sq = 0, lo = Infinity, hi = -Infinity;
    for (const x of v) { sq += x * x; lo = Math.min(lo, x); hi = Math.max(hi, x); }
    const first = Array.from(v.subarray(0, 8), x => fmt(x)).join(", ");
    $("lt-record").replaceChildren(
        cell("p", `${name}: ${rec.op}; shape [${rec.shape.join(", ")}], ${v.length} values, ` +
                  `from ${fmt(lo)} to ${fmt(hi)}; norm (root of the sum of squares) ` +
                  fmt(Math.sqrt(sq))),
        cell("p", `first values: ${first}${v.length > 8 ? ", …" : ""}`, "lt-text"),
        cell("p", outlier_line(v)));
    try {
        const Plotly = await with_plotly();
        const finite = Array.from(v).filter(Number.isFinite);
        await Plotly.react("lt-record-plot", [{ type: "histogram", x: finite, nbinsx: 40,
                                                 marker: { color: "#8c6bb1" } }], {
            height: 260, margin: { l: 60, r: 10, t: 30, b: 45 }, font: FONT,
            title: { text: `${name}: its ${finite.length} finite values`, font: FONT },
            xaxis: { title: { text: "value" } },
            yaxis: { title: { text: "count (log scale)" }, type: "log" },
        }, { displaylogo: false, responsive: true });
    } catch (e) {
        show_error(e.message);
    }
}

// One line on the largest magnitude when it stands far from the typical one: a massive value
function outlier_line(v) {
    let big = 0, at = 0;
    const mags = [];
    for (let i = 0; i < v.length; i++) {
        const m = Math.abs(v[i]);
        if (!Number.isFinite(m)) continue;
        if (m > big) { big = m; at = i; }
        if (i % Math.max(1, Math.floor(v.length / 4096)) === 0) mags.push(m);
    }
    mags.sort((a, b) => a - b);
    const median = mags[Math.floor(mags.length / 2)] || 0;
    if (!(median > 0) || big < 100 * median) return "";
    return `Its largest magnitude, ${fmt(big)} at flat index ${at}, is ` +
        `${Math.round(big / median)} times the median one: a massive value, which the ` +
        "histogram's log scale keeps visible.";
}

function attention_layers(r) {
    return r.records.map(x => /^layers\.(\d+)\.attn\.weights$/.exec(x.name)).filter(Boolean)
        .map(m => Number(m[1]));
}

function show_attention_controls(r) {
    const layers = attention_layers(r);
    const sel = $("lt-attn-layer"), head = $("lt-attn-head");
    const keep = sel.value;
    sel.replaceChildren(...layers.map(l => new Option(`layer ${l}`, String(l))));
    if (layers.map(String).includes(keep)) sel.value = keep;
    const rec = r.records.find(x => x.name === `layers.${layers[0]}.attn.weights`);
    const H = rec ? rec.shape[1] : 0;
    const keep_h = head.value;
    head.replaceChildren(...Array.from({ length: H }, (_, h) => new Option(`head ${h}`, h)));
    if (keep_h !== "" && Number(keep_h) < H) head.value = keep_h;
}

async function show_attention(r) {
    if (!r) return;
    const layer = $("lt-attn-layer").value, h = Number($("lt-attn-head").value);
    const name = `layers.${layer}.attn.weights`;
    const rec = r.records.find(x => x.name === name);
    if (!rec || !r.values[name]) return;
    const [, H, T, S] = rec.shape;  // [1, heads, query, key]
    const v = r.values[name];
    const z = Array.from({ length: T }, (_, q) => Array.from(v.subarray((h * T + q) * S,
                                                                          (h * T + q + 1) * S)));
    const labels = r.pieces.map((p, i) => `${i}: ${visible(p)}`);
    let on_first = 0;  // the mean weight the later queries put on position 0
    for (let q = 1; q < T; q++) on_first += z[q][0] / (T - 1);
    const last = z[T - 1], best = last.indexOf(Math.max(...last));  // the query that answers
    const except = best !== 0 && T > 1
        ? ` The last query, the one the next token is read from, looks elsewhere: it gives ` +
          `${last[best].toFixed(2)} to ${labels[best]}.` : "";
    $("lt-attn-note").textContent = T > 1 && on_first > 0.5
        ? `This head puts ${on_first.toFixed(2)} of its weight, on average over the queries ` +
          "after the first, on position 0: an attention sink, a place to put weight that " +
          `carries little (where the answer comes from, chapter 14, measures one).${except}`
        : "";
    try {
        const Plotly = await with_plotly();
        await Plotly.react("lt-attn-plot", [{
            type: "heatmap", z, x: labels, y: labels, colorscale: "Viridis", zmin: 0, zmax: 1,
            hovertemplate: "query %{y}<br>key %{x}<br>weight %{z:.4f}<extra></extra>",
            colorbar: { title: { text: "weight" } },
        }], {
            height: Math.min(620, 220 + 22 * T), font: FONT,
            margin: { l: 120, r: 10, t: 35, b: 120 },
            title: { text: `${name}, head ${h} of ${H}: each query's weights over the keys`,
                     font: FONT },
            xaxis: { title: { text: "key (attended to)" }, tickangle: -45 },
            yaxis: { title: { text: "query" }, autorange: "reversed" },
        }, { displaylogo: false, responsive: true });
    } catch (e) {
        show_error(e.message);
    }
}

// The logit lens: after each layer (a row), at each position (a column), the most likely next
// token and its probability, from the export's lens graph on the run's residual streams.
async function show_lens(r, l) {
    const el = $("lt-lens");
    const P = l.positions.length;
    const part = l.first > 0 ? `the last ${P} of the prompt's ${r.ids.length} positions`
        : `all ${P} positions`;
    el.replaceChildren(cell("p", `After each layer, at ${part}: the most likely next token ` +
        `and its probability (computed in ${(l.lens_ms / 1000).toFixed(2)} s).`));
    const labels = l.positions.map(i => `${i}: ${visible(r.pieces[i])}`);
    const layers = l.ids.map((_, i) => `layer ${i}`);
    try {
        const Plotly = await with_plotly();
        await Plotly.react("lt-lens-plot", [{
            type: "heatmap", z: l.probs, x: labels, y: layers, colorscale: "Blues",
            reversescale: true,  // the likelier, the darker
            zmin: 0, zmax: 1, text: l.pieces.map(row => row.map(visible)),
            texttemplate: "%{text}", textfont: { size: 12 },
            hovertemplate: "%{y}, position %{x}<br>top token %{text}<br>p %{z:.4f}<extra></extra>",
            colorbar: { title: { text: "p" } },
        }], {
            height: 160 + 20 * layers.length, font: FONT,
            margin: { l: 70, r: 10, t: 35, b: 110 },
            title: { text: "the logit lens: the top token after each layer", font: FONT },
            xaxis: { title: { text: "position (its piece)" }, tickangle: -30 },
            yaxis: { title: { text: "layer" }, autorange: "reversed" },
        }, { displaylogo: false, responsive: true });
    } catch (e) {
        show_error(e.message);
    }
}

function no_lens() {
    $("lt-lens").replaceChildren(cell("p", "This export has no logit lens graph, so the page " +
        "does not show the lens; rebuild the book's model files with `make book`."));
}

function show(r, opts) {
    shown = r;
    show_tokens(r);
    show_top(r);
    show_continuation(r, opts);
    show_flow(r);
    show_attention_controls(r);
    $("lt-lens").replaceChildren(cell("p", info.lens ? "computing the logit lens…" : ""));
    if (!info.lens) no_lens();
    const t = r.timings;
    $("lt-timing").textContent = `The whole trace (${r.records.length} records) took ` +
        `${(t.prefill_ms / 1000).toFixed(2)} s in this page; ${r.model}, weights ${r.weights}.`;
    return Promise.all([show_record(r, chosen), show_attention(r)]);
}

// The options as the form holds them, each refused by name if it is not a number.
function form_options() {
    const num = (id, label, blank = null) => {
        const s = $(id).value.trim();
        if (s === "") return blank;
        const x = Number(s);
        if (!Number.isFinite(x)) throw new Error(`${label} must be a number, got "${s}"`);
        return x;
    };
    return {
        maxNewTokens: num("lt-max-new", "tokens to generate", 0),
        temperature: num("lt-temperature", "temperature", 0),
        topK: num("lt-top-k", "top-k"), topP: num("lt-top-p", "top-p"),
        seed: num("lt-seed", "seed", 0),
    };
}

async function on_run() {
    if (busy) return show_error(BUSY);
    show_error("");
    if (shown) shown.values = {};  // the last trace's values go before the next one comes
    let opts;
    try {
        opts = form_options();
        await exclusive(async () => {
            const r = await run_now($("lt-prompt").value, opts);
            await show(r, opts);
            if (info.lens) await show_lens(r, await lens_now());
        });
    } catch (e) {
        show_error(e.message);
        if (!info) show_status("the model is not loaded: press Run to try again");
    }
}

// --- the lab on the page -------------------------------------------------------------------

function lab_options() {
    const answers = [$("lt-lab-a").value, $("lt-lab-b").value];
    const o = { prompt: $("lt-lab-clean").value, other: $("lt-lab-other").value,
                direction: $("lt-lab-direction").value };
    if (answers.some(a => a !== "")) {
        if (answers.some(a => a === "")) {
            throw new Error("give both answers, or neither (each prompt's top token)");
        }
        o.answers = answers;
    }
    return o;
}

function lab_site() {
    const int = (id, what) => {
        const s = $(id).value.trim();
        if (!/^\d+$/.test(s)) throw new Error(`${what} must be a whole number, got "${s}"`);
        return Number(s);
    };
    const kind = $("lt-lab-kind").value;
    const site = { kind, layer: int("lt-lab-layer", "the layer"), source: $("lt-lab-source").value };
    if (kind === "heads" || kind === "pattern") site.head = int("lt-lab-head", "the head");
    const pos = $("lt-lab-position").value.trim();
    site.position = pos === "" || pos === "all" ? "all" : int("lt-lab-position", "the position");
    return site;
}

function effect_words(direction) {
    return direction === "noise" ? "removed (0: the clean run, 1: the corrupted one)"
        : "restored (0: the corrupted run, 1: the clean one)";
}

// An ablation (zero, mean, uniform) is measured in the clean run, as chapter 14 measures it:
// the direction is noising, whatever the menu says; only the other run's value can denoise
function lab_direction() {
    const ablation = $("lt-lab-source").value !== "other";
    $("lt-lab-direction").disabled = ablation;
    if (ablation) $("lt-lab-direction").value = "noise";
}

function site_words(s) {
    const at = s.position === "all" ? "every position" : `position ${s.position}`;
    const what = { heads: `head ${s.layer}.${s.head}'s output`,
                   pattern: `head ${s.layer}.${s.head}'s pattern`,
                   mlp: `layer ${s.layer}'s MLP`, resid: `the stream into layer ${s.layer}` };
    const value = { other: "the other run's value", zero: "zero", mean: "its mean over the positions",
                    uniform: "uniform" };
    return `${what[s.kind]}, at ${at}, set to ${value[s.source]}`;
}

async function on_lab_run() {
    if (busy) return show_error(BUSY);
    show_error("");
    try {
        lab_direction();
        const site = lab_site();
        const o = { ...lab_options(), interventions: [site] };
        $("lt-lab-result").replaceChildren();
        const r = await intervene(o);
        const rows = r.top.map((t, i) => [i + 1, visible(t.piece), t.id, t.prob.toFixed(4)]);
        $("lt-lab-result").replaceChildren(
            cell("p", `${site_words(site)}, in the ${r.direction === "noise" ? "clean" : "corrupted"} ` +
                      `run. Answers ${visible(r.answer_pieces[0])} against ` +
                      `${visible(r.answer_pieces[1])}: their logit difference is ${fmt(r.m)} ` +
                      `(clean ${fmt(r.m_clean)}, corrupted ${fmt(r.m_corrupt)}); normalized, ` +
                      `${r.normalized.toFixed(3)} ${effect_words(r.direction)}.`),
            table(["rank", "piece", "id", "probability"], rows));
    } catch (e) {
        show_error(e.message);
    }
}

async function on_lab_sweep() {
    if (busy) return show_error(BUSY);
    show_error("");
    const bar = $("lt-lab-progress");
    try {
        const kind = $("lt-lab-sweep-kind").value;
        const pos = $("lt-lab-position").value.trim();
        const at = kind === "heads" && pos !== "" && pos !== "all" ? Number(pos) : "all";
        const r = await sweep({ ...lab_options(), kind, ...(kind === "heads" ? { position: at } : {}) });
        const ids = await ask("encode", { text: $("lt-lab-clean").value });
        const cols = kind === "resid"
            ? ids.map((_, i) => `position ${i}`) : Array.from({ length: r.cols }, (_, h) => `head ${h}`);
        const z = Array.from({ length: r.rows }, (_, l) => r.values.slice(l * r.cols, (l + 1) * r.cols));
        const Plotly = await with_plotly();
        await Plotly.react("lt-lab-plot", [{
            type: "heatmap", z, x: cols, y: z.map((_, l) => `layer ${l}`), colorscale: "RdBu",
            zmid: 0, hovertemplate: "%{y}, %{x}<br>effect %{z:.3f}<extra></extra>",
            colorbar: { title: { text: "effect" } },
        }], {
            height: 160 + 18 * r.rows, font: FONT, margin: { l: 70, r: 10, t: 80, b: 80 },
            title: { text: `${kind === "resid" ? "the stream into each layer" : "each head's output"}` +
                           `${kind === "heads" ? (at === "all" ? " at every position" : ` at position ${at}`) : ""}` +
                           `, the other run's value, ${r.direction === "noise" ? "noising" : "denoising"}` +
                           `:<br>the effect ${effect_words(r.direction)}`, font: FONT, x: 0.01, xanchor: "left" },
            xaxis: { title: { text: kind === "resid" ? "position patched" : "head patched" } },
            yaxis: { title: { text: "layer" }, autorange: "reversed" },
        }, { displaylogo: false, responsive: true });
    } catch (e) {
        show_error(e.message);
    } finally {
        bar.hidden = true;
    }
}

function setup() {
    $("lt-max-new").max = MAX_NEW_TOKENS;
    $("lt-max-new-limit").textContent = String(MAX_NEW_TOKENS);
    $("lt-run").onclick = on_run;
    $("lt-prompt").addEventListener("keydown", e => {
        if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) on_run();
    });
    $("lt-record-name").onchange = () => show_record(shown, $("lt-record-name").value);
    $("lt-record-layer").onchange = () => {
        if (!shown) return;
        const names = fill_record_names(shown, $("lt-record-layer").value);
        if (names.length) show_record(shown, names[0]);
    };
    $("lt-lab-run").onclick = on_lab_run;
    $("lt-lab-source").onchange = lab_direction;
    $("lt-lab-sweep").onclick = on_lab_sweep;
    $("lt-attn-layer").onchange = () => show_attention(shown);
    $("lt-attn-head").onchange = () => show_attention(shown);
    llmtrace.ready = load();
    llmtrace.ready.catch(e => {
        show_error(e.message);
        show_status(cannot_run() ? "the model cannot run here"
            : "the model is not loaded: press Run to try again");
    });
}

// the API: `ready` is replaced by a new load when a Run follows a failed one
const llmtrace = window.llmtrace = {
    ready: null, run,
    intervene,  // -> one run with interventions: {m, normalized, top, logits, ...}
    sweep,  // -> every site of a kind patched alone: {rows, cols, values (normalized), ...}
    lens,  // -> the last run's logit lens: {positions, ids, probs, pieces} [layer][position]
    encode: async text => {  // -> the prompt's ids (no model needed)
        check_text(text, "the text to encode", 'llmtrace.encode("your text")');
        return ask("encode", { text });
    },
    warp: (logits, opts) => {  // logits [V] -> {probs [V], kept ids}, as a run samples them
        const p = warp(Float32Array.from(logits), check_options(opts));
        return { probs: p, kept: p.kept };
    },
    get info() { return info; },  // what the page loaded: model, weights, tolerance, limits
    get waiting() { return waiting.size; },  // requests the worker has yet to answer
};
setup();
