"""Llama 4's text model (Llama4ForCausalLM, model_type llama4_text): Llama's pre-norm block with
RoPE on adjacent pairs, three of every four layers turned (NoPE on the others); on the turned
layers q and k to RMS 1 with no weight after RoPE and chunked attention (a query sees only its
own block of attention_chunk_size positions); on the NoPE layers each query scaled up slowly
with its position (attn_temperature_tuning). The MLP of the layers `moe_layers` names (else
every `interleave_moe_layer_step`-th) is a mixture of experts: the router's top k logits, each
through a sigmoid, scale their expert's input, and a shared expert runs at every position; the
other layers keep a dense MLP `intermediate_size_mlp` wide."""

from ..attention import Attention
from ..errors import LlmTraceError
from ..mechanisms import part
from ..mechanisms.attention_steps import Chunked, Interleaved, L2Normed, Tempered, Unturned
import torch

from ..mechanisms.moe import InputScaledMoE, MlpWeights, MoeWeights
from ..mlp import MLP
from ..model import Model
from . import Family
from ._read import HFKeys, plain_rope

# Llama4TextConfig's defaults (transformers 5.24, models/llama4/configuration_llama4.py)
DEFAULTS = {"rms_norm_eps": 1e-5, "tie_word_embeddings": False, "head_dim": 128,
            "rope_theta": 500_000.0, "num_key_value_heads": 8, "max_position_embeddings": 131072,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None, "num_local_experts": 16,
            "num_experts_per_tok": 1, "intermediate_size_mlp": 16384,
            "interleave_moe_layer_step": 1, "use_qk_norm": True, "no_rope_layer_interval": 4,
            "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192,
            "attn_scale": 0.1}
HF_LAYER_KINDS = {"full_attention": "full", "chunked_attention": "chunked"}
WITH_VISION = ("model_type 'llama4' (Llama 4 with its vision tower, "
               "Llama4ForConditionalGeneration) is not implemented: llmtrace computes its text "
               "model, model_type 'llama4_text' (Llama4ForCausalLM): give the checkpoint's "
               "text_config as a config.json of its own, e.g. llama-4-scout-17b-16e's")


def rope_flags(k: HFKeys, n: int) -> list:
    """`no_rope_layers` (1: RoPE, 0: none) for each layer, as Llama4TextConfig derives them: as
    written (at least one per layer; the first n count), or, null or empty, 0 on every
    `no_rope_layer_interval`-th layer."""
    flags = k.c.get("no_rope_layers")
    if flags is None or flags == []:
        every = k.default("no_rope_layer_interval", int, least=1)
        flags = [int((i + 1) % every != 0) for i in range(n)]
    if not isinstance(flags, list) or len(flags) < n or any(
            f not in (0, 1) or isinstance(f, bool) for f in flags):
        raise LlmTraceError(f"{k.where}: no_rope_layers must list 1 (RoPE) or 0 (none) for each "
                            f"of the {n} layers (num_hidden_layers), got {flags!r:.80}")
    return flags[:n]


def mlp_kinds(k: HFKeys, n: int) -> tuple:
    """Each layer's MLP: MoE in the layers `moe_layers` lists, else in every
    `interleave_moe_layer_step`-th (step - 1, 2 step - 1, ...); () when all are."""
    layers = k.c.get("moe_layers")
    if layers is None:
        step = k.default("interleave_moe_layer_step", int, least=1)
        layers = list(range(step - 1, n, step))
    if not isinstance(layers, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in layers):
        raise LlmTraceError(f"{k.where}: moe_layers must list layer indices 0 .. {n - 1}, "
                            f"got {layers!r:.60}")
    kinds = tuple("moe" if i in layers else "dense" for i in range(n))
    return () if "dense" not in kinds else kinds


def read(k: HFKeys) -> dict:
    c, where = k.c, k.where
    n = k.get("num_hidden_layers", int)
    flags = rope_flags(k, n)
    null_chunk = "attention_chunk_size" in c and c["attention_chunk_size"] is None
    chunk = None if null_chunk else k.default("attention_chunk_size", int, least=1)
    kinds = c.get("layer_types")
    if kinds is None:  # as Llama4TextConfig: the RoPE layers chunked, if a chunk is given
        kinds = ["chunked_attention" if f and chunk is not None else "full_attention"
                 for f in flags]
    if not isinstance(kinds, list) or len(kinds) != n or any(t not in HF_LAYER_KINDS
                                                             for t in kinds):
        raise LlmTraceError(f"{where}: layer_types must list 'full_attention' or "
                            f"'chunked_attention' for each of the {n} layers, got {kinds!r:.80}")
    if "chunked_attention" in kinds and chunk is None:
        raise LlmTraceError(f"{where}: layer_types names chunked_attention layers but "
                            f"attention_chunk_size is null: give the chunk's width")
    types = tuple(HF_LAYER_KINDS[t] for t in kinds)
    tuned = k.default("attn_temperature_tuning", bool)
    floor = k.default("floor_scale", int, least=1)
    scale = float(k.default("attn_scale", float))
    if scale < 0:
        raise LlmTraceError(f"{where}: attn_scale={scale:g} must be >= 0 (the NoPE layers' "
                            f"temperature grows with it)")
    return dict(**plain_rope(k), ffn_size=k.default("intermediate_size_mlp", int, least=1),
                n_experts=k.default("num_local_experts", int, least=1),
                n_experts_active=k.default("num_experts_per_tok", int, least=1),
                moe_ffn_size=k.get("intermediate_size", int, least=1),  # each expert's width
                mlp_types=mlp_kinds(k, n), no_rope_layers=() if all(flags) else tuple(flags),
                qk_l2_norm=k.default("use_qk_norm", bool),
                attention_chunk=0 if chunk is None else chunk,
                layer_types=() if set(types) == {"full"} else types,
                attn_temperature=(floor, scale) if tuned else ())


def write(c, hf: dict) -> dict:
    """A Llama config.json made into Llama4TextConfig's."""
    names = {v: k for k, v in HF_LAYER_KINDS.items()}
    if any(t not in names for t in c.layer_types):
        raise LlmTraceError(f"config {c.name!r}: HF's Llama4ForCausalLM has full and chunked "
                            f"layers only, not {c.layer_types!r:.60}")
    hf.pop("mlp_bias")
    floor, scale = c.attn_temperature or (DEFAULTS["floor_scale"], DEFAULTS["attn_scale"])
    return {**hf, "intermediate_size": c.moe_ffn_size, "intermediate_size_mlp": c.ffn_size,
            "num_local_experts": c.n_experts, "num_experts_per_tok": c.n_experts_active,
            "moe_layers": [i for i in range(c.n_layers) if c.is_moe(i)],
            "interleave_moe_layer_step": 1,
            "no_rope_layers": list(c.no_rope_layers or (1,) * c.n_layers),
            "use_qk_norm": c.qk_l2_norm, "attention_chunk_size": c.attention_chunk or None,
            "layer_types": [names[t] for t in c.layer_types or ("full",) * c.n_layers],
            "attn_temperature_tuning": bool(c.attn_temperature), "floor_scale": floor,
            "attn_scale": scale}


FAMILY = Family("llama4_text", "Llama 4", "Llama4ForCausalLM", "Llama4TextConfig", DEFAULTS,
                switches={"rope_interleave": True, "moe_router": "topk_sigmoid",
                          "n_shared_experts": 1},
                varies=("n_experts", "n_experts_active", "moe_ffn_size", "mlp_types",
                        "no_rope_layers", "layer_types", "attention_chunk", "qk_l2_norm",
                        "attn_temperature"),
                read=read, write=write, biased=("attention_bias",),
                keys={"ffn_size": "intermediate_size_mlp", "n_experts": "num_local_experts",
                      "n_experts_active": "num_experts_per_tok",
                      "moe_ffn_size": "intermediate_size", "mlp_types": "moe_layers",
                      "attention_chunk": "attention_chunk_size", "qk_l2_norm": "use_qk_norm",
                      "attn_temperature": "floor_scale, attn_scale"})


class FeedForward(MLP):
    """Llama 4's dense MLP, which HF calls the feed-forward block."""

    def tensors(self):
        return {f: (name.replace("mlp.", "feed_forward.", 1), shape)
                for f, (name, shape) in super().tensors().items()}


class Llama4MoE(InputScaledMoE):
    """Llama 4's experts as HF stores them, under feed_forward: fused, gate and up side by side
    on the last axis (halves, not interleaved), each matrix as x @ W; the router; the shared
    expert, a dense MLP."""

    def tensors(self):
        E, D, Fm, Fs = self.n_experts, self.hidden, self.width, self.width * self.shared
        p = "feed_forward"
        out = {"moe.router": (f"{p}.router.weight", (E, D)),
               "moe.gate": (f"{p}.experts.gate_up_proj[..., :F]", (E, Fm, D)),
               "moe.up": (f"{p}.experts.gate_up_proj[..., F:]", (E, Fm, D)),
               "moe.down": (f"{p}.experts.down_proj", (E, D, Fm))}
        return {**out, **(self.shared_expert(f"{p}.shared_expert", Fs) if Fs else {})}

    def on_disk(self):
        E, D, Fm = self.n_experts, self.hidden, self.width
        fused = {"feed_forward.experts.gate_up_proj": (E, D, 2 * Fm),
                 "feed_forward.experts.down_proj": (E, Fm, D)}
        return {**{n: s for f, (n, s) in self.tensors().items()
                   if f not in ("moe.gate", "moe.up", "moe.down")}, **fused}

    def load(self, get, prefix):
        p, Fm = f"{prefix}.feed_forward", self.width
        gate_up = get(f"{p}.experts.gate_up_proj")  # [E, D, 2F]: gate | up
        shared = (MlpWeights(*(get(f"{p}.shared_expert.{kind}_proj.weight")
                               for kind in ("gate", "up", "down"))) if self.shared else None)
        return {"moe": MoeWeights(
            router=get(f"{p}.router.weight"),  # [E, D]
            gate=gate_up[..., :Fm].transpose(1, 2).contiguous(),  # [E, F, D]
            up=gate_up[..., Fm:].transpose(1, 2).contiguous(),  # [E, F, D]
            down=get(f"{p}.experts.down_proj").transpose(1, 2).contiguous(),  # [E, D, F]
            shared=shared)}

    def save(self, w, prefix):
        m, p = w.moe, f"{prefix}.feed_forward"
        shared = ({f"{p}.shared_expert.{kind}_proj.weight": getattr(m.shared, kind)
                   for kind in ("gate", "up", "down")} if self.shared else {})
        return {f"{p}.router.weight": m.router,
                f"{p}.experts.gate_up_proj": torch.cat([m.gate, m.up], dim=1).transpose(1, 2),
                f"{p}.experts.down_proj": m.down.transpose(1, 2), **shared}  # [E, D, 2F], [E, F, D]


class Llama4(Model, family="llama4_text"):
    """Llama with RoPE on adjacent pairs, QK-norm and chunks on the turned layers, a temperature
    on the others, and a mixture of experts with a shared one in the MLP of the layers it says."""

    def attention(self, i):
        c = self.config
        turned = c.has_rope(i)
        return part(turned and c.qk_l2_norm and L2Normed,
                    not turned and c.attn_temperature and Tempered,
                    (c.rope_interleave and Interleaved) if turned else Unturned,
                    c.layer_types and c.layer_types[i] == "chunked" and Chunked,
                    Attention)(c, i)

    def mlp(self, i):
        c = self.config
        return Llama4MoE(c, i) if c.is_moe(i) else FeedForward(c.hidden_size, c.ffn_size)
