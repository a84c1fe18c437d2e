"""A mixture of experts (MoE): the MLP becomes E expert MLPs, and a router picks k of
them for each position. The layer's output is the weighted sum of the k chosen experts'
outputs, so a position pays for k experts while the layer holds E.

Three routers, as HF transformers writes them (`route`), and DeepSeek-V3's:
- Mixtral: a softmax over all E logits, the top k, their weights renormalized to sum 1.
- Qwen3-MoE: the same, renormalized only if the config says `norm_topk_prob`.
- gpt-oss: a router with a bias; the top k logits, then a softmax over those k alone.
  That is Mixtral's rule in another order: on the same logits, softmax over all E, top k
  and renormalize give the same weights (tests/test_moe.py checks it).
- DeepSeek-V3 (`sigmoid_group`): each expert's score is a sigmoid of its own logit, not
  a share of a softmax. A bias per expert is added to the scores for choosing only; the
  experts sit in groups, the best groups are chosen first (by the sum of their two best
  biased scores), then the top k within them; the chosen experts' weights are their
  unbiased scores, renormalized if the config says `norm_topk_prob`, times
  `routed_scaling_factor`. The bias steers the load over the experts without changing
  what a chosen expert's output counts.
- Llama 4 (`topk_sigmoid`, `InputScaledMoE`): the top k logits, each through a sigmoid of
  its own; each weight scales its expert's input, not its output, and a shared expert runs
  at every position.

DeepSeek's layers also hold shared experts: one dense SwiGLU MLP (n_shared_experts x
moe_intermediate_size wide) that every position runs, its output added to the routed
experts'.

Each expert is a SwiGLU MLP (mlp.py) with its own three matrices. gpt-oss's experts have
biases and their own activation, `gpt_oss_glu`.

Which experts a position uses depends on its values, so the experts' output is recorded
by slot, not by expert: slot j of position t holds the output of the j-th expert it
chose, [B, T, k, D]. Every record's shape then follows from the config alone, and the
meta device (shapes, no values) makes the same records without routing anything.

Shapes: B batch, T positions, D hidden, E experts, k chosen per position, F an expert's
intermediate size.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config_checks import ROUTERS  # config.py checks moe_router against them
from ..errors import LlmTraceError
from ..mlp import swiglu
from ..trace import NO_TRACE

ACTS = ("silu", "gpt_oss", "gelu_tanh")


@dataclass
class MlpWeights:
    """A dense SwiGLU MLP's three matrices, as mlp.swiglu reads them: DeepSeek's shared
    experts."""
    gate: torch.Tensor  # [F, D]
    up: torch.Tensor  # [F, D]
    down: torch.Tensor  # [D, F]


@dataclass
class MoeWeights:
    """One MoE layer's weights: one stacked tensor per kind, expert e's matrix at [e],
    each in F.linear's (out, in) orientation, as the dense MLP's gate, up and down."""
    router: torch.Tensor  # [E, D]
    gate: torch.Tensor  # [E, F, D]
    up: torch.Tensor  # [E, F, D]
    down: torch.Tensor  # [E, D, F]
    router_bias: torch.Tensor | None = None  # [E]     gpt-oss
    gate_bias: torch.Tensor | None = None  # [E, F]    gpt-oss
    up_bias: torch.Tensor | None = None  # [E, F]
    down_bias: torch.Tensor | None = None  # [E, D]
    score_bias: torch.Tensor | None = None  # [E]  DeepSeek-V3's e_score_correction_bias
    shared: MlpWeights | None = None  # DeepSeek: the shared experts, one dense MLP
    shared_gate: torch.Tensor | None = None  # [1, D] Qwen3-Next: sigmoid(x @ W^T) scales shared


def route(logits, k: int, router: str = "softmax_topk", renormalize: bool = True,
          trace=NO_TRACE, name: str = "mlp", bias=None, n_group: int = 1,
          topk_group: int = 1, scaling: float = 1.0):
    """(ids, weights), each [B, T, k]: the k experts each position goes to, and how much
    each one's output counts. logits: [B, T, E]. `renormalize` acts on softmax_topk
    and sigmoid_group: topk_softmax's weights sum to 1 already. bias [E], n_group,
    topk_group: sigmoid_group's (`sigmoid_group_route`). scaling: every weight's
    factor (routed_scaling_factor)."""
    if router == "softmax_topk":  # Mixtral, Qwen3-MoE
        probs = trace.record(f"{name}.router_probs",
                             "softmax(router) over the E experts",
                             torch.softmax(logits, dim=-1))  # [B, T, E]
        weights, ids = torch.topk(probs, k, dim=-1)  # [B, T, k]
        if renormalize:  # the k chosen weights sum to 1 again
            weights = weights / weights.sum(dim=-1, keepdim=True)  # [B, T, k]
    elif router == "topk_softmax":  # gpt-oss: a softmax over the k chosen logits
        top, ids = torch.topk(logits, k, dim=-1)  # [B, T, k]
        weights = torch.softmax(top, dim=-1)  # [B, T, k]
    elif router == "topk_sigmoid":  # Llama 4: each chosen logit through a sigmoid of its own
        top, ids = torch.topk(logits, k, dim=-1)  # [B, T, k]
        weights = torch.sigmoid(top)  # [B, T, k]
    elif router == "sigmoid_group":  # DeepSeek-V3
        ids, weights = sigmoid_group_route(logits, k, bias, n_group, topk_group,
                                           renormalize, trace, name)  # [B, T, k] each
    else:
        raise LlmTraceError(f"router must be one of {', '.join(ROUTERS)}, "
                            f"got {router!r}")
    if scaling != 1.0:  # DeepSeek: routed_scaling_factor
        weights = weights * scaling  # [B, T, k]
    return ids, weights


def sigmoid_group_route(logits, k: int, bias=None, n_group: int = 1,
                        topk_group: int = 1, renormalize: bool = True, trace=NO_TRACE,
                        name: str = "mlp"):
    """DeepSeek-V3's router: (ids, weights) [B, T, k] each, from logits [B, T, E]. The
    bias [E] moves which experts are chosen, never what they weigh; G = n_group groups
    of E/G experts, the topk_group best groups by the sum of their two best biased
    scores, then the top k experts of those groups."""
    B, T, E = logits.shape
    G = n_group
    scores = trace.record(f"{name}.router_scores", "sigmoid(router): each expert on "
                          "its own", torch.sigmoid(logits))  # [B, T, E]
    choice = scores if bias is None else scores + bias  # [B, T, E]
    what = ("router_scores + e_score_correction_bias (for choosing only)"
            if bias is not None else "router_scores")
    choice = trace.record(f"{name}.choice_scores", what, choice)  # [B, T, E]
    best_two = choice.view(B, T, G, E // G).topk(2, dim=-1)[0]  # [B, T, G, 2]
    group_scores = trace.record(f"{name}.group_scores", "sum of each group's 2 best "
                                "choice_scores", best_two.sum(-1))  # [B, T, G]
    groups = group_scores.topk(topk_group, dim=-1)[1]  # [B, T, topk_group]
    groups = trace.record(f"{name}.groups_chosen", f"the {topk_group} best groups",
                          groups)  # [B, T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(-1, groups, True)
    keep = keep[..., None].expand(B, T, G, E // G).reshape(B, T, E)  # [B, T, E]
    ids = choice.masked_fill(~keep, float("-inf")).topk(k, dim=-1)[1]  # [B, T, k]
    weights = scores.gather(-1, ids)  # [B, T, k]: unbiased
    if renormalize:  # HF adds 1e-20 to the sum, as DeepSeek's code
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # [B, T, k]
    return ids, weights


def gpt_oss_glu(gate, up, limit: float = 7.0, alpha: float = 1.702):
    """gpt-oss's gated activation. gate is clamped from above, up on both sides, so that
    no activation grows past `limit`; gate * sigmoid(alpha * gate) is a sharpened SiLU
    (with alpha 1.702, close to GELU); up + 1 lets the gate pass even where up is 0."""
    gate = gate.clamp(max=limit)  # [N, F]
    up = up.clamp(min=-limit, max=limit)  # [N, F]
    glu = gate * torch.sigmoid(gate * alpha)  # [N, F]
    return (up + 1) * glu  # [N, F]


def expert_mlp(x, w: MoeWeights, e: int, act: str = "silu", limit: float = 7.0,
               alpha: float = 1.702):
    """Expert e on the positions routed to it: x [N, D] -> [N, D]."""
    gate = F.linear(x, w.gate[e], _row(w.gate_bias, e))  # [N, F]
    up = F.linear(x, w.up[e], _row(w.up_bias, e))  # [N, F]
    if act == "gpt_oss":
        gated = gpt_oss_glu(gate, up, limit, alpha)  # [N, F]
    elif act == "gelu_tanh":  # GeGLU (Gemma 4's experts), as the dense MLP's
        gated = F.gelu(gate, approximate="tanh") * up  # [N, F]
    else:  # SwiGLU, as the dense MLP
        gated = F.silu(gate) * up  # [N, F]
    return F.linear(gated, w.down[e], _row(w.down_bias, e))  # [N, D]


def chosen_expert_outputs(x, w: MoeWeights, ids, act: str = "silu", limit: float = 7.0,
                          alpha: float = 1.702):
    """[B, T, k, D]: slot j of position t holds the output there of expert ids[b, t, j].
    Each expert runs once, on just the positions that chose it. x [B, T, D], or [B, T, k, D]:
    each slot's own input (Llama 4's, scaled by its weight)."""
    B, T, D = x.shape[0], x.shape[1], x.shape[-1]
    E, k = w.gate.shape[0], ids.shape[-1]
    if x.device.type == "meta":  # no values, so no routing: the shape alone
        return x.new_empty(B, T, k, D)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= E):
        raise LlmTraceError(f"expert ids must lie in 0 .. {E - 1} (this layer has {E} "
                            f"experts), got {int(ids.min())} .. {int(ids.max())}: "
                            f"a patch of experts_chosen must return ids of this layer")
    flat = x.reshape(B * T, -1, D).expand(B * T, k, D)  # [B*T, k, D]: each slot's input
    ids = ids.reshape(B * T, k)  # [B*T, k]
    out = x.new_zeros(B * T, k, D)  # [B*T, k, D]
    for e in range(E):
        pos, slot = torch.where(ids == e)  # the (position, slot) pairs choosing e
        out[pos, slot] = expert_mlp(flat[pos, slot], w, e, act, limit, alpha)  # [N_e, D]
    return out.reshape(B, T, k, D)


def moe_mlp(x, w: MoeWeights, k: int, router: str = "softmax_topk",
            renormalize: bool = True, act: str = "silu", limit: float = 7.0,
            alpha: float = 1.702, trace=NO_TRACE, name: str = "mlp", n_group: int = 1,
            topk_group: int = 1, scaling: float = 1.0) -> torch.Tensor:
    """x [B, T, D] -> [B, T, D]: route each position to k experts, run them, weigh the
    k outputs and sum them; add the shared experts' output if the layer has them.
    n_group, topk_group: sigmoid_group's groups; scaling: routed_scaling_factor."""
    _check_args(w, k, router, act)
    if router == "sigmoid_group":
        _check_groups(w.gate.shape[0], k, n_group, topk_group)
    B, T, D = x.shape
    E, Fsz, _ = w.gate.shape
    op = "x @ W_router^T" + (" + b_router" if w.router_bias is not None else "")
    logits = trace.record(f"{name}.router", op, F.linear(x, w.router, w.router_bias),
                          B * T * D * E)  # [B, T, E]
    ids, weights = route(logits, k, router, renormalize, trace, name, w.score_bias,
                         n_group, topk_group, scaling)  # [B, T, k] each
    norm = ", renormalized" if renormalize else ""
    how = {"softmax_topk": f"top-k of softmax{norm}",
           "topk_softmax": "top-k of the logits",
           "sigmoid_group": "top-k of choice_scores in the chosen groups"}[router]
    ids = trace.record(f"{name}.experts_chosen", f"{how}: expert ids", ids)  # [B, T, k]
    sums = ", summing to 1" if renormalize else ""
    what = {"softmax_topk": f"their probabilities{sums}",
            "topk_softmax": "softmax over the k chosen logits",
            "sigmoid_group": f"their router_scores (no bias){sums}"}[router]
    what += f", x {scaling:g}" if scaling != 1.0 else ""
    weights = trace.record(f"{name}.expert_weights", what, weights)  # [B, T, k]
    mlp = {"silu": "SwiGLU", "gelu_tanh": "GeGLU"}.get(act, "gpt-oss GLU")
    out = trace.record(f"{name}.expert_out", f"the j-th chosen expert's {mlp} MLP",
                       chosen_expert_outputs(x, w, ids, act, limit, alpha),
                       B * T * k * 3 * D * Fsz)  # [B, T, k, D]
    y = (weights[..., None] * out).sum(dim=2)  # [B, T, D]
    if w.shared is None:
        return trace.record(f"{name}.out", "sum_j expert_weights_j * expert_out_j", y,
                            B * T * k * D)
    # DeepSeek: the routed experts' sum, and the shared experts that every position runs
    y = trace.record(f"{name}.routed", "sum_j expert_weights_j * expert_out_j", y,
                     B * T * k * D)  # [B, T, D]
    shared = swiglu(x, w.shared, trace, f"{name}.shared")  # [B, T, D]
    if w.shared_gate is not None:  # Qwen3-Next: each position scales its shared expert
        gate = trace.record(f"{name}.shared_gate", "sigmoid(x @ W_shared_gate^T)",
                            torch.sigmoid(F.linear(x, w.shared_gate)), B * T * D)  # [B, T, 1]
        shared = trace.record(f"{name}.shared_gated", "shared_gate * shared.down",
                              gate * shared)  # [B, T, D]
    return trace.record(f"{name}.out", "routed + shared.down", y + shared)  # [B, T, D]


def moe_params(w: MoeWeights, k: int) -> tuple[int, int]:
    """(total, active per position): the parameters one MoE layer holds, and the ones a
    position reads, the router and k of the E experts. Shapes only: works on meta."""
    E = w.gate.shape[0]
    router = sum(t.numel() for t in (w.router, w.router_bias) if t is not None)
    experts = sum(t.numel() for t in (w.gate, w.up, w.down, w.gate_bias, w.up_bias,
                                      w.down_bias) if t is not None)
    # DeepSeek's shared experts run at every position; score_bias is a buffer, not
    # learned by gradient (HF counts no parameter for it)
    shared = (0 if w.shared is None
              else sum(t.numel() for t in w.shared.__dict__.values()))
    shared += 0 if w.shared_gate is None else w.shared_gate.numel()
    return router + experts + shared, router + experts // E * k + shared


def hf_moe_weights(get, prefix: str, model_type: str, n_experts: int,
                   shared: bool = True) -> MoeWeights:
    """One layer's MoeWeights from the names in HF safetensors files, as
    `save_pretrained` writes them: get(name) -> tensor, prefix "model.layers.3".
    Mixtral and Qwen3-MoE store each expert's matrices apart; gpt-oss stores them fused,
    gate and up interleaved on the last axis, transposed (x @ W) from F.linear's. shared:
    DeepSeek's layer has shared experts (n_shared_experts 0: none)."""
    if model_type == "gpt_oss":
        p = f"{prefix}.mlp"
        gate_up = get(f"{p}.experts.gate_up_proj")  # [E, D, 2F]: g0 u0 g1 u1 ...
        gate_up_bias = get(f"{p}.experts.gate_up_proj_bias")  # [E, 2F]
        down = get(f"{p}.experts.down_proj")  # [E, F, D]
        return MoeWeights(
            router=get(f"{p}.router.weight"), router_bias=get(f"{p}.router.bias"),
            gate=gate_up[..., ::2].transpose(1, 2).contiguous(),  # [E, F, D]
            up=gate_up[..., 1::2].transpose(1, 2).contiguous(),  # [E, F, D]
            down=down.transpose(1, 2).contiguous(),  # [E, D, F]
            gate_bias=gate_up_bias[:, ::2].contiguous(),  # [E, F]
            up_bias=gate_up_bias[:, 1::2].contiguous(),  # [E, F]
            down_bias=get(f"{p}.experts.down_proj_bias"))  # [E, D]
    if model_type in DEEPSEEK:
        return hf_deepseek_moe_weights(get, prefix, model_type, n_experts, shared)
    if model_type == "llama4_text":
        return hf_llama4_moe_weights(get, prefix)
    names = HF_EXPERT_NAMES.get(model_type)
    if names is None:
        known = ", ".join([*HF_EXPERT_NAMES, "gpt_oss", "llama4_text", *DEEPSEEK])
        raise LlmTraceError(f"no MoE weight names for model_type {model_type!r}: "
                            f"known are {known}")
    block, gate, up, down = names
    p = f"{prefix}.{block}"

    def stack(kind):  # [E, out, in]
        return torch.stack([get(f"{p}.experts.{e}.{kind}.weight")
                            for e in range(n_experts)])

    return MoeWeights(router=get(f"{p}.gate.weight"), gate=stack(gate), up=stack(up),
                      down=stack(down))


def hf_gpt_oss_tensors(w: MoeWeights, prefix: str) -> dict[str, torch.Tensor]:
    """The inverse of `hf_moe_weights` for gpt-oss: its fused tensors under their names on
    disk, prefix "model.layers.3"."""
    E, Fsz, D = w.gate.shape
    p = f"{prefix}.mlp"
    gate_up = torch.stack([w.gate, w.up], dim=-1)  # [E, F, D, 2]: gate, up side by side
    gate_up = gate_up.permute(0, 2, 1, 3).reshape(E, D, 2 * Fsz)  # [E, D, 2F]: g0 u0 g1 u1
    gate_up_bias = torch.stack([w.gate_bias, w.up_bias], dim=-1).reshape(E, 2 * Fsz)
    return {f"{p}.router.weight": w.router, f"{p}.router.bias": w.router_bias,
            f"{p}.experts.gate_up_proj": gate_up,
            f"{p}.experts.gate_up_proj_bias": gate_up_bias,  # [E, 2F]
            f"{p}.experts.down_proj": w.down.transpose(1, 2),  # [E, F, D]
            f"{p}.experts.down_proj_bias": w.down_bias}  # [E, D]


def hf_deepseek_moe_weights(get, prefix: str, model_type: str, n_experts: int,
                            shared: bool = True) -> MoeWeights:
    """DeepSeek-V2/V3's MoE layer from the names on disk: the experts as Qwen3-MoE's,
    the shared experts as a dense MLP; V3's router holds its bias
    (`e_score_correction_bias`)."""
    p = f"{prefix}.mlp"
    w = hf_moe_weights(get, prefix, "qwen3_moe", n_experts)  # the same expert names

    if shared:
        w.shared = MlpWeights(*(get(f"{p}.shared_experts.{kind}_proj.weight")
                                for kind in ("gate", "up", "down")))
    if model_type == "deepseek_v3":
        w.score_bias = get(f"{p}.gate.e_score_correction_bias")  # [E]
    return w


def hf_llama4_moe_weights(get, prefix: str) -> MoeWeights:
    """Llama 4's MoE layer as `save_pretrained` writes it, prefix "model.layers.3": the
    experts fused, gate and up side by side on the last axis (halves, not interleaved), x @ W
    transposed from F.linear's; the router; the shared expert, a dense MLP."""
    p = f"{prefix}.feed_forward"
    gate_up = get(f"{p}.experts.gate_up_proj")  # [E, D, 2F]: gate | up
    Fm = gate_up.shape[-1] // 2
    return MoeWeights(
        router=get(f"{p}.router.weight"),  # [E, D]
        gate=gate_up[..., :Fm].transpose(1, 2).contiguous(),  # [E, F, D]
        up=gate_up[..., Fm:].transpose(1, 2).contiguous(),  # [E, F, D]
        down=get(f"{p}.experts.down_proj").transpose(1, 2).contiguous(),  # [E, D, F]
        shared=MlpWeights(*(get(f"{p}.shared_expert.{kind}_proj.weight")
                            for kind in ("gate", "up", "down"))))


def hf_llama4_tensors(w: MoeWeights, prefix: str) -> dict[str, torch.Tensor]:
    """The inverse of `hf_llama4_moe_weights`: its tensors under their names on disk."""
    p = f"{prefix}.feed_forward"
    shared = {f"{p}.shared_expert.{kind}_proj.weight": getattr(w.shared, kind)
              for kind in ("gate", "up", "down")}
    return {f"{p}.router.weight": w.router,
            f"{p}.experts.gate_up_proj": torch.cat([w.gate, w.up], dim=1).transpose(1, 2),
            f"{p}.experts.down_proj": w.down.transpose(1, 2), **shared}  # [E, D, 2F], [E, F, D]


# model_type -> (the block's name, and its experts' gate, up and down matrices)
HF_EXPERT_NAMES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_next": ("mlp", "gate_proj", "up_proj", "down_proj"),  # and a gated shared expert
    "olmoe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}  # DeepSeek-V2/V3: Qwen3-MoE's names and shared experts (hf_deepseek_moe_weights)


DEEPSEEK = ("deepseek_v2", "deepseek_v3")


def _check_groups(E: int, k: int, n_group: int, topk_group: int) -> None:
    """sigmoid_group's groups: G divides E into groups of at least 2 (a group scores by
    its two best), 1 <= topk_group <= G, and the chosen groups hold k or more."""
    for key, value in (("n_group", n_group), ("topk_group", topk_group)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise LlmTraceError(f"{key} must be a whole number, at least 1, "
                                f"got {value!r}")
    if E % n_group or E // n_group < 2:
        raise LlmTraceError(f"n_group={n_group} must divide the {E} experts into "
                            f"groups of 2 or more")
    if topk_group > n_group or topk_group * (E // n_group) < k:
        raise LlmTraceError(f"topk_group={topk_group} must lie in 1 .. "
                            f"n_group={n_group} and its groups hold the k={k} experts "
                            f"chosen ({E // n_group} each)")


def _row(bias, e: int):
    return None if bias is None else bias[e]


def _check_args(w: MoeWeights, k: int, router: str, act: str) -> None:
    E = w.gate.shape[0]
    if router not in ROUTERS:
        raise LlmTraceError(f"router must be one of {', '.join(ROUTERS)}, "
                            f"got {router!r}")
    if act not in ACTS:
        raise LlmTraceError(f"act must be one of {', '.join(ACTS)}, got {act!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= E:
        raise LlmTraceError(f"k (experts per position) must be a whole number "
                            f"in 1 .. {E}, got {k!r}")


class MoE:
    """A layer's mixture of experts as a part, in the gated MLP's place: x [B, T, D] ->
    [B, T, D], its weights `w.moe` (`MoeWeights`), its router and experts as the config
    says (`moe_mlp`)."""

    def __init__(self, config, layer: int = 0):
        c = config
        self.k, self.router, self.renormalize = c.n_experts_active, c.moe_router, c.moe_renormalize
        self.act, self.limit, self.alpha = c.mlp_act, c.swiglu_limit, c.swiglu_alpha
        self.groups, self.chosen, self.scaling = c.moe_groups, c.moe_groups_chosen, c.moe_scaling

    def __call__(self, x, w, trace=NO_TRACE, name: str = "mlp"):
        return moe_mlp(x, w.moe, self.k, self.router, self.renormalize, self.act, self.limit,
                       self.alpha, trace=trace, name=name, n_group=self.groups,
                       topk_group=self.chosen, scaling=self.scaling)  # [B, T, D]


class InputScaledMoE(MoE):
    """Llama 4's mixture of experts: the router's k best logits, each through a sigmoid
    (`topk_sigmoid`), scale the input of the expert they chose; the experts' outputs are summed
    as they come, and a shared expert (`w.moe.shared`) runs at every position."""

    def __init__(self, config, layer: int = 0):
        super().__init__(config, layer)
        self.shared = config.n_shared_experts > 0

    def __call__(self, x, w, trace=NO_TRACE, name: str = "mlp"):
        m = w.moe
        B, T, D = x.shape
        E, Fsz, _ = m.gate.shape
        _check_args(m, self.k, self.router, self.act)
        logits = trace.record(f"{name}.router", "x @ W_router^T", F.linear(x, m.router),
                              B * T * D * E)  # [B, T, E]
        ids, weights = route(logits, self.k, self.router, self.renormalize, trace, name)
        how = {"topk_sigmoid": "sigmoid of each chosen logit"}.get(self.router, self.router)
        ids = trace.record(f"{name}.experts_chosen", "top-k: expert ids", ids)  # [B, T, k]
        weights = trace.record(f"{name}.expert_weights", how, weights)  # [B, T, k]
        scaled = trace.record(f"{name}.expert_in", "expert_weights_j * x: the j-th chosen "
                              "expert's input", weights[..., None] * x[:, :, None])  # [B,T,k,D]
        out = trace.record(f"{name}.expert_out", "the j-th chosen expert's SwiGLU MLP on its "
                           "expert_in", chosen_expert_outputs(scaled, m, ids),
                           B * T * self.k * 3 * D * Fsz)  # [B, T, k, D]
        y = out.sum(dim=2)  # [B, T, D]
        if not self.shared:
            return trace.record(f"{name}.out", "sum_j expert_out_j", y)  # [B, T, D]
        y = trace.record(f"{name}.routed", "sum_j expert_out_j", y)  # [B, T, D]
        shared = swiglu(x, m.shared, trace, f"{name}.shared")  # [B, T, D]
        return trace.record(f"{name}.out", "routed + shared.down", y + shared)  # [B, T, D]
