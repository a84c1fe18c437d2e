"""The stack: embed -> L x `Block` (attention, MLP, with residuals) -> final norm -> LM head.

Weights arrive as a state dict in Hugging Face's naming (`model.layers.3.self_attn.q_proj.weight`),
checked against the config; the model never knows which file they came from. The same forward pass
runs on real fp32 weights (values) and on PyTorch's `meta` device (shapes only, no memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import Attention, Positions
from .block import Block
from .check import check_ids
from .config import FIELD_DEFAULTS, Config
from .embed import embed
from .errors import LlmTraceError
from .kv_cache import KVCache
from .memory import check_budget, keep_freed_memory_if_asked, needs_estimate
from .mlp import MLP
from .norm import rms_norm
from .parts import LayerWeights, layer_on_disk, load_layer, save_layer
from .trace import NO_TRACE, Patched, Trace


# the Hugging Face names of the tables and the final norm, every family's
TABLE_NAMES = {"embed": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
               "lm_head": "lm_head.weight"}


@dataclass
class Weights:
    """The model's weights: the tables and final norm (`Model.tensors`), and each layer's, by the
    fields its parts read (`parts.LayerWeights`)."""
    embed: torch.Tensor  # [V, D]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D]; the same tensor as `embed` when the head is tied
    ple_table: torch.Tensor | None = None  # [V_ple, L*P]   Gemma 4's per-layer inputs
    ple_model_proj: torch.Tensor | None = None  # [L*P, D]
    ple_model_norm: torch.Tensor | None = None  # [P]


def weights_from_state_dict(c: Config, sd: dict[str, torch.Tensor],
                            source: str = "checkpoint") -> Weights:
    """Check every tensor against the config, then arrange them by layer (`Model.load`)."""
    return Model(c).load(sd, source)


def state_dict_from_weights(c: Config, w: Weights) -> dict[str, torch.Tensor]:
    """The inverse, in HF naming (used to write HF checkpoints)."""
    return Model(c, w).state_dict()


# the book's two models by the names a reader knows them by (config name -> label)
LABELS = {"smollm2-135m-instruct": "SmolLM2-135M-Instruct", "tinyllama-1.1b": "TinyLlama-1.1B"}


class Model:
    """A model of one config and its weights: `forward` runs the ids through the embedding,
    each layer's `Block` and the head. Llama's parts by default; `Model(config, weights)` is
    the class of `config.family` (the subclass a family's module declares with
    `class Gemma3(Model, family="gemma3_text")`, overriding the parts it changes)."""
    families: dict[str, type] = {}  # model_type -> its Model subclass (families/)
    family_fields: tuple = ()  # the fields of Config only some families compute (families/)
    computes: frozenset = frozenset()  # those this model's family computes (families/)
    norm = staticmethod(rms_norm)  # the model's RMSNorm: every block's, and the final one

    def __init_subclass__(cls, family: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if family is not None:
            Model.families[family] = cls

    def __new__(cls, config: Config | None = None, *args, **kwargs):
        if cls is Model and config is not None:
            cls = Model.families.get(config.family, Model)
            cls.check_fields(config)
        return super().__new__(cls)

    @classmethod
    def check_fields(cls, c: Config) -> None:
        """Refuse a field set that this family's model computes nowhere: it would be ignored."""
        for name in Model.family_fields:
            value = getattr(c, name)
            if name not in cls.computes and value != FIELD_DEFAULTS[name]:
                raise LlmTraceError(f"config {c.name!r}: {name}={value!r} is computed by no "
                                    f"part of the model of family {c.family!r}: leave it at "
                                    f"{FIELD_DEFAULTS[name]!r}, or set family to one that "
                                    f"computes it")

    def __init__(self, config: Config, weights: Weights | None = None, tokenizer=None,
                 source: str = ""):
        self.config = config
        self.weights = weights  # None: the parts alone, to say what weights they read
        self.tokenizer = tokenizer
        self.source = source  # where the weights came from, for banners and --json
        self.runs = f"{str(self.dtype).removeprefix('torch.')}, on {self.device}" \
            if weights is not None else ""  # how: dtype, device, streamed (`load_model` says)
        self.blocks = [self.block(i) for i in range(config.n_layers)]

    # --- the parts of each layer: a family's module overrides those it changes -------------
    def block(self, i: int) -> Block:
        """Layer i: pre-norm attention and MLP, Llama's, alike in every layer."""
        return Block(self.attention(i), self.mlp(i), self.config, self.norm)

    def attention(self, i: int) -> Attention:
        return Attention(self.config, i)

    def mlp(self, i: int) -> MLP:
        return MLP(self.config.hidden_size, self.config.ffn_size)

    # --- the weights: the tables here, each layer's as its parts say (`parts.Part.tensors`) ---
    def tensors(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The weights outside the layers: field of `Weights` -> (Hugging Face name, shape).
        A tied LM head reads the embedding's table, and has no tensor of its own."""
        V, D, names = self.config.vocab_size, self.config.hidden_size, TABLE_NAMES
        head = {} if self.config.tied_lm_head else {"lm_head": (names["lm_head"], (V, D))}
        return {"embed": (names["embed"], (V, D)), "final_norm": (names["final_norm"], (D,)),
                **head}

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every weight's Hugging Face name, and the shape the config implies for it on disk."""
        shapes = {name: shape for name, shape in self.tensors().values()}
        for i, block in enumerate(self.blocks):
            shapes.update(layer_on_disk(block, i))
        return shapes

    def load(self, sd: dict[str, torch.Tensor], source: str = "checkpoint") -> Weights:
        """The weights from a state dict in Hugging Face's names, each checked against the
        shape the config implies; each layer's parts read their own."""
        self.check_shapes({name: tuple(t.shape) for name, t in sd.items()}, source)
        layers = [load_layer(block, sd.__getitem__, i) for i, block in enumerate(self.blocks)]
        tables = {field: sd[name] for field, (name, _) in self.tensors().items()}
        tables.setdefault("lm_head", tables["embed"])  # tied: the same tensor
        return Weights(layers=layers, **tables)

    def check_shapes(self, shapes: dict[str, tuple[int, ...]], source: str) -> None:
        """Every tensor the config implies is there, in the shape it implies."""
        for name, shape in self.expected_shapes().items():
            if name not in shapes:
                raise LlmTraceError(f"{source}: tensor {name} is missing "
                                    f"(config {self.config.name!r} expects it)")
            if shapes[name] != shape:
                raise LlmTraceError(f"{source}: {name} has shape {list(shapes[name])} "
                                    f"but the config implies {list(shape)}: "
                                    "the checkpoint and its config.json disagree")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under their Hugging Face names, as a checkpoint stores them."""
        w = self.weights
        sd = {name: getattr(w, field) for field, (name, _) in self.tensors().items()}
        for i, (block, lw) in enumerate(zip(self.blocks, w.layers)):
            sd.update(save_layer(block, lw, i))
        return sd

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def label(self) -> str:
        """The name a reader knows the model by, for printouts: "SmolLM2-135M-Instruct" for the
        embedded model, "TinyLlama-1.1B", else the config's name (a checkpoint's directory)."""
        return LABELS.get(self.config.name, self.config.name)

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype, which the whole pass computes in (fp32, bf16, fp16)."""
        return self.weights.embed.dtype

    @property
    def is_meta(self) -> bool:
        return self.device.type == "meta"

    def new_cache(self, max_len: int, batch: int = 1) -> list:
        """What each layer keeps between steps, for sequences up to max_len positions: a
        `KVCache` for Llama's attention (each part says its own: `new_state`)."""
        return [b.attn.new_state(max_len, batch, self.device, self.dtype) for b in self.blocks]

    def forward(self, ids: torch.Tensor, trace=NO_TRACE,
                cache: list[KVCache] | None = None, start: int = 0,
                grad: bool = False) -> torch.Tensor:
        """ids [B, T] at positions start..start+T-1 -> logits [B, T, V]. With a cache
        (`new_cache`), K and V of the positions before `start` come from it.
        To patch operations, pass a `Patched` trace (or use `run`). The pass runs in inference
        mode, which keeps no graph; grad=True runs it with autograd, for a gradient of the
        logits with respect to a tensor a patch hands on (attribution patching)."""
        with torch.inference_mode(not grad):
            ids = check_ids(ids, self.config.vocab_size, batch=True).to(self.device)  # [B, T]
            pos = self.positions(start, ids.shape[1]).to(self.dtype)  # shared by every layer
            x = self.embed(ids, trace)  # [B, T, D]
            for i, (block, w) in enumerate(zip(self.blocks, self.weights.layers)):
                layer_cache = None if cache is None else cache[i]
                x = block(x, w, pos, layer_cache, trace, f"layers.{i}")  # [B, T, D]
            return self.head(x, trace)  # [B, T, V]

    def positions(self, start: int, T: int) -> Positions:
        """Where this pass's T tokens sit, RoPE's tables for them, the causal mask."""
        return Positions.of(start, T, self.config, self.device)

    def embed(self, ids: torch.Tensor, trace=NO_TRACE) -> torch.Tensor:
        """ids [B, T] -> their rows of the embedding table [B, T, D]."""
        return embed(ids, self.weights.embed, trace)

    def head(self, x: torch.Tensor, trace=NO_TRACE) -> torch.Tensor:
        """The residual stream [..., D] to logits [..., V]: the final norm, then the LM head.
        Any leading shape: the logit lens reads each layer's stream through it."""
        c, w = self.config, self.weights
        x = self.norm(x, w.final_norm, c.norm_eps, trace, "final_norm")  # [..., D]
        logits = F.linear(x, w.lm_head)  # [..., V]
        head = "tied: embed_tokens" if c.tied_lm_head else "lm_head"
        macs = math.prod(x.shape[:-1]) * c.hidden_size * c.vocab_size
        return trace.record("lm_head", f"x @ W^T ({head})", logits, macs)  # [..., V]

    def encode(self, prompt: str, bos: bool | None = None) -> torch.Tensor:
        if not isinstance(prompt, str):
            raise LlmTraceError(f"the prompt must be text (str), got {type(prompt).__name__}")
        if not prompt:
            raise LlmTraceError("the prompt is empty: give at least one character of text")
        if self.tokenizer is None:
            raise LlmTraceError(f"model {self.name} has no tokenizer: "
                                "pass token ids instead of text")
        if bos and self.tokenizer.bos_id is None:
            raise LlmTraceError(f"model {self.name} has no BOS token (its bos_token_id is null): "
                                f"encode without bos=True")
        return torch.tensor([self.tokenizer.encode(prompt, bos=bos)])  # [1, T]

    def ids(self, prompt) -> torch.Tensor:
        """A prompt as ids [1, T]: text is encoded, ids are checked."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        return check_ids(prompt, self.config.vocab_size)

    def run(self, prompt: str | torch.Tensor, keep_values: bool = True, names=None,
            patch: dict | None = None, keep_on=None) -> tuple[torch.Tensor, Trace]:
        """One traced forward pass over the prompt (a string or ids [1, T]): (logits, trace).
        keep_values, names and keep_on choose what the trace keeps, and where (see `Trace`).
        patch: {name or glob: fn} changes those operations' outputs as they flow on (`Patched`);
        the trace records what flowed on."""
        ids = self.ids(prompt)  # [1, T]
        trace = Trace(keep_values=keep_values, names=names, label="prefill", keep_on=keep_on)
        trace.config = self.config  # the model that made it, whose data flow `diagram` draws
        check_trace_budget(self.config, trace, ids.shape[1])
        flow = Patched(patch, trace, self.config.vocab_size) if patch is not None else trace
        logits = self.forward(ids, flow, self.new_cache(ids.shape[1]))  # [1, T, V]
        if patch is not None:
            flow.check_all_matched()
        trace.check_names_matched()
        check_finite(self, ids, logits, trace, patch)
        return logits, trace

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({c.name}: {c.n_layers} layers, hidden {c.hidden_size}, "
                f"heads {c.n_heads}/{c.n_kv_heads}, "
                f"vocab {c.vocab_size}, {'meta' if self.is_meta else self.weights.embed.dtype})")


def meta_model(config: Config | str, tokenizer=None) -> Model:
    """A model whose weights live on PyTorch's `meta` device: every op computes shapes, not
    values, and allocates nothing. Tracing it gives the exact shape walk of any config."""
    c = Config.from_name(config) if isinstance(config, str) else config
    model = Model(c, tokenizer=tokenizer, source="meta device (shapes only)")
    model.weights = model.load({name: torch.empty(shape, device="meta")
                                for name, shape in model.expected_shapes().items()}, "meta")
    return model


def trace_shapes(config: Config | str, prompt: int | torch.Tensor = 6, decode_steps: int = 1,
                 label: str = "prefill") -> list[Trace]:
    """The exact shape walk of any config, on the meta device: the prefill of a prompt (token ids
    [B, T], or just its length), then `decode_steps` one-token steps reading the KV cache. No
    weights, no memory. Token ids do not change a shape, so zeros stand in for unknown ones."""
    model = meta_model(config)
    ids = prompt if isinstance(prompt, torch.Tensor) else torch.zeros(1, prompt, dtype=torch.long)
    B, T = ids.shape
    cache = model.new_cache(T + decode_steps, B)
    traces = [Trace(keep_values=False, label=label)]
    traces[0].config = model.config  # as `Model.run` says, for `diagram`
    model.forward(ids, traces[0], cache, start=0)
    for step in range(1, decode_steps + 1):
        traces.append(Trace(keep_values=False, label=f"decode {step}"))
        next_id = torch.zeros(B, 1, dtype=torch.long)  # [B, 1]
        model.forward(next_id, traces[-1], cache, start=T + step - 1)
    return traces


# --- what a trace will hold, and numbers that stop being finite ------------------------------
BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "bool": 1}


def one_layer_of_each_kind(config: Config, **changes) -> tuple[Model, list[list[int]]]:
    """A meta model of one layer of each kind (its attention's `layer_types`, its MLP's
    `mlp_types`, RoPE or none), and the layers of `config` each of its layers stands for.
    Gemma 4: every layer, each its own (they differ in shape and read each other's K, V)."""
    if config.varied_layers or config.ple_size:
        return meta_model(config.replace(**changes)), [[i] for i in range(config.n_layers)]
    kind = [(config.layer_types[i] if config.layer_types else None,
             config.mlp_types[i] if config.mlp_types else None,
             int(config.has_rope(i))) for i in range(config.n_layers)]
    kinds = list(dict.fromkeys(kind))  # (Llama 4's NoPE layers record what the others do not)
    one = meta_model(config.replace(
        n_layers=len(kinds), **changes,
        no_rope_layers=tuple(r for *_, r in kinds) if config.no_rope_layers else (),
        layer_types=tuple(a for a, _, _ in kinds) if config.layer_types else (),
        mlp_types=tuple(m for _, m, _ in kinds) if config.mlp_types else ()))
    return one, [[i for i in range(config.n_layers) if kind[i] == k] for k in kinds]


def estimate_trace_bytes(config: Config, T: int, S: int | None = None) -> int:
    """Bytes of a trace that keeps every value, for T new positions attending to S (default T):
    the records of a shapes-only pass on the meta device of one layer of each kind (each layer
    records the shapes of its kind; Gemma 3 has two), each layer's counted once per layer it
    stands for, and the records outside the layers once. Whatever a switch adds to the trace is
    counted because the pass records it. A test holds it equal to a real trace's bytes."""
    S = T if S is None else S
    one, like = one_layer_of_each_kind(config, max_positions=max(config.max_positions, S))
    copies = [len(layers) for layers in like]
    trace = Trace(keep_values=False)
    one.forward(torch.zeros(1, T, dtype=torch.long), trace, one.new_cache(S), start=S - T)
    total = 0
    for r in trace:
        layer = int(r.name.split(".")[1]) if r.name.startswith("layers.") else None
        total += BYTES.get(r.dtype, 4) * math.prod(r.shape) * (
            1 if layer is None else copies[layer])
    return total


def trace_bytes(config: Config, trace: Trace, T: int, decode_steps: int = 0) -> int:
    """Bytes the kept values of a prefill of T positions and `decode_steps` one-token steps would
    hold. Every value: `estimate_trace_bytes`. A filter: counted from a shapes-only pass of one
    layer on the meta device (each layer records the same shapes; Gemma 3: one layer of each
    kind). Each decode step is counted as the last, the largest; views, and the records a trace
    recomputes when read, as if they were copies: an upper bound."""
    if trace.keeps_all:  # every value: the closed form, no pass needed
        return estimate_trace_bytes(config, T) + decode_steps * estimate_trace_bytes(
            config, 1, T + decode_steps)
    one, like = one_layer_of_each_kind(config)  # like: the layers each layer of one stands for

    def kept(ids, cache=None, start=0) -> int:
        t = Trace(keep_values=False)
        one.forward(ids, t, cache, start)
        total = 0
        for r in t:
            size = BYTES.get(r.dtype, 4) * math.prod(r.shape)
            j = int(r.name.split(".")[1]) if r.name.startswith("layers.") else None
            names = ([r.name.replace(f"layers.{j}.", f"layers.{i}.", 1) for i in like[j]]
                     if j is not None else [r.name])
            total += size * sum(trace.keeps(n) for n in names)
        return total

    need = kept(torch.zeros(1, T, dtype=torch.long))
    if decode_steps:
        S = T + decode_steps
        need += decode_steps * kept(torch.zeros(1, 1, dtype=torch.long), one.new_cache(S), S - 1)
    return need


def check_trace_budget(config: Config, trace, T: int, decode_steps: int = 0) -> None:
    """Refuse, before running, a trace whose kept values would not fit the memory budget
    (`memory`); opt into keeping freed memory if asked."""
    if not isinstance(trace, Trace) or not trace.keep_values:
        return
    if needs_estimate(T + decode_steps, config.n_layers):
        check_budget(trace_bytes(config, trace, T, decode_steps), T)
    keep_freed_memory_if_asked()


# -inf there is the mask, by design
MAY_HOLD_MINUS_INF = ("causal_mask", "window_mask", "chunk_mask", "masked_scores")


def not_finite(name: str, t: torch.Tensor) -> bool:
    if not t.is_floating_point():
        return False
    if name.rsplit(".", 1)[-1] in MAY_HOLD_MINUS_INF:
        return bool(torch.isnan(t).any() or torch.isposinf(t).any())
    return not bool(torch.isfinite(t).all())


def first_not_finite(trace: Trace) -> str | None:
    """The name of the first record (in the order the ops ran) whose tensor holds NaN or inf."""
    for r in trace.records:
        if r.tensor is not None and not_finite(r.name, r.tensor):
            return r.name
    return None


def check_finite(model: Model, ids, logits: torch.Tensor, trace=None, patch=None) -> None:
    """Logits with NaN or inf must never be sampled from or printed; neither must logits that are
    the same for every token, which is what a norm makes of a residual stream that overflowed
    (x^2 is inf, so x / sqrt(inf) is 0). Then name the first operation whose output is not
    finite: from the trace if it kept every value, else from a fresh pass that keeps them."""
    if logits.device.type == "meta":
        return
    rows = logits.reshape(-1, logits.shape[-1])  # [N, V]
    broken = not math.isfinite(float(rows.sum())) and not bool(torch.isfinite(rows).all())
    flat = bool((rows.amax(-1) == rows.amin(-1)).any())  # cheap: one pass each
    if not broken and not flat:
        return
    full = trace if isinstance(trace, Trace) and trace.keep_values and trace.keeps_all else None
    if full is None:
        full = Trace(keep_values=True, label="finite check")
        flow = Patched(patch, full, model.config.vocab_size) if patch is not None else full
        model.forward(torch.as_tensor(ids).reshape(1, -1), flow)  # [1, T]
    where = first_not_finite(full) or ("lm_head" if broken else None)
    if where is None:
        return  # logits the same for every token, but every number finite: what the model says
    c = model.config
    raise LlmTraceError(f"{model.name}: the output of {where} is not finite (NaN or inf), so the "
                        f"logits cannot be trusted: check the weights that op reads, any patch, "
                        f"and the config (rope_theta={c.rope_theta:g}, norm_eps={c.norm_eps:g})")
