"""The exercises on today's families: the checks feed each family's own streams (Gemma 3's scaled
embedding, its norms after each sublayer, a window, QK-norm), so the reference solutions pass on
tiny checkpoints of each, and a wrong version still fails."""

import pytest
import torch

from helpers import verdict
from llmtrace import load_model
from llmtrace.exercises import solution


def _hf_family_models():
    """(family, HF config dict, HF's parameter count) of each tiny family."""
    import transformers
    from test_gemma3 import TINY_GEMMA3
    from tiny_checkpoint import FAMILIES, TINY

    made = {f: (getattr(transformers, cls)(**{**TINY, **changes}), model_cls)
            for f, (cls, model_cls, changes) in FAMILIES.items()}
    made["gemma3"] = (transformers.Gemma3TextConfig(**TINY_GEMMA3), "Gemma3ForCausalLM")
    for f, (hf_config, model_cls) in made.items():
        hf = getattr(transformers, model_cls)(hf_config)
        yield f, hf_config.to_dict(), sum(p.numel() for p in hf.parameters())


def test_count_parameters_counts_each_familys_switches():
    """The reference counts what HF's own class holds for every family: Qwen2's biases,
    Qwen3's and Gemma 3's q_norm and k_norm, Gemma 3's norms after each sublayer."""
    from llmtrace import Config

    for f, hf_dict, want in _hf_family_models():
        c = Config.from_hf(hf_dict, name=f)
        assert solution("count_parameters")(c) == want, f


def test_rms_norm_check_feeds_gemmas_scaled_embedding(capsys, tmp_path):
    """Gemma 3's layer 0 normalizes embed.scaled with the gain (1 + weight): the check must
    feed that stream, or no correct function can pass."""
    import shutil

    from test_gemma3 import make_gemma3_checkpoint
    from tiny_checkpoint import make_tiny_checkpoint

    d = make_gemma3_checkpoint(tmp_path / "gemma3")
    llama = make_tiny_checkpoint(tmp_path / "llama")  # its tokenizer: 32,000 ids too
    for f in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(llama / f, d / f)
    gemma = load_model(str(d))

    def gemma_rms_norm(x, weight, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)

    ok, line = verdict(capsys, "rms_norm", gemma_rms_norm, gemma)
    assert ok, line


@pytest.mark.parametrize("family", ["mistral", "qwen3", "gemma3"])
def test_block_head_and_cache_checks_on_todays_families(capsys, tmp_path, family):
    """residual_block gives the family's own sublayers (window, QK-norm, Gemma's norms after
    each sublayer), lm_head the final norm's gain, kv_cache_step a position inside the window
    and Gemma's score scale: the solutions pass; a block without its MLP's residual fails."""
    import shutil

    from tiny_checkpoint import make_tiny_checkpoint
    d = make_tiny_checkpoint(tmp_path / family, family=family.replace("gemma3", "llama"))
    if family == "gemma3":  # Gemma's weights, beside the Llama checkpoint's tokenizer
        from test_gemma3 import make_gemma3_checkpoint
        shutil.copytree(d, tmp_path / "gemma3-tiny")
        d = make_gemma3_checkpoint(tmp_path / "gemma3-tiny")
    fam = load_model(d)
    assert fam.config.sandwich_norm == (family == "gemma3")
    for name in ["residual_block", "lm_head", "kv_cache_step"]:
        ok, line = verdict(capsys, name, solution(name), fam)
        assert ok, line
    ok, line = verdict(capsys, "residual_block",
                       lambda x, a, m, n1, n2: m(n2(x + a(n1(x)))), fam)
    assert not ok, line
