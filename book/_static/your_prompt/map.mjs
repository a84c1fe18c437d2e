// The page's compact map of the machine: the stages of a Llama's forward pass in one strip, the
// layer's stages in a frame of their own, each stage the records it covers and the chapter that
// teaches it. The stage of the record chosen is lit. Record names are the trace's own; a record
// the map does not know (another family's) lights nothing and says so.

const CHAPTER = n => `../notebooks/${n}.html`;

// [stage, label, chapter, the records it covers (a name, or a prefix ending in ".")]
export const OUTSIDE_BEFORE = [
    ["tokens", "tokens", "02_tokenization", ["tokens"]],
    ["embed", "embedding", "03_embedding", ["embed"]],
];
export const IN_LAYER = [
    ["attn_norm", "norm", "04_rmsnorm", ["attn_norm", "attn_norm."]],
    ["qkv", "Q, K, V", "05_attention", ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.q",
                                        "attn.k", "attn.v"]],
    ["rope", "RoPE", "06_rope", ["attn.rope_q", "attn.rope_k"]],
    ["cache", "KV cache", "05_attention", ["attn.kv_cache.", "attn.k_expanded",
                                             "attn.v_expanded"]],
    ["weights", "softmax", "05_attention", ["attn.scores", "attn.causal_mask",
                                                    "attn.masked_scores", "attn.weights"]],
    ["mix", "mix, out", "05_attention", ["attn.weighted_sum", "attn.merged",
                                                  "attn.out"]],
    ["resid_mid", "+ stream", "08_stack", ["resid_mid"]],
    ["mlp_norm", "norm", "04_rmsnorm", ["mlp_norm", "mlp_norm."]],
    ["mlp", "MLP", "07_ffn", ["mlp."]],
    ["resid_out", "+ stream", "08_stack", ["resid_out"]],
];
export const OUTSIDE_AFTER = [
    ["final_norm", "final norm", "04_rmsnorm", ["final_norm", "final_norm."]],
    ["lm_head", "LM head", "09_lm_head", ["lm_head"]],
];

const LAYER = /^layers\.(\d+)\.(.*)$/;

function covers(stage, name) {
    return stage[3].some(p => (p.endsWith(".") ? name.startsWith(p) : name === p));
}

// The stage a record belongs to and its layer (null outside the layers), or null if none.
export function stage_of(name) {
    const m = LAYER.exec(name);
    const [layer, rest] = m ? [Number(m[1]), m[2]] : [null, name];
    const stages = m ? IN_LAYER : [...OUTSIDE_BEFORE, ...OUTSIDE_AFTER];
    const s = stages.find(st => covers(st, rest));
    return s ? { stage: s[0], label: s[1], chapter: s[2], layer } : null;
}

// Draws the map into el for the records `names` (the trace's order) with `chosen` lit; a stage
// pressed calls choose(the first record of that stage, in the chosen record's layer).
export function draw_map(el, names, chosen, choose) {
    const at = stage_of(chosen);
    const layers = new Set(names.map(n => LAYER.exec(n)).filter(Boolean).map(m => Number(m[1])));
    const layer = at && at.layer !== null ? at.layer : Math.min(...layers);
    const first = (stage, in_layer) => names.find(n => {
        const s = stage_of(n);
        return s && s.stage === stage && (in_layer ? s.layer === layer : s.layer === null);
    });
    const box = (stage, in_layer) => {
        const b = document.createElement("button");
        b.type = "button";
        b.className = "lt-map-stage";
        b.dataset.stage = stage[0];
        b.textContent = stage[1];
        const target = first(stage[0], in_layer);
        const lit = at && at.stage === stage[0] && (at.layer !== null) === in_layer;
        if (lit) b.classList.add("lt-lit");
        b.setAttribute("aria-pressed", String(Boolean(lit)));
        if (target) {
            b.title = `${stage[1]}: open ${target}`;
            b.onclick = () => choose(target);
        } else {
            b.disabled = true;
        }
        return b;
    };
    const arrow = () => Object.assign(document.createElement("span"),
                                      { className: "lt-map-arrow", textContent: "→" });
    const strip = [];
    for (const s of OUTSIDE_BEFORE) strip.push(box(s, false), arrow());
    const frame = document.createElement("span");
    frame.className = "lt-map-layer";
    const title = document.createElement("span");
    title.className = "lt-map-layer-title";
    title.textContent = `layer ${layer} (of ${layers.size}, each the same in shape)`;
    frame.appendChild(title);
    IN_LAYER.forEach((s, i) => {
        if (i) frame.appendChild(arrow());
        frame.appendChild(box(s, true));
    });
    strip.push(frame, arrow());
    OUTSIDE_AFTER.forEach((s, i) => {
        if (i) strip.push(arrow());
        strip.push(box(s, false));
    });
    const line = document.createElement("p");
    line.className = "lt-status";
    line.id = "lt-map-line";
    if (at) {
        const a = document.createElement("a");
        a.href = CHAPTER(at.chapter);
        a.textContent = "the chapter that teaches it";
        const where = at.layer === null ? "outside the layers" : `in layer ${at.layer}`;
        line.append(`${chosen}: the stage "${at.label}", ${where}; `, a, ".");
    } else {
        line.textContent = `${chosen}: a record this map does not show (not one of a Llama's ` +
            "stages)";
    }
    const row = document.createElement("div");
    row.className = "lt-map-strip";
    row.append(...strip);
    el.replaceChildren(row, line);
}
