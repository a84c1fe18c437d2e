"""The exercises on every family the library computes: each reference solution passes its check on
a tiny random checkpoint of Llama, Llama 3 (RoPE scaling), Mistral (a window), Qwen2 (biases),
Qwen3 (QK-norm, head_dim of its own) and Gemma 3 (query_pre_attn_scalar != head_dim, local and
global layers, norms after each sublayer, (1 + w) gains, GeGLU); a wrong version still fails."""


import pytest
import torch

from exercises import NAMES, solution
from helpers import verdict
from llmtrace_book import load_model

from tiny_checkpoint import ROWS, make_tiny_checkpoint

# the families whose blocks the exercises do not build yet, and why
NOT_EXERCISED = {**{f: "no norm before a sublayer, and the exercises read attn_norm's input"
                    for f in ("olmo2", "olmo3")},
                 **{f: "a mixture of experts: the exercises build the dense SwiGLU MLP"
                    for f in ("mixtral", "qwen3_moe", "qwen3_moe_sparse", "gpt_oss", "olmoe")},
                 "llama4_text": "RoPE on adjacent pairs, chunked and NoPE layers, experts: the "
                                "exercises build a Llama 2 block",
                 **{f: "latent attention: the exercises build K and V by GQA's projections"
                    for f in ("deepseek_v3", "deepseek_v2")},
                 **{f: "layer 0 is a Gated DeltaNet layer, and the exercises read attention's "
                       "records (delta_rule_step reads its own)" for f in ("qwen3_next",
                                                                         "qwen3_5_text")},
                 "gemma4_text": "layers of several widths, some reading another's K, V, and a "
                                "per-layer input: the exercises build a Llama block"}
FAMILIES = [f for f in ROWS if f not in NOT_EXERCISED]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    f = request.param
    model = load_model(make_tiny_checkpoint(tmp_path_factory.mktemp(f) / f, family=f))
    if f == "gemma3_text":
        c = model.config
        assert c.attn_scale != c.head_dim ** -0.5 and c.sandwich_norm and c.norm_offset
    return f, model


@pytest.mark.parametrize("name", NAMES)
def test_every_solution_passes_on_every_family(capsys, family_model, name):
    f, model = family_model
    ok, line = verdict(capsys, name, solution(name), model)
    assert ok and line.startswith(f"✓ {name}: matches "), f"{f}: {line}"


def test_a_wrong_block_still_fails_on_every_family(capsys, family_model):
    f, model = family_model
    ok, line = verdict(capsys, "residual_block", lambda x, a, m, n1, n2: m(n2(x + a(n1(x)))),
                       model)
    assert not ok, f"{f}: {line}"


def test_the_rms_norm_hint_is_true_on_gemma(capsys, family_model):
    """The gain is handed over as it multiplies (Gemma's 1 + w): a Llama RMSNorm passes, and
    eps outside the root is named only where eps matters."""
    f, model = family_model
    ok, line = verdict(capsys, "rms_normalize", lambda x, g, eps: g * x * torch.rsqrt(
        x.pow(2).mean(-1, keepdim=True) + eps), model)
    assert ok, line
    ok, line = verdict(capsys, "rms_normalize", lambda x, g, eps: x * torch.rsqrt(
        x.pow(2).mean(-1, keepdim=True) + eps), model)
    assert not ok and "multiply by the gain" in line, line


def test_rope_without_the_stretch_fails_on_llama3(capsys, family_model):
    """Llama 3's rope_scaling reaches the exercise as `stretch`: angles that ignore it pass
    elsewhere and fail there, with the hint."""
    f, model = family_model

    def unstretched(positions, head_dim, theta, stretch):
        return solution("rope_angles")(positions, head_dim, theta, lambda freqs: freqs)

    ok, line = verdict(capsys, "rope_angles", unstretched, model)
    if f == "llama3":
        assert not ok and "apply stretch" in line, line
    else:
        assert ok, line
