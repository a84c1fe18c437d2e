"""Chapter 1: the machine's size, from its config alone."""

from llmtrace_book import Config, meta_model
from llmtrace_book.model import state_dict_from_weights

from .registry import Case, exercise


def count_parameters(config) -> int:
    """The number of parameters of a model, from its config alone: the embedding table [V, D];
    per block, the two norms' weights [D], q_proj [H * hd, D] and o_proj [D, H * hd], k_proj and
    v_proj [KV * hd, D] each, gate and up [F, D] and down [D, F]; the final norm [D]; and the LM
    head [V, D], unless it is tied to the embedding (`config.tied_lm_head`: one matrix serves
    both ends). The fields: vocab_size, hidden_size, n_layers, n_heads, n_kv_heads, head_dim,
    ffn_size, tied_lm_head. Today's families add a few vectors per block (chapter 17): biases
    on q, k, v (`qkv_bias`), q_norm and k_norm [head_dim] each (`qk_norm`), and two more norms
    [D] after the sublayers (`sandwich_norm`)."""
    c = config
    V, D, F, L = c.vocab_size, c.hidden_size, c.ffn_size, c.n_layers
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim  # widths of Q and of K, V
    block = 2 * D + 2 * q * D + 2 * kv * D + 3 * F * D  # norms, q and o, k and v, the FFN
    block += (q + 2 * kv) * bool(c.qkv_bias)  # Qwen2's biases on q, k, v
    block += 2 * c.head_dim * bool(c.qk_norm)  # Qwen3's and Gemma 3's q_norm, k_norm
    block += 2 * D * bool(c.sandwich_norm)  # Gemma 3's norms after each sublayer
    head = 0 if c.tied_lm_head else V * D
    return V * D + L * block + D + head  # embedding, the blocks, the final norm, the head


def loaded(c: Config, weights=None) -> int:
    """What a model of this config holds: its weights, or on the meta device their shapes."""
    w = weights if weights is not None else meta_model(c).weights
    return sum(t.numel() for t in state_dict_from_weights(c, w).values())


def family_configs(model) -> list[Config]:
    """The running model's config, then Llamas of other sizes (chapter 1 teaches one Llama:
    another family's switches are counted when the running model is of that family)."""
    return [model.config] + [Config.from_name(n) for n in
                             ("tinyllama-1.1b", "llama-3.2-1b", "mistral-7b-v0.1")]


def hints(c: Config, off: int) -> str | None:
    """The hint for a count that is `off` from the truth on config c."""
    V, D, F, L = c.vocab_size, c.hidden_size, c.ffn_size, c.n_layers
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    switches = [  # a family's switch first: its count may equal a generic slip's
        (-L * (q + 2 * kv) * c.qkv_bias, "this config has qkv_bias (Qwen2): a bias on q, k "
                                         "and v in every block"),
        (-2 * L * c.head_dim * c.qk_norm, "this config has qk_norm (Qwen3, Gemma 3): q_norm "
                                          "and k_norm, head_dim weights each, in every block"),
        (-2 * L * D * c.sandwich_norm, "this config has sandwich_norm (Gemma 3): two more "
                                       "norms per block, after the sublayers")]
    known = switches + [
        (-V * D if not c.tied_lm_head else V * D,
         "the LM head is tied to the embedding: one matrix, counted once" if c.tied_lm_head
         else "the LM head is not tied to the embedding: a [V, D] matrix of its own"),
        (2 * L * (q - kv) * D, "k_proj and v_proj have n_kv_heads heads, not n_heads "
                               "(grouped-query attention)"),
        (-(2 * L + 1) * D, "the norms have weights too: two per block and the final one, "
                           "hidden_size each"),
        (-D, "the final norm's weight is missing: hidden_size more"),
        (-2 * L * D, "each block has two norms, hidden_size weights each"),
        (-L * F * D, "the FFN has three matrices: gate, up and down")]
    return next((hint for k, hint in known if k and k == off), None)


@exercise(1, count_parameters)
def _(model) -> Case:
    configs = family_configs(model)
    want = [loaded(configs[0], model.weights)] + [loaded(c) for c in configs[1:]]
    for c, n in zip(configs, want):  # the reference must count what each holds
        if count_parameters(c) != n:
            raise ValueError(f"{c.name} holds {n:,} parameters, not what its config gives")

    def call(fn):
        from .registry import run
        return [run(fn, c, names=["config"]) for c in configs]

    def whole(x):
        if hasattr(x, "item") and getattr(x, "numel", lambda: 0)() == 1:
            x = x.item()
        if isinstance(x, float) and x.is_integer():
            x = int(x)
        return x

    def compare(got, want):
        for c, g, w in zip(configs, got, want):
            g = whole(g)
            if not isinstance(g, int) or isinstance(g, bool):
                return f"wanted a whole number, got {type(g).__name__}"
            if g != w:
                where = "the running model" if c is configs[0] else c.name
                hint = hints(c, g - w)
                return (f"on {where}: wanted {w:,}, got {g:,} ({g - w:+,})"
                        + (f"; hint: {hint}" if hint else ""))
        return None
    compare.rtol = None
    return Case(call, want, f"the {want[0]:,} loaded, and {len(configs) - 1} more configs",
                compare)
