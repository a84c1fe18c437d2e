"""A mixture of experts (MoE): the MLP becomes E expert MLPs, and a router picks k of
them for each position. The layer's output is the weighted sum of the k chosen experts'
outputs, so a position pays for k experts while the layer holds E.

Its routers, each a small class (`Router`; the config's `moe_router` names one), as HF
transformers writes them:
- Mixtral (`SoftmaxTopK`): a softmax over all E logits, the top k, their weights
  renormalized to sum 1.
- Qwen3-MoE: the same, renormalized only if the config says `norm_topk_prob`.
- gpt-oss (`TopKSoftmax`): a router with a bias; the top k logits, then a softmax over those
  k alone.
  That is Mixtral's rule in another order: on the same logits, softmax over all E, top k
  and renormalize give the same weights (tests/test_moe.py checks it).
- DeepSeek-V3 (`SigmoidGroup`): each expert's score is a sigmoid of its own logit, not
  a share of a softmax. A bias per expert is added to the scores for choosing only; the
  experts sit in groups, the best groups are chosen first (by the sum of their two best
  biased scores), then the top k within them; the chosen experts' weights are their
  unbiased scores, renormalized if the config says `norm_topk_prob`, times
  `routed_scaling_factor`. The bias steers the load over the experts without changing
  what a chosen expert's output counts.
- Llama 4 (`TopKSigmoid`, `InputScaledMoE`): the top k logits, each through a sigmoid of
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
from operator import attrgetter

import torch
import torch.nn.functional as F

from ..config_checks import ROUTERS  # config.py checks moe_router against them
from ..errors import LlmTraceError
from ..mlp import swiglu
from ..parts import Part
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


class Router:
    """How a router's logits choose: logits [B, T, E] -> (ids, weights), each [B, T, k], the k
    experts each position goes to and how much each one's output counts. Each rule is a class
    of its own (`ROUTERS_BY_NAME`, by the config's `moe_router`); `chose` and `weighs` say it
    in the trace. in_fp32: the logits computed in fp32 whatever the weights' dtype."""
    in_fp32 = False

    def __init__(self, k: int, renormalize: bool = True, scaling: float = 1.0,
                 n_group: int = 1, topk_group: int = 1):
        self.k, self.renormalize, self.scaling = k, renormalize, scaling
        self.n_group, self.topk_group = n_group, topk_group  # `SigmoidGroup`'s

    def __call__(self, logits, bias=None, trace=NO_TRACE, name: str = "mlp"):
        """bias [E]: a bias for choosing only (`SigmoidGroup`); every weight is then times
        `scaling` (routed_scaling_factor)."""
        ids, weights = self.choose(logits, bias, trace, name)  # [B, T, k] each
        if self.scaling != 1.0:  # DeepSeek: routed_scaling_factor
            weights = weights * self.scaling  # [B, T, k]
        return ids, weights

    def weighs_all(self) -> str:
        return self.weighs + (f", x {self.scaling:g}" if self.scaling != 1.0 else "")


class SoftmaxTopK(Router):
    """Mixtral, Qwen3-MoE: a softmax over all E logits, the top k, their weights renormalized
    to sum 1 if `renormalize` (Qwen3-MoE: `norm_topk_prob`)."""

    def choose(self, logits, bias, trace, name):
        probs = trace.record(f"{name}.router_probs", "softmax(router) over the E experts",
                             torch.softmax(logits, dim=-1))  # [B, T, E]
        weights, ids = torch.topk(probs, self.k, dim=-1)  # [B, T, k]
        if self.renormalize:  # the k chosen weights sum to 1 again
            weights = weights / weights.sum(dim=-1, keepdim=True)  # [B, T, k]
        return ids, weights

    @property
    def chose(self):
        return "top-k of softmax" + (", renormalized" if self.renormalize else "")

    @property
    def weighs(self):
        return "their probabilities" + (", summing to 1" if self.renormalize else "")


class TopKSoftmax(Router):
    """gpt-oss: the top k logits, then a softmax over those k alone (Mixtral's rule in another
    order: on the same logits, the same weights; tests/test_moe.py checks it)."""
    chose, weighs = "top-k of the logits", "softmax over the k chosen logits"

    def choose(self, logits, bias, trace, name):
        top, ids = torch.topk(logits, self.k, dim=-1)  # [B, T, k]
        return ids, torch.softmax(top, dim=-1)  # [B, T, k] each


class TopKSigmoid(Router):
    """Llama 4: the top k logits, each through a sigmoid of its own."""
    chose, weighs = "top-k", "sigmoid of each chosen logit"

    def choose(self, logits, bias, trace, name):
        top, ids = torch.topk(logits, self.k, dim=-1)  # [B, T, k]
        return ids, torch.sigmoid(top)  # [B, T, k] each


class SigmoidGroup(Router):
    """DeepSeek-V3: each expert's score a sigmoid of its own logit. The bias [E] moves which
    experts are chosen, never what they weigh; G = n_group groups of E/G experts, the
    topk_group best groups by the sum of their two best biased scores, then the top k experts
    of those groups; their unbiased scores, renormalized if `renormalize`. Its logits in fp32,
    as HF's DeepSeek-V3 router computes them."""
    chose = "top-k of choice_scores in the chosen groups"
    in_fp32 = True

    @property
    def weighs(self):
        return "their router_scores (no bias)" + (", summing to 1" if self.renormalize else "")

    def choose(self, logits, bias, trace, name):
        B, T, E = logits.shape
        G, k = self.n_group, self.k
        _check_groups(E, k, G, self.topk_group)
        scores = trace.record(f"{name}.router_scores", "sigmoid(router): each expert on "
                              "its own", torch.sigmoid(logits))  # [B, T, E]
        choice = scores if bias is None else scores + bias  # [B, T, E]
        what = ("router_scores + e_score_correction_bias (for choosing only)"
                if bias is not None else "router_scores")
        choice = trace.record(f"{name}.choice_scores", what, choice)  # [B, T, E]
        best_two = choice.view(B, T, G, E // G).topk(2, dim=-1)[0]  # [B, T, G, 2]
        group_scores = trace.record(f"{name}.group_scores", "sum of each group's 2 best "
                                    "choice_scores", best_two.sum(-1))  # [B, T, G]
        groups = group_scores.topk(self.topk_group, dim=-1)[1]  # [B, T, topk_group]
        groups = trace.record(f"{name}.groups_chosen", f"the {self.topk_group} best groups",
                              groups)  # [B, T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(-1, groups, True)
        keep = keep[..., None].expand(B, T, G, E // G).reshape(B, T, E)  # [B, T, E]
        ids = choice.masked_fill(~keep, float("-inf")).topk(k, dim=-1)[1]  # [B, T, k]
        weights = scores.gather(-1, ids)  # [B, T, k]: unbiased
        if self.renormalize:  # HF adds 1e-20 to the sum, as DeepSeek's code
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # [B, T, k]
        return ids, weights


# the config's moe_router -> its rule (config_checks.ROUTERS holds the same names)
ROUTERS_BY_NAME = {"softmax_topk": SoftmaxTopK, "topk_softmax": TopKSoftmax,
                   "topk_sigmoid": TopKSigmoid, "sigmoid_group": SigmoidGroup}


def router_of(name: str, k: int, renormalize: bool = True, scaling: float = 1.0,
              n_group: int = 1, topk_group: int = 1) -> Router:
    """The rule the config's `moe_router` names."""
    if name not in ROUTERS_BY_NAME:
        raise LlmTraceError(f"router must be one of {', '.join(ROUTERS)}, got {name!r}")
    return ROUTERS_BY_NAME[name](k, renormalize, scaling, n_group, topk_group)


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
    router: its rule by name (the config's `moe_router`) or a `Router`; n_group,
    topk_group: `SigmoidGroup`'s groups; scaling: routed_scaling_factor."""
    _check_args(w, k, act)
    if not isinstance(router, Router):
        router = router_of(router, k, renormalize, scaling, n_group, topk_group)
    B, T, D = x.shape
    E, Fsz, _ = w.gate.shape
    op = "x @ W_router^T" + (" + b_router" if w.router_bias is not None else "")
    xr, wr = (x.float(), w.router.float()) if router.in_fp32 else (x, w.router)
    logits = trace.record(f"{name}.router", op, F.linear(xr, wr, w.router_bias),
                          B * T * D * E)  # [B, T, E]
    ids, weights = router(logits, w.score_bias, trace, name)  # [B, T, k] each
    ids = trace.record(f"{name}.experts_chosen", f"{router.chose}: expert ids",
                       ids)  # [B, T, k]
    weights = trace.record(f"{name}.expert_weights", router.weighs_all(),
                           weights)  # [B, T, k]
    mlp = {"silu": "SwiGLU", "gelu_tanh": "GeGLU"}.get(act, "gpt-oss GLU")
    out = trace.record(f"{name}.expert_out", f"the j-th chosen expert's {mlp} MLP",
                       chosen_expert_outputs(x, w, ids, act, limit, alpha),
                       B * T * k * 3 * D * Fsz)  # [B, T, k, D]
    y = (weights[..., None] * out).sum(dim=2).to(x.dtype)  # [B, T, D]: fp32 weights, x's dtype
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


def _check_args(w: MoeWeights, k: int, act: str) -> None:
    E = w.gate.shape[0]
    if act not in ACTS:
        raise LlmTraceError(f"act must be one of {', '.join(ACTS)}, got {act!r}")
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= E:
        raise LlmTraceError(f"k (experts per position) must be a whole number "
                            f"in 1 .. {E}, got {k!r}")


class MoE(Part):
    """A layer's mixture of experts as a part, in the gated MLP's place: x [B, T, D] ->
    [B, T, D], its weights `w.moe` (`MoeWeights`), its router and experts as the config
    says (`moe_mlp`). Stored as Qwen3-MoE stores them: each expert's matrices under names
    of their own (`tensors`, where "{e}" stands for the expert), stacked when loaded."""
    block = "mlp"  # where a layer keeps its experts: model.layers.N.<block>
    kinds = ("gate_proj", "up_proj", "down_proj")  # each expert's gate, up and down

    def __init__(self, config, layer: int = 0):
        c = config
        self.k, self.act, self.limit, self.alpha = (c.n_experts_active, c.mlp_act,
                                                    c.swiglu_limit, c.swiglu_alpha)
        self.router = router_of(c.moe_router, c.n_experts_active, c.moe_renormalize,
                                c.moe_scaling, c.moe_groups, c.moe_groups_chosen)
        self.n_experts, self.hidden, self.width = c.n_experts, c.hidden_size, c.moe_ffn_size

    def tensors(self):
        """Its weights as it computes with them, expert e's matrix at [e] of each stack."""
        E, D, Fm, b = self.n_experts, self.hidden, self.width, self.block
        gate, up, down = self.kinds
        return {"moe.router": (f"{b}.gate.weight", (E, D)),
                "moe.gate": (f"{b}.experts.{{e}}.{gate}.weight", (E, Fm, D)),
                "moe.up": (f"{b}.experts.{{e}}.{up}.weight", (E, Fm, D)),
                "moe.down": (f"{b}.experts.{{e}}.{down}.weight", (E, D, Fm))}

    def shared_expert(self, where: str, width: int) -> dict:
        """A shared expert's weights, one dense MLP `width` wide, under `where` on disk."""
        D = self.hidden
        return {f"moe.shared.{kind}": (f"{where}.{kind}_proj.weight", shape) for kind, shape in
                (("gate", (width, D)), ("up", (width, D)), ("down", (D, width)))}

    def on_disk(self):
        out = {}
        for name, shape in self.tensors().values():
            out.update({name.format(e=e): shape[1:] for e in range(self.n_experts)}
                       if "{e}" in name else {name: shape})
        return out

    def load(self, get, prefix):
        """`w.moe`: each stack from its experts' tensors; "moe.shared.*", a dense MLP's."""
        t = {}
        for field, (name, _) in self.tensors().items():
            name = f"{prefix}.{name}"
            t[field.removeprefix("moe.")] = (
                torch.stack([get(name.format(e=e)) for e in range(self.n_experts)])
                if "{e}" in name else get(name))
        shared = {f.removeprefix("shared."): t.pop(f) for f in list(t) if f.startswith("shared.")}
        return {"moe": MoeWeights(**t, shared=MlpWeights(**shared) if shared else None)}

    def save(self, w, prefix):
        out = {}
        for field, (name, _) in self.tensors().items():
            t, name = attrgetter(field.removeprefix("moe."))(w.moe), f"{prefix}.{name}"
            out.update({name.format(e=e): t[e] for e in range(self.n_experts)}
                       if "{e}" in name else {name: t})
        return out

    def __call__(self, x, w, trace=NO_TRACE, name: str = "mlp"):
        return moe_mlp(x, w.moe, self.k, self.router, act=self.act, limit=self.limit,
                       alpha=self.alpha, trace=trace, name=name)  # [B, T, D]


class InputScaledMoE(MoE):
    """Llama 4's mixture of experts: the router's k best logits, each through a sigmoid
    (`topk_sigmoid`), scale the input of the expert they chose; the experts' outputs are summed
    as they come, and a shared expert (`w.moe.shared`) runs at every position."""

    def __init__(self, config, layer: int = 0):
        super().__init__(config, layer)
        self.shared = config.n_shared_experts  # shared experts (0: none), one dense MLP

    def __call__(self, x, w, trace=NO_TRACE, name: str = "mlp"):
        m = w.moe
        B, T, D = x.shape
        E, Fsz, _ = m.gate.shape
        _check_args(m, self.k, self.act)
        logits = trace.record(f"{name}.router", "x @ W_router^T", F.linear(x, m.router),
                              B * T * D * E)  # [B, T, E]
        ids, weights = self.router(logits, None, trace, name)  # [B, T, k] each
        ids = trace.record(f"{name}.experts_chosen", f"{self.router.chose}: expert ids",
                           ids)  # [B, T, k]
        weights = trace.record(f"{name}.expert_weights", self.router.weighs_all(),
                               weights)  # [B, T, k]
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
