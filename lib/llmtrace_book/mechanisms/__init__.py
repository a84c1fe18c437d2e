"""What other families add to Llama's parts, each a part (or one step of a part) with the same
interface as the part it changes: a family's module (`families/`) builds its layers from these
and from Llama's parts, stating its difference. None of them is read by a Llama.

- `attention_steps`: the small changes to one step of `attention.Attention` that several
  families share: biases on the projections, a norm on each head of Q and K or on the whole
  projection, a scale of the scores, a sliding window, a learned sink per head, RoPE on some
  layers only; Llama 4's RoPE on adjacent pairs, weightless QK-norm, queries tempered by
  position and chunked attention.
- `yarn`: RoPE's tables stretched by YaRN.
- `moe`: a mixture of experts in place of the gated MLP, with its routers.
- `mla`: DeepSeek's multi-head latent attention, K and V rebuilt from a cached latent.
- `deltanet`: Qwen3-Next's Gated DeltaNet, a fixed state per head in place of a KV cache, and
  its gated attention.
- `gemma`: Gemma's norms around 1 + weight, GeGLU, the scaled embedding, norms after each
  sublayer; `gemma4`: layers of two shapes sharing K and V, per-layer inputs, the soft cap.
"""


def part(*classes):
    """The class whose bases are `classes`, those given as None or False left out, outermost
    first, as a class statement lists them: `part(HeadNormed, Attention)` is Llama's attention
    with Qwen3's norm on each head. A family states its difference this way, each step read from
    its config (so a config with a step turned off computes without it)."""
    bases = tuple(dict.fromkeys(c for c in classes if c))
    if len(bases) == 1:
        return bases[0]
    return type("+".join(b.__name__ for b in bases), bases, {})
