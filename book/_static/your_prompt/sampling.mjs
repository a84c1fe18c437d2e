// From the last position's logits to the next token, in the page: the same steps, in the same
// order, as the library's `warp` (lib/llmtrace_book/sampling.py, HF's order): divide by the
// temperature; keep the top k logits (and any tied with the k-th); of those, renormalized, keep the
// most likely until the mass below a token holds at most 1 - top_p (at least one kept);
// renormalize what is kept. The kept set is the library's; the seeded draw is the page's own (a
// 32-bit generator, not torch's), so a sampled continuation may differ from Python's.

export const MAX_NEW_TOKENS = 20;  // the page's longest continuation
const OPTIONS = ["maxNewTokens", "temperature", "topK", "topP", "seed"];

function whole(x) { return typeof x === "number" && Number.isInteger(x); }

// The options of a run, each used as written or refused by name in one line.
export function check_options(opts = {}) {
    if (opts === null || typeof opts !== "object") {
        throw new_line(`the options must be an object such as {maxNewTokens: 5}, got ${opts}`);
    }
    for (const k of Object.keys(opts)) {
        if (!OPTIONS.includes(k)) {
            throw new_line(`unknown option ${k}: the options are ${OPTIONS.join(", ")}`);
        }
    }
    const o = { maxNewTokens: 0, temperature: 0, topK: null, topP: null, seed: 0, ...opts };
    if (!whole(o.maxNewTokens) || o.maxNewTokens < 0 || o.maxNewTokens > MAX_NEW_TOKENS) {
        throw new_line(`maxNewTokens must be a whole number from 0 to ${MAX_NEW_TOKENS}, got ` +
                       `${o.maxNewTokens}`);
    }
    if (typeof o.temperature !== "number" || !(o.temperature >= 0) ||
        !Number.isFinite(o.temperature)) {
        throw new_line(`temperature must be a number >= 0 (0 means greedy), got ${o.temperature}`);
    }
    if (o.topK !== null && (!whole(o.topK) || o.topK < 1)) {
        throw new_line(`topK must be a whole number of at least 1 (or null for no top-k), got ` +
                       `${o.topK}`);
    }
    if (o.topP !== null && (typeof o.topP !== "number" || !(o.topP > 0 && o.topP <= 1))) {
        throw new_line(`topP must be in (0, 1] (1 keeps everything; null for no top-p), got ` +
                       `${o.topP}`);
    }
    if (!whole(o.seed) || o.seed < 0 || o.seed > 0xffffffff) {
        throw new_line(`seed must be a whole number from 0 to ${0xffffffff}, got ${o.seed}`);
    }
    return o;
}

function new_line(text) {
    const e = new Error(text);
    e.line = true;  // shown to the reader as it is
    return e;
}

export function argmax(x) {
    let best = 0;
    for (let i = 1; i < x.length; i++) if (x[i] > x[best]) best = i;
    return best;
}

// softmax over the entries of `x` at `idx` (the others 0), in float64
function softmax_at(x, idx, out) {
    let top = -Infinity;
    for (const i of idx) top = Math.max(top, x[i]);
    let sum = 0;
    for (const i of idx) { out[i] = Math.exp(x[i] - top); sum += out[i]; }
    for (const i of idx) out[i] /= sum;
    return out;
}

// logits / temperature in float32, as the library's `scale` (which shifts the largest logit to 0
// first where the division would overflow)
function scale(logits, temperature) {
    let top = 0, max = -Infinity;
    for (const v of logits) {
        if (Number.isFinite(v)) top = Math.max(top, Math.abs(v));
        max = Math.max(max, v);
    }
    const shift = top < temperature * 1e36 ? 0 : max;
    return Float32Array.from(logits, v => (v - shift) / temperature);
}

// logits [V] -> the distribution a token is drawn from, [V] (0 where not kept); `kept` holds the
// kept ids, most likely first. Temperature 0 is greedy: everything on the argmax.
export function warp(logits, { temperature, topK = null, topP = null }) {
    const V = logits.length;
    if (temperature === 0) {  // greedy: all on the argmax
        const probs = new Float64Array(V), best = argmax(logits);
        probs[best] = 1;
        probs.kept = [best];
        return probs;
    }
    const scaled = scale(logits, temperature);
    // least likely first, ties in id order: torch's stable ascending sort
    const up = Array.from({ length: V }, (_, i) => i).sort((a, b) => scaled[a] - scaled[b]);
    let keep = up;
    if (topK !== null) {
        const kth = scaled[up[V - Math.min(topK, V)]];
        keep = up.filter(i => scaled[i] >= kth);
    }
    if (topP !== null) {
        // the mass of a token and every less likely one, renormalized over what top-k kept,
        // compared in float32 as the library compares it
        const renorm = softmax_at(scaled, keep, new Float64Array(V));
        const limit = Math.fround(1 - topP);
        let below = 0;
        const last = keep[keep.length - 1];
        keep = keep.filter(i => {
            below += Math.fround(renorm[i]);
            return Math.fround(below) > limit || i === last;
        });
    }
    const probs = softmax_at(scaled, keep, new Float64Array(V));
    probs.kept = keep.slice().reverse();
    return probs;
}

// A seeded generator of uniform numbers in [0, 1) (mulberry32: 32 bits of state).
export function mulberry32(seed) {
    let a = seed >>> 0;
    return () => {
        a = (a + 0x6d2b79f5) >>> 0;
        let t = a;
        t = Math.imul(t ^ (t >>> 15), t | 1);
        t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
        return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    };
}

// One id from a warped distribution: the kept ids walked most likely first until their mass
// passes a uniform draw (the only one kept, if one holds it all).
export function draw(probs, rand) {
    const kept = probs.kept;
    if (kept.length === 1) return kept[0];
    const u = rand();
    let mass = 0;
    for (const i of kept) {
        mass += probs[i];
        if (u < mass) return i;
    }
    return kept[kept.length - 1];
}

// The k most likely tokens of logits [V]: {id, prob, logit}, softmax in float64.
export function top_tokens(logits, k) {
    let max = -Infinity;
    for (const v of logits) max = Math.max(max, v);
    let sum = 0;
    for (const v of logits) sum += Math.exp(v - max);
    const ids = [];
    for (let i = 0; i < logits.length; i++) {
        if (ids.length < k || logits[i] > logits[ids[ids.length - 1]]) {
            ids.push(i);
            ids.sort((a, b) => logits[b] - logits[a] || a - b);
            if (ids.length > k) ids.pop();
        }
    }
    return ids.map(id => ({ id, prob: Math.exp(logits[id] - max) / sum, logit: logits[id] }));
}
