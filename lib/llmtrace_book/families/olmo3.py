"""OLMo 3: OLMo 2 (a norm only after each sublayer, QK-norm over the whole projection) with
sliding layers: three in every four see only their last `sliding_window` keys, the fourth sees
them all. Both kinds turn at RoPE's one base unless rope_parameters gives each its own."""

from ..errors import LlmTraceError
from . import Family
from ._read import HFKeys, rope_theta_of
from .gemma3 import HF_LAYER_KINDS
from .olmo2 import FAMILY as OLMO2
from ..attention import Attention
from ..mechanisms import part
from ..mechanisms.attention_steps import OwnBase
from ._parts import positions_of, window
from .olmo2 import Olmo2, OlmoProjNormed


def refuse(c: dict, where: str) -> None:
    """Only plain RoPE on both kinds of layer: the long-context checkpoints' YaRN (on the full
    layers) is refused by the key that asks for it."""
    if c.get("rope_scaling") is not None:  # Olmo3Config moves it onto the full layers
        raise LlmTraceError(f"{where}: rope_scaling {c['rope_scaling']!r:.60} is not "
                            f"implemented for OLMo 3: only plain RoPE")
    rope = c.get("rope_parameters")
    if rope is None:
        return
    if not isinstance(rope, dict) or "rope_theta" in rope or "rope_type" in rope:
        raise LlmTraceError(f"{where}: OLMo 3's rope_parameters are keyed by layer kind "
                            f"(full_attention, sliding_attention), got {rope!r:.60}")
    for kind, params in rope.items():
        kind_of = params.get("rope_type", "default") if isinstance(params, dict) else params
        if kind not in HF_LAYER_KINDS or kind_of != "default":
            raise LlmTraceError(f"{where}: rope_parameters.{kind} {params!r:.60} is not "
                                f"implemented for OLMo 3: only plain RoPE (rope_type 'default') "
                                f"on full_attention and sliding_attention layers")


def read(k: HFKeys) -> dict:
    """The kind of each layer (`layer_types`, else Olmo3Config's: every fourth full), the window,
    and a RoPE base per kind, read as Olmo3Config reads them: a top-level rope_theta reaches the
    full layers only (the sliding ones keep its default_theta, 500000)."""
    c, where = k.c, k.where
    n, kinds = k.get("num_hidden_layers", int), c.get("layer_types")
    if kinds is None:
        kinds = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                 for i in range(n)]
    if not isinstance(kinds, list) or any(t not in HF_LAYER_KINDS for t in kinds):
        raise LlmTraceError(f"{where}: layer_types must list 'full_attention' or "
                            f"'sliding_attention' per layer, got {kinds!r:.80}")
    rope = c.get("rope_parameters") or {}
    full, local = rope.get("full_attention"), rope.get("sliding_attention")
    theta = rope_theta_of(k, {"rope_parameters.full_attention.rope_theta": (full, "rope_theta"),
                              "rope_theta": (c, "rope_theta")})
    local_theta = rope_theta_of(
        k, {"rope_parameters.sliding_attention.rope_theta": (local, "rope_theta")})
    if local_theta != theta and not (isinstance(local, dict) and "rope_theta" in local):
        raise LlmTraceError(f"{where}: rope_theta={theta:g} reaches only the full layers in "
                            f"Olmo3Config (the sliding ones keep {local_theta:g}): give "
                            f"rope_parameters.sliding_attention.rope_theta too")
    window = k.default("sliding_window", int, least=1)
    return dict(sliding_window=0 if window is None else window,
                layer_types=tuple(HF_LAYER_KINDS[t] for t in kinds), rope_theta=theta,
                rope_local_theta=0.0 if local_theta == theta else local_theta)


def write(c, hf: dict) -> dict:
    """A Llama config.json made into Olmo3Config's: the kinds, the window, a base per kind."""
    hf.pop("rope_theta")
    names = {v: k for k, v in HF_LAYER_KINDS.items()}
    every = ("sliding" if c.sliding_window else "full",) * c.n_layers  # () : all alike
    return {**hf, "layer_types": [names[t] for t in c.layer_types or every],
            "sliding_window": c.sliding_window or None,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": c.rope_local_theta or c.rope_theta}}}


FAMILY = Family("olmo3", "OLMo 3", "Olmo3ForCausalLM", "Olmo3Config",
                {**OLMO2.defaults, "rope_theta": 500_000.0, "sliding_window": 4096},
                switches=OLMO2.switches,
                varies=("sliding_window", "layer_types", "rope_local_theta"),
                read=read, write=write, refuse=refuse,
                biased=("attention_bias",))  # on Q, K, V and the output projection


class Olmo3(Olmo2, family="olmo3"):
    """OLMo 2 with sliding layers (three to one full), each kind at a RoPE base of its own."""

    def attention(self, i):
        c = self.config
        own_base = c.layer_types and c.rope_local_theta and c.rope_local_theta != c.rope_theta
        return part(c.qk_proj_norm and OlmoProjNormed, own_base and OwnBase, window(c, i),
                    Attention)(c, i)

    def positions(self, start, T):
        return positions_of(self, start, T)
