"""The block and the stack: embed -> L x (attention, MLP, with residuals) -> final norm -> LM head.

Weights arrive as a state dict in Hugging Face's naming (`model.layers.3.self_attn.q_proj.weight`),
checked against the config; the model never knows which file they came from. The same forward pass
runs on real fp32 weights (values) and on PyTorch's `meta` device (shapes only, no memory).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import memory
from .attention import attention, causal_mask
from .check import check_finite, check_ids, check_trace_budget
from .config import LAYER_TENSORS, MODEL_TENSORS, Config, expected_shapes, hf_name
from .embed import embed
from .errors import LlmTraceError
from .kv_cache import KVCache
from .mlp import swiglu
from .norm import rms_norm
from .rope import rope_cos_sin
from .trace import NO_TRACE, Patched, Trace


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [D]
    q_proj: torch.Tensor  # [H*hd, D]   (out, in), as F.linear takes it
    k_proj: torch.Tensor  # [KV*hd, D]
    v_proj: torch.Tensor  # [KV*hd, D]
    o_proj: torch.Tensor  # [D, H*hd]
    mlp_norm: torch.Tensor  # [D]
    gate: torch.Tensor  # [F, D]
    up: torch.Tensor  # [F, D]
    down: torch.Tensor  # [D, F]


@dataclass
class Weights:
    embed: torch.Tensor  # [V, D]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [D]
    lm_head: torch.Tensor  # [V, D]; the same tensor as `embed` when the head is tied


def weights_from_state_dict(c: Config, sd: dict[str, torch.Tensor],
                            source: str = "checkpoint") -> Weights:
    """Check every tensor against the config, then arrange them by layer."""
    for name, shape in expected_shapes(c).items():
        if name not in sd:
            raise LlmTraceError(f"{source}: tensor {name} is missing "
                                f"(config {c.name!r} expects it)")
        if tuple(sd[name].shape) != shape:
            raise LlmTraceError(f"{source}: {name} has shape {list(sd[name].shape)} "
                                f"but the config implies {list(shape)}: "
                                "the checkpoint and its config.json disagree")
    layers = [LayerWeights(**{f: sd[hf_name(f, i)] for f in LAYER_TENSORS})
              for i in range(c.n_layers)]
    embed = sd[hf_name("embed")]
    head = embed if c.tied_lm_head else sd[hf_name("lm_head")]
    return Weights(embed, layers, sd[hf_name("final_norm")], head)


def state_dict_from_weights(c: Config, w: Weights) -> dict[str, torch.Tensor]:
    """The inverse, in HF naming (used to write HF checkpoints)."""
    sd = {hf_name(f): getattr(w, f) for f in MODEL_TENSORS if f != "lm_head" or not c.tied_lm_head}
    for i, lw in enumerate(w.layers):
        sd.update({hf_name(f, i): getattr(lw, f) for f in LAYER_TENSORS})
    return sd


class Model:
    def __init__(self, config: Config, weights: Weights, tokenizer=None, source: str = ""):
        self.config = config
        self.weights = weights
        self.tokenizer = tokenizer
        self.source = source  # where the weights came from, for banners and --json

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def device(self) -> torch.device:
        return self.weights.embed.device

    @property
    def is_meta(self) -> bool:
        return self.device.type == "meta"

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        c = self.config
        return KVCache(c.n_layers, max_len, c.n_kv_heads, c.head_dim, batch, self.device,
                       self.weights.embed.dtype)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, trace=NO_TRACE, cache: KVCache | None = None,
                start: int = 0, patch: dict | None = None) -> torch.Tensor:
        """ids [B, T] at positions start..start+T-1 -> logits [B, T, V]. With a cache, K and V of
        positions before `start` are read from it; without one, `start` must be 0.
        patch: {name or glob: fn} changes those operations' outputs as they flow on (`Patched`)."""
        if patch:
            patched = Patched(patch, trace)
            logits = self.forward(ids, patched, cache, start)  # [B, T, V]
            patched.check_all_matched()
            return logits
        c, w = self.config, self.weights
        B, T = ids.shape
        if start + T > c.max_positions:
            raise LlmTraceError(f"{start + T} positions exceed {c.name}'s context of "
                                f"{c.max_positions}: shorten the prompt or lower max_new_tokens")
        if cache is None and start:
            raise LlmTraceError("start > 0 needs a KV cache holding the earlier positions")
        ids = ids.to(self.device)

        x = embed(ids, w.embed, trace)  # [B, T, D]  [1, 6, 2048]
        positions = torch.arange(start, start + T, device=self.device)  # [T]
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta)  # [T, head_dim] each
        mask = causal_mask(T, start + T, start, self.device)  # [T, S]: the same for every layer

        for i, lw in enumerate(w.layers):
            p = f"layers.{i}"
            h = rms_norm(x, lw.attn_norm, c.norm_eps, trace, f"{p}.attn_norm")  # [B, T, D]
            h = attention(h, lw, c, cos, sin, mask, cache, i, start,
                          trace, f"{p}.attn")  # [B, T, D]
            x = trace.record(f"{p}.resid_mid", "x + attn(attn_norm(x))",
                             x + h)  # [B, T, D]  [1, 6, 2048]
            h = rms_norm(x, lw.mlp_norm, c.norm_eps, trace, f"{p}.mlp_norm")  # [B, T, D]
            h = swiglu(h, lw, trace, f"{p}.mlp")  # [B, T, D]
            x = trace.record(f"{p}.resid_out", "h + mlp(mlp_norm(h))",
                             x + h)  # [B, T, D]  [1, 6, 2048]

        if cache is not None:
            cache.length = start + T
        x = rms_norm(x, w.final_norm, c.norm_eps, trace, "final_norm")  # [B, T, D]  [1, 6, 2048]
        logits = F.linear(x, w.lm_head)  # [B, T, V]  [1, 6, 32000]
        head = "tied: embed_tokens" if c.tied_lm_head else "lm_head"
        return trace.record("lm_head", f"x @ W^T ({head})", logits,
                            B * T * c.hidden_size * c.vocab_size)

    def encode(self, prompt: str, bos: bool | None = None) -> torch.Tensor:
        if not isinstance(prompt, str):
            raise LlmTraceError(f"the prompt must be text (str), got {type(prompt).__name__}")
        if not prompt:
            raise LlmTraceError("the prompt is empty: give at least one character of text")
        if self.tokenizer is None:
            raise LlmTraceError(f"model {self.name} has no tokenizer: "
                                "pass token ids instead of text")
        return torch.tensor([self.tokenizer.encode(prompt, bos=bos)])  # [1, T]

    def run(self, prompt: str | torch.Tensor, keep_values: bool = True, names=None,
            keep_freed_memory: bool = True,
            patch: dict | None = None) -> tuple[torch.Tensor, Trace]:
        """One traced forward pass over the prompt (a string or ids [1, T]): (logits, trace).
        patch: {name or glob: fn}, see `forward`; the trace records what flowed on.

        keep_freed_memory: when the trace keeps values, first ask glibc, once per process, to keep
        the memory a dropped trace frees (`memory.keep_freed_memory`), so the next traced pass
        reuses it instead of having the kernel fault it in again, page by page (1.2-1.4x slower at
        256 tokens without it). The process then keeps its peak memory. False leaves malloc be."""
        V = self.config.vocab_size
        ids = self.encode(prompt) if isinstance(prompt, str) else check_ids(prompt, V)  # [1, T]
        if keep_values and names is None:
            check_trace_budget(self.config, ids.shape[1])
        if keep_values and keep_freed_memory:
            memory.keep_freed_memory()
        trace = Trace(keep_values=keep_values, names=names, label="prefill")
        cache = self.new_cache(ids.shape[1])
        logits = self.forward(ids, trace, cache, patch=patch)  # [1, T, V]
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
    sd = {name: torch.empty(shape, device="meta") for name, shape in expected_shapes(c).items()}
    return Model(c, weights_from_state_dict(c, sd, "meta"), tokenizer,
                 source="meta device (shapes only)")


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
    model.forward(ids, traces[0], cache, start=0)
    for step in range(1, decode_steps + 1):
        traces.append(Trace(keep_values=False, label=f"decode {step}"))
        model.forward(torch.zeros(B, 1, dtype=torch.long), traces[-1], cache, start=cache.length)
    return traces
