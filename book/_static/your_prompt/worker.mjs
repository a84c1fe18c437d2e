// The model of the page "Your own prompt", in a Web Worker so that the page never freezes while
// the weights load or a pass runs. It reads only the book's own files: the export's manifest
// (web.json), the tokenizer (tokenizer.json, read by Tokenizers.js), the ONNX graph and its weight
// chunks (each checked by size and SHA-256), and onnxruntime-web's WebAssembly build. Every number
// it returns comes out of the graph's outputs: the graph returns every record of the trace.
//
// Messages in: {id, kind: "load" | "encode" | "run" | "lens", ...}; out: {id, ok, result |
// error}, and {kind: "progress", text} while loading. An error is one line that says what was
// wrong and what to do, shown as it is by the page.

import * as ort from "../ort/ort.wasm.min.mjs";
import { Tokenizer } from "../tokenizers/tokenizers.min.mjs";
import { argmax, check_options, draw, mulberry32, top_tokens, warp } from "./sampling.mjs";

const WEB = new URL("../web/", import.meta.url);  // the export, copied into the built book
// which form of the weights: the export's own choice (web.json), or "fp32" (the manifest that
// web.json names under "fp32"), as the page's address asks (?weights=fp32)
const FORM = new URL(import.meta.url).searchParams.get("weights");
// The page's memory limit for one prompt's whole trace (every record's values, which the graph
// returns and the page keeps to show): past it a prompt is refused, before anything runs. A
// trace takes about twice its size while it is copied out of WebAssembly. Measured in headless
// Chromium: with the 4-bit blocks the tab holds 0.6 GB once loaded, and 1.6 GB after a trace at
// this limit (200 tokens), within 2 GB; with the fp32 weights it holds 1.6 GB once loaded, and
// its peak reaches 2.5 GB: each session (the pass, the decode step, the lens) holds its own copy
// of the weights it reads
const TRACE_LIMIT = 512 * 2 ** 20;

let manifest = null, tokenizer = null, session = null, info = null;
let lens_session = null;          // the logit lens's graph, if the export has one
let decode_session = null;        // one decode step reading the KV cache, if the export has one
let lab_session = null;           // the pass with interventions as inputs, if the export has one
const sources = new Map();        // prompt -> its ids, logits and the records the lab reads
let last_resid = null;            // the last run's layers.N.resid_out, stacked, for the lens
let last_lens = null;             // and its lens, once computed
// The lens reads the final norm and the head at every layer and position, which costs as much
// as the head of a pass over L times the positions: the page shows it for the last few
const LENS_POSITIONS = 8;
let weights = null;               // the concatenated chunks, until the session holds them
const verified = new Set();       // chunks already checked (a retry fetches only the others)
let loading = null;               // the load under way, if any
let failed_before = false;        // a load failed: the next one revalidates what it fetches
let downloaded = 0;               // bytes fetched from the book's origin
let trace_bytes = null;           // T -> the bytes of a whole trace of T tokens

class PageError extends Error {}  // a line for the reader, shown as it is

function fail(line) { throw new PageError(line); }

function progress(text) { postMessage({ kind: "progress", text }); }

function mb(bytes) { return (bytes / 2 ** 20).toFixed(1) + " MB"; }

async function fetch_ok(file, what, retry) {
    let r;
    try {
        r = await fetch(new URL(file, WEB), { cache: retry ? "reload" : "default" });
    } catch (e) {
        fail(`${what} ${file} could not be fetched (${e.message}): serve the book with ` +
             "`make serve` and reload the page");
    }
    if (r.status === 404) {
        fail(`${what} ${file} is missing from the book (HTTP 404): rebuild the book's model ` +
             "files with `make book`, or put the file back, then press Run");
    }
    if (!r.ok) fail(`${what} ${file} could not be fetched (HTTP ${r.status}): check the server`);
    return r;
}

async function fetch_json(file, what) {
    const r = await fetch_ok(file, what, false);
    const text = await r.text();
    downloaded += text.length;
    try {
        return JSON.parse(text);
    } catch (e) {
        fail(`${what} ${file} is not valid JSON (${e.message}): rebuild it with \`make book\``);
    }
}

function hex(buffer) {
    return Array.from(new Uint8Array(buffer), b => b.toString(16).padStart(2, "0")).join("");
}

// One file of the export into `into` (a Uint8Array of exactly the size web.json gives),
// streamed, then checked: its size, then its SHA-256.
async function fetch_checked(entry, into, what, retry) {
    const r = await fetch_ok(entry.file, what, retry);
    const reader = r.body.getReader();
    let got = 0;
    for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        if (got + value.length > into.length) {
            reader.cancel();
            fail(`${what} ${entry.file} is longer than web.json says (${entry.size} bytes): ` +
                 "it was altered; rebuild the book's model files with `make book`");
        }
        into.set(value, got);
        got += value.length;
        downloaded += value.length;
    }
    if (got !== entry.size) {
        fail(`${what} ${entry.file} is cut short: ${got} of ${entry.size} bytes; rebuild the ` +
             "book's model files with `make book`, or copy the file again, then press Run");
    }
    const sha = hex(await crypto.subtle.digest("SHA-256", into));
    if (sha !== entry.sha256) {
        fail(`${what} ${entry.file} was altered: its SHA-256 is ${sha.slice(0, 12)}…, web.json ` +
             `says ${entry.sha256.slice(0, 12)}…; rebuild the book's model files with ` +
             "`make book`");
    }
}

function check_manifest(m) {
    if (m.format !== 1) {
        fail(`web.json is in format ${m.format}, and this page reads format 1: rebuild the ` +
             "book with `make book`");
    }
    for (const key of ["graph", "chunks", "records", "config", "input", "logits", "tokenizer"]) {
        if (!(key in m)) fail(`web.json has no "${key}": rebuild it with \`make book\``);
    }
}

// The bytes of every output for a prompt of T tokens, read from the graph's own output shapes
// (a symbolic dimension is the sequence's length; web.json's shape where the graph gives none):
// what a pass returns, known before it runs.
function trace_bytes_of(meta) {
    const itemsize = { float32: 4, int64: 8, float16: 2, int32: 4 };
    const listed = new Map(manifest.records.map(r => [r.name, r.shape || []]));
    return T => meta.reduce((sum, o) => {
        const shape = o.shape.length ? o.shape : listed.get(o.name) || [];
        return sum + (itemsize[o.type] || 4) *
            shape.reduce((n, d) => n * (typeof d === "number" ? d : T), 1);
    }, 0);
}

// The longest prompt whose trace stays within the limit (its bytes grow with T).
function longest_prompt(bytes, context) {
    let lo = 0, hi = context;
    while (lo < hi) {
        const mid = Math.ceil((lo + hi) / 2);
        if (bytes(mid) <= TRACE_LIMIT) lo = mid; else hi = mid - 1;
    }
    return lo;
}

async function load_tokenizer() {
    const t = manifest.tokenizer;
    const file = typeof t === "string" ? t : t.file || "tokenizer.json";
    const json = await fetch_json(file, "the tokenizer");
    const config_file = (typeof t === "object" && t.config) || "tokenizer_config.json";
    let config = {};
    try {
        config = await fetch_json(config_file, "the tokenizer's config");
    } catch (e) {
        if (!(e instanceof PageError) || !e.message.includes("HTTP 404")) throw e;
    }
    tokenizer = new Tokenizer(json, config);
}

async function load_weights(retry) {
    const total = manifest.chunks.reduce((n, c) => n + c.size, 0);
    if (!weights) weights = new Uint8Array(total);
    let offset = 0, n = 0;
    for (const [i, chunk] of manifest.chunks.entries()) {
        const view = weights.subarray(offset, offset + chunk.size);
        offset += chunk.size;
        n += 1;
        if (verified.has(i)) continue;
        progress(`weights: chunk ${n} of ${manifest.chunks.length} (${mb(offset)} of ` +
                 `${mb(total)})`);
        await fetch_checked(chunk, view, "weight chunk", retry);
        verified.add(i);
    }
}

async function create(graph, what, path) {
    try {
        return await ort.InferenceSession.create(graph, {
            executionProviders: ["wasm"],
            externalData: [{ path, data: weights }],
        });
    } catch (e) {
        fail(`onnxruntime-web could not load ${what} (${String(e.message || e).split("\n")[0]}` +
             "): rebuild the book's model files with `make book`");
    }
}

async function load_session(retry) {
    const graph = new Uint8Array(manifest.graph.size);
    await fetch_checked(manifest.graph, graph, "the graph", retry);
    const lens = manifest.lens ? new Uint8Array(manifest.lens.graph.size) : null;
    if (lens) await fetch_checked(manifest.lens.graph, lens, "the logit lens's graph", retry);
    const step = manifest.decode ? new Uint8Array(manifest.decode.graph.size) : null;
    if (step) await fetch_checked(manifest.decode.graph, step, "the decode graph", retry);
    const lab = manifest.lab ? new Uint8Array(manifest.lab.graph.size) : null;
    if (lab) await fetch_checked(manifest.lab.graph, lab, "the lab's graph", retry);
    const isolated = self.crossOriginIsolated === true;
    ort.env.wasm.wasmPaths = new URL("../ort/", import.meta.url).href;
    ort.env.wasm.numThreads = isolated ? navigator.hardwareConcurrency : 1;
    ort.env.wasm.proxy = false;
    progress("the graph: compiling it for WebAssembly");
    const path = typeof manifest.external_data === "string" ? manifest.external_data
        : (manifest.external_data && manifest.external_data.file) || "model.onnx.data";
    const main = await create(graph, "the graph", path);
    // the lens's graph has no weights of its own: it reads the same external data
    // nor has the decode graph: its weights are the same bytes of the same data
    lens_session = lens ? await create(lens, "the logit lens's graph", path) : null;
    decode_session = step ? await create(step, "the decode graph", path) : null;
    lab_session = lab ? await create(lab, "the lab's graph", path) : null;
    session = main;
    weights = null;  // onnxruntime holds its own copy now
    const meta = session.outputMetadata.filter(o => o.isTensor);
    const bytes = trace_bytes_of(meta);
    const c = manifest.config;
    return {
        threads: ort.env.wasm.numThreads, isolated, bytes_for: bytes,
        longest: longest_prompt(bytes, c.max_context),
    };
}

async function load(retry) {
    const started = performance.now();
    if (typeof WebAssembly !== "object") {
        fail("this browser has no WebAssembly, which runs the model: open the page in a " +
             "browser that has it (any current Chrome, Firefox, Safari or Edge)");
    }
    if (!crypto.subtle) {
        fail("this page checks the weights with the browser's SHA-256 (crypto.subtle), which " +
             "only a secure page has: open it from 127.0.0.1 (`make serve`) or over https");
    }
    progress("the tokenizer: tokenizer.json");
    await load_tokenizer_once();
    await load_weights(retry);
    const s = await load_session(retry);
    const c = manifest.config;
    info = {
        model: manifest.model, weights: manifest.weights,
        weights_in_words: manifest.weights_in_words, records: manifest.records,
        config: c, tolerance: manifest.tolerance || {}, threads: s.threads,
        isolated: s.isolated, longest_prompt: s.longest, trace_limit: TRACE_LIMIT,
        versions: { onnxruntime_web: ort.env.versions.web },
        downloaded, worker_ms: performance.now() - started,
        lens: lens_session ? { positions: LENS_POSITIONS } : null,
        lab: lab_session ? { sites: Object.keys(LAB_SITES) } : null,
        form: FORM, other_form: FORM === "fp32" || manifest.fp32 ? true : false,
    };
    trace_bytes = s.bytes_for;
    return info;
}

// One load at a time; after a failed one, the next Run (or load) tries again.
function ensure_loaded() {
    if (session) return Promise.resolve(info);
    if (!loading) {
        loading = load(failed_before).then(
            r => { loading = null; return r; },
            e => { loading = null; failed_before = true; throw e; });
    }
    return loading;
}

async function load_manifest() {
    let m = await fetch_json("web.json", "the export's manifest");
    check_manifest(m);
    if (FORM === "fp32") {
        if (!m.fp32) {
            fail("this export has no fp32 form (web.json names none): open the page without " +
                 "?weights=fp32");
        }
        m = await fetch_json(m.fp32, "the fp32 form's manifest");
        check_manifest(m);
    }
    return m;
}

async function load_tokenizer_once() {
    if (!manifest) manifest = await load_manifest();
    if (!tokenizer) await load_tokenizer();
}

async function encode(text) {
    await load_tokenizer_once();
    return tokenizer.encode(text, { add_special_tokens: false }).ids;
}

// ids -> text, special tokens kept, as the library decodes
function decode(ids) {
    return tokenizer.decode(ids, { skip_special_tokens: false,
                                   clean_up_tokenization_spaces: false });
}

// a piece as the reader should see it: the text of its id alone, its leading space kept
function piece(id) { return decode([id]); }

function prompt_ids(prompt, max_new) {
    const c = manifest.config;
    if (typeof prompt !== "string") fail(`the prompt must be text, got ${typeof prompt}`);
    if (prompt.length === 0) fail("the prompt is empty: type at least one character, then Run");
    let ids = tokenizer.encode(prompt, { add_special_tokens: false }).ids;
    if (c.add_bos) ids = [c.bos_id, ...ids];
    if (ids.length === (c.add_bos ? 1 : 0)) {
        fail("the prompt tokenizes to nothing (no token the model can read): type some words");
    }
    if (ids.length + max_new > c.max_context) {
        fail(`${ids.length} prompt tokens + ${max_new} new ones exceed the model's context of ` +
             `${c.max_context}: shorten the prompt or generate fewer tokens`);
    }
    if (ids.length > info.longest_prompt) {
        fail(`the prompt is ${ids.length} tokens, and its whole trace would take ` +
             `${mb(trace_bytes(ids.length))}, past this page's limit of ${mb(TRACE_LIMIT)} ` +
             `(${info.longest_prompt} tokens): shorten the prompt`);
    }
    return ids;
}

function feeds(ids) {
    const data = BigInt64Array.from(ids, BigInt);
    return { [manifest.input]: new ort.Tensor("int64", data, [1, ids.length]) };
}

// onnxruntime copies each output out of WebAssembly's memory into an array of its own: that
// array's buffer is handed to the page as it is (transferred, not copied again)
function owns_buffer(a) { return a.byteOffset === 0 && a.byteLength === a.buffer.byteLength; }

// The last position's logits, a Float32Array of the vocabulary's length.
function last_logits(tensor) {
    const V = tensor.dims[tensor.dims.length - 1];
    const n = tensor.data.length;
    return tensor.data.slice(n - V, n);
}

// The decode graph's cache inputs and outputs, layer by layer, K before V, as web.json names
// them: past.{layer}.{kv} in, layers.{layer}.attn.kv_cache.{kv} out
function cache_names(pattern) {
    const names = [];
    for (let i = 0; i < manifest.config.n_layers; i++) {
        for (const kv of ["k", "v"]) names.push(pattern.replace("{layer}", i).replace("{kv}", kv));
    }
    return names;
}

// The prefill's K and V (its kv_cache records) as the first decode step's past
function prefill_cache(values, records) {
    const step = manifest.decode, shapes = new Map(records.map(r => [r.name, r.shape]));
    const past = {}, outs = cache_names(step.present);
    cache_names(step.past).forEach((name, i) => {
        past[name] = new ort.Tensor("float32", values[outs[i]], shapes.get(outs[i]));
    });
    return past;
}

// One new token at the next position: -> [its logits, the cache after it (the next past)]
async function decode_step(id, past) {
    const step = manifest.decode, outs = cache_names(step.present);
    const r = await decode_session.run(
        { ...past, [step.input]: new ort.Tensor("int64", BigInt64Array.of(BigInt(id)), [1, 1]) },
        [step.logits, ...outs]);
    for (const tensor of Object.values(past)) tensor.dispose();
    const logits = last_logits(r[step.logits]);
    r[step.logits].dispose();
    const next = {};
    cache_names(step.past).forEach((name, i) => { next[name] = r[outs[i]]; });
    return [logits, next];
}

async function run(prompt, opts) {
    await ensure_loaded();
    const o = check_options(opts, manifest.config);
    const ids = prompt_ids(prompt, o.maxNewTokens);
    let t = performance.now();
    const out = await session.run(feeds(ids));
    const prefill_ms = performance.now() - t;
    const records = [], values = {}, transfer = [];
    for (const r of manifest.records) {
        const tensor = out[r.name];
        if (!tensor) fail(`the graph has no output ${r.name}, which web.json lists: rebuild ` +
                          "the book's model files with `make book`");
        const v = tensor.type === "int64" ? Float64Array.from(tensor.data, Number)
            : owns_buffer(tensor.data) ? tensor.data : tensor.data.slice();
        records.push({ name: r.name, op: r.op, shape: tensor.dims.slice() });
        values[r.name] = v;
        transfer.push(v.buffer);
    }
    const logits = last_logits(out[manifest.logits]);
    last_resid = stack_resid(values, ids.length);
    last_lens = null;
    for (const tensor of Object.values(out)) tensor.dispose();

    // the continuation: each new token through the decode graph, which reads the KV cache
    // (the prefill's kv_cache records, then each step's); without one, the whole graph again
    // on the growing ids, only the logits fetched
    t = performance.now();
    const generated = [], rand = mulberry32(o.seed);
    const ends = new Set(manifest.config.eos_ids || []);
    let step_logits = logits;
    let past = decode_session ? prefill_cache(values, records) : null;
    for (let step = 0; step < o.maxNewTokens; step++) {
        if (step > 0 && past) {
            [step_logits, past] = await decode_step(generated[generated.length - 1], past);
        } else if (step > 0) {
            const r = await session.run(feeds([...ids, ...generated]), [manifest.logits]);
            step_logits = last_logits(r[manifest.logits]);
            r[manifest.logits].dispose();
        }
        const next = o.temperature === 0 ? argmax(step_logits)
            : draw(warp(step_logits, o), rand);
        generated.push(next);
        if (ends.has(next)) break;
    }
    if (past) for (const tensor of Object.values(past)) tensor.dispose();
    const decode_ms = performance.now() - t;
    const top = top_tokens(logits, 10).map(x => ({ ...x, piece: piece(x.id) }));
    return {
        result: {
            model: manifest.model, weights: manifest.weights, ids, pieces: ids.map(piece),
            records, top, logits, generated, generated_pieces: generated.map(piece),
            generated_text: generated.length ? decode(generated) : "",
            stop_reason: generated.length && ends.has(generated[generated.length - 1])
                ? "an end token" : "the token limit",
            values, timings: { prefill_ms, decode_ms },
        },
        transfer: [...transfer, logits.buffer],
    };
}

// Every layer's residual stream out, [L, 1, T, D] layer-major: the lens graph's input.
function stack_resid(values, T) {
    const L = manifest.config.n_layers, D = manifest.config.hidden_size;
    const stack = new Float32Array(L * T * D);
    for (let i = 0; i < L; i++) stack.set(values[`layers.${i}.resid_out`], i * T * D);
    return { stack, T };
}

// The logit lens of the last run over its last LENS_POSITIONS positions: after each layer, at
// each position, the most likely token and its probability, from the export's lens graph.
async function lens() {
    if (!lens_session) {
        fail("this export has no logit lens graph (web.json has no \"lens\"): rebuild the " +
             "book's model files with `make book`");
    }
    if (!last_resid) fail("there is no run yet to read the lens from: run a prompt first");
    if (last_lens) return last_lens;
    const L = manifest.config.n_layers, D = manifest.config.hidden_size;
    const { stack, T } = last_resid;
    const first = Math.max(0, T - LENS_POSITIONS), P = T - first;
    const resid = new Float32Array(L * P * D);  // the same layers, the last P positions
    for (let i = 0; i < L; i++) {
        resid.set(stack.subarray((i * T + first) * D, (i * T + T) * D), i * P * D);
    }
    const t = performance.now();
    const [ids_name, probs_name] = manifest.lens.outputs;
    const out = await lens_session.run({
        [manifest.lens.input]: new ort.Tensor("float32", resid, [L, 1, P, D]) });
    const flat_ids = Array.from(out[ids_name].data, Number);
    const flat_p = Array.from(out[probs_name].data);
    const rows = (flat, f) => Array.from({ length: L }, (_, l) =>
        flat.slice(l * P, (l + 1) * P).map(f));
    for (const tensor of Object.values(out)) tensor.dispose();
    return last_lens = {
        first, positions: Array.from({ length: P }, (_, j) => first + j),
        ids: rows(flat_ids, x => x), probs: rows(flat_p, x => x),
        pieces: rows(flat_ids, piece), lens_ms: performance.now() - t,
    };
}

// --- the lab: chapter 14's interventions on the reader's prompts ------------------------------
// Each site kind of the lab graph (llmtrace_book.export.lab): the record it replaces, and how
// its mask and source are laid out ([B, L, ...] and [L, ...], "T" the prompt's length).
const LAB_SITES = {
    heads: { record: l => `layers.${l}.attn.weighted_sum`, per_head: true },
    pattern: { record: null, per_head: true },  // its source is a uniform pattern, made here
    mlp: { record: l => `layers.${l}.mlp.down`, per_head: false },
    resid: { record: l => l === 0 ? "embed" : `layers.${l - 1}.resid_out`, per_head: false },
};

function lab_shape(kind, part, B, T) {
    return manifest.lab.shapes[`${kind}.${part}`].map(d => d === "B" ? B : d === "T" ? T : d);
}

function size_of(shape) { return shape.reduce((a, b) => a * b, 1); }

// A prompt's ids, logits and the records the lab's sources read, from one pass of the main
// graph that fetches only those (kept for the next call with the same prompt)
async function source_run(prompt) {
    if (sources.has(prompt)) return sources.get(prompt);
    const ids = prompt_ids(prompt, 0);
    const L = manifest.config.n_layers;
    const names = [manifest.logits, "embed"];
    for (let l = 0; l < L; l++) {
        names.push(`layers.${l}.attn.weighted_sum`, `layers.${l}.mlp.down`);
        if (l < L - 1) names.push(`layers.${l}.resid_out`);
    }
    const out = await session.run(feeds(ids), names);
    const values = {};
    for (const n of names) { values[n] = out[n].data.slice(); out[n].dispose(); }
    const r = { ids, logits: last_logits({ data: values[manifest.logits],
                                            dims: [manifest.config.vocab_size] }), values };
    if (sources.size > 4) sources.delete(sources.keys().next().value);
    sources.set(prompt, r);
    return r;
}

// Two prompts of one length and two answer tokens: the clean run (the reader's prompt), the
// corrupted one (the other prompt), and the answers (ids, or pieces of one token each).
async function lab_pair(o) {
    if (!lab_session) {
        fail("this export has no lab graph (web.json has no \"lab\"): rebuild the book's " +
             "model files with `make book`");
    }
    if (typeof o !== "object" || o === null) fail("give the lab {prompt, other, ...}");
    if (typeof o.prompt !== "string" || typeof o.other !== "string") {
        fail("the lab needs two prompts as text: {prompt: \"The capital of France is\", " +
             "other: \"The capital of Germany is\"}");
    }
    const clean = await source_run(o.prompt), corrupt = await source_run(o.other);
    if (clean.ids.length !== corrupt.ids.length) {
        fail(`the two prompts must have as many tokens, to patch one into the other: ` +
             `"${o.prompt}" has ${clean.ids.length}, "${o.other}" has ${corrupt.ids.length}`);
    }
    let answers = o.answers ?? [argmax(clean.logits), argmax(corrupt.logits)];
    if (!Array.isArray(answers) || answers.length !== 2) {
        fail("answers must be two tokens: [the clean answer, the corrupted one], ids or text");
    }
    answers = answers.map(a => {
        if (typeof a === "number" && Number.isInteger(a) && a >= 0 &&
            a < manifest.config.vocab_size) return a;
        if (typeof a !== "string") fail(`an answer must be a token id or its text, got ${a}`);
        const ids = tokenizer.encode(a, { add_special_tokens: false }).ids;
        if (ids.length !== 1) {
            fail(`the answer "${a}" is ${ids.length} tokens, not one: give a single token ` +
                 "(with its leading space, as \" Paris\")");
        }
        return ids[0];
    });
    if (answers[0] === answers[1]) fail("the two answers are the same token: pick two");
    const m = logits => logits[answers[0]] - logits[answers[1]];
    return { clean, corrupt, answers, T: clean.ids.length,
             m_clean: m(clean.logits), m_corrupt: m(corrupt.logits) };
}

function check_range(what, x, n) {
    if (!Number.isInteger(x) || x < 0 || x >= n) {
        const has = what === "position" ? `the prompts have ${n} tokens`
            : `the model has ${n} ${what}s`;
        fail(`${what} ${x} is out of range: ${has} (0 to ${n - 1})`);
    }
}

// The source values of one site (layer, head) as the lab graph lays them out: another run's
// record, zeros, its mean over the positions, or (pattern) the uniform pattern
function site_values(kind, from, run, layer, head, T) {
    const c = manifest.config, H = c.n_heads;
    if (kind === "pattern") {
        if (from !== "uniform") fail(`a pattern is replaced by "uniform", not "${from}"`);
        const p = new Float32Array(T * T);
        for (let i = 0; i < T; i++) for (let j = 0; j <= i; j++) p[i * T + j] = 1 / (i + 1);
        return p;
    }
    const all = run.values[LAB_SITES[kind].record(layer)];
    const per = all.length / (LAB_SITES[kind].per_head ? H : 1);  // one head's [T, width]
    const own = LAB_SITES[kind].per_head ? all.subarray(head * per, (head + 1) * per)
        : all.subarray(0, per);
    if (from === "other" || from === "clean" || from === "corrupt") return own;
    if (from === "zero") return new Float32Array(per);
    if (from === "mean") {
        const w = per / T, mean = new Float32Array(w), out = new Float32Array(per);
        for (let t = 0; t < T; t++) for (let d = 0; d < w; d++) mean[d] += own[t * w + d] / T;
        for (let t = 0; t < T; t++) out.set(mean, t * w);
        return out;
    }
    fail(`a source is "other", "zero", "mean" or (for a pattern) "uniform", not "${from}"`);
}

// Masks and sources for `rows` runs, each row a list of interventions
// {kind, layer, head, position ("all" or an index), source}
function lab_feeds(pair, rows, direction) {
    const c = manifest.config, L = c.n_layers, H = c.n_heads, T = pair.T, B = rows.length;
    const run = direction === "noise" ? pair.clean : pair.corrupt;  // the run patched
    const from = direction === "noise" ? pair.corrupt : pair.clean;  // where "other" comes from
    const f = { ids: new ort.Tensor("int64", BigInt64Array.from(run.ids, BigInt), [1, T]),
                answers: new ort.Tensor("int64", BigInt64Array.from(pair.answers, BigInt), [2]) };
    const filled = new Set();
    for (const kind of Object.keys(LAB_SITES)) {
        const ms = lab_shape(kind, "mask", B, T), ss = lab_shape(kind, "source", B, T);
        const mask = new Float32Array(size_of(ms)), source = new Float32Array(size_of(ss));
        const site = size_of(ss.slice(1)) / (LAB_SITES[kind].per_head ? H : 1);
        rows.forEach((row, r) => {
            for (const x of row) {
                if (x.kind !== kind) continue;
                check_range("layer", x.layer, L);
                const head = LAB_SITES[kind].per_head ? x.head : 0;
                if (LAB_SITES[kind].per_head) check_range("head", x.head, H);
                const pos = x.position ?? "all";
                if (pos !== "all") check_range("position", pos, T);
                const key = `${kind}.${x.layer}.${head}`;
                const src = x.source ?? "other";  // "mean": the patched run's own mean
                const values = site_values(kind, src, src === "mean" ? run : from, x.layer, head,
                                           T);
                const at = (x.layer * (LAB_SITES[kind].per_head ? H : 1) + head) * site;
                if (filled.has(key) && !source.subarray(at, at + site).every(
                    (v, i) => v === values[i])) {
                    fail(`${kind} ${x.layer}${LAB_SITES[kind].per_head ? "." + head : ""} ` +
                         "is given two different sources: give each site one");
                }
                source.set(values, at);
                filled.add(key);
                const row0 = r * L * (LAB_SITES[kind].per_head ? H : 1) * T;
                const base = row0 + (x.layer * (LAB_SITES[kind].per_head ? H : 1) + head) * T;
                for (let t = 0; t < T; t++) if (pos === "all" || pos === t) mask[base + t] = 1;
            }
        });
        f[`${kind}.mask`] = new ort.Tensor("float32", mask, ms);
        f[`${kind}.source`] = new ort.Tensor("float32", source, ss);
    }
    return f;
}

function check_direction(d) {
    const direction = d ?? "denoise";
    if (direction !== "denoise" && direction !== "noise") {
        fail(`direction is "denoise" (the other run, the prompt's values written in) or ` +
             `"noise" (the prompt's run, the other's values written in), not "${d}"`);
    }
    return direction;
}

// the normalized effect, as chapter 14 normalizes it: denoising restores (0 the corrupted
// run, 1 the clean one), noising removes (0 the clean run, 1 the corrupted one)
function normalized(pair, m, direction) {
    const span = pair.m_clean - pair.m_corrupt;
    return direction === "noise" ? (pair.m_clean - m) / span : (m - pair.m_corrupt) / span;
}

async function lab_run(pair, rows, direction, with_logits) {
    const want = with_logits ? ["lab.metric", "lab.logits"] : ["lab.metric"];
    const out = await lab_session.run(lab_feeds(pair, rows, direction), want);
    const metric = Float32Array.from(out["lab.metric"].data);
    const logits = with_logits ? out["lab.logits"].data.slice() : null;
    for (const t of Object.values(out)) t.dispose();
    return { metric, logits };
}

async function intervene(o) {
    const pair = await lab_pair(o), direction = check_direction(o.direction);
    const list = o.interventions ?? [];
    if (!Array.isArray(list)) fail("interventions must be a list of {kind, layer, ...}");
    for (const x of list) {
        if (!(x && x.kind in LAB_SITES)) {
            fail(`an intervention's kind is one of ${Object.keys(LAB_SITES).join(", ")}, ` +
                 `not ${x && x.kind}`);
        }
    }
    const t = performance.now();
    const { metric, logits } = await lab_run(pair, [list], direction, true);
    const m = metric[0];
    return {
        answers: pair.answers, answer_pieces: pair.answers.map(piece), direction,
        m, m_clean: pair.m_clean, m_corrupt: pair.m_corrupt,
        normalized: normalized(pair, m, direction),
        top: top_tokens(logits, 10).map(x => ({ ...x, piece: piece(x.id) })),
        logits, lab_ms: performance.now() - t,
    };
}

const SWEEP_ROWS = 32;  // runs per batched pass: the graph's memory grows with them

// Every site of one kind patched alone, one row each, in batched passes: "resid" by layer and
// position, "heads" by layer and head (at `position`, every position by default)
async function sweep(o) {
    const pair = await lab_pair(o), direction = check_direction(o.direction);
    const c = manifest.config, L = c.n_layers, T = pair.T;
    const kind = o.kind ?? "resid";
    let rows, cols;
    if (kind === "resid") {
        cols = T;
        rows = [];
        for (let l = 0; l < L; l++) for (let p = 0; p < T; p++) {
            rows.push([{ kind, layer: l, position: p, source: "other" }]);
        }
    } else if (kind === "heads") {
        cols = c.n_heads;
        const position = o.position ?? "all";
        rows = [];
        for (let l = 0; l < L; l++) for (let h = 0; h < c.n_heads; h++) {
            rows.push([{ kind, layer: l, head: h, position, source: "other" }]);
        }
    } else {
        fail(`a sweep is over "resid" (layer by position) or "heads" (layer by head), not ` +
             `"${kind}"`);
    }
    const t = performance.now(), values = new Float32Array(rows.length);
    for (let s = 0; s < rows.length; s += SWEEP_ROWS) {
        const { metric } = await lab_run(pair, rows.slice(s, s + SWEEP_ROWS), direction, false);
        metric.forEach((m, i) => { values[s + i] = normalized(pair, m, direction); });
        postMessage({ kind: "progress", text: `the sweep: ${Math.min(s + SWEEP_ROWS, rows.length)}` +
                      ` of ${rows.length} runs` });
    }
    return { kind, direction, rows: L, cols, values: Array.from(values),
             answers: pair.answers, answer_pieces: pair.answers.map(piece),
             m_clean: pair.m_clean, m_corrupt: pair.m_corrupt, sweep_ms: performance.now() - t };
}

onmessage = async e => {
    const { id, kind } = e.data;
    try {
        if (kind === "load") {
            postMessage({ id, ok: true, result: await ensure_loaded() });
        } else if (kind === "encode") {
            postMessage({ id, ok: true, result: await encode(e.data.text) });
        } else if (kind === "intervene") {
            await ensure_loaded();
            postMessage({ id, ok: true, result: await intervene(e.data.options) });
        } else if (kind === "sweep") {
            await ensure_loaded();
            postMessage({ id, ok: true, result: await sweep(e.data.options) });
        } else if (kind === "lens") {
            postMessage({ id, ok: true, result: await lens() });
        } else if (kind === "run") {
            const { result, transfer } = await run(e.data.prompt, e.data.opts);
            postMessage({ id, ok: true, result }, transfer);
        }
    } catch (err) {
        const line = err instanceof PageError || err.line ? err.message
            : `the run failed (${String(err && err.message || err).split("\n")[0]}): ` +
              "press Run again, or reload the page";
        postMessage({ id, ok: false, error: line });
    }
};
