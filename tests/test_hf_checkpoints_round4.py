"""Checkpoints HF's own classes write and run that the library once refused or computed wrong
(round 4 of a hostile suite against HF's classes): Gemma 4 with no soft cap (null) and with full
layers of the sliding layers' shape (per_layer_config {}), DeepSeek and Qwen3-Next with a shared
expert of width 0, Qwen3-Next with no DeltaNet layer, DeepSeek-V3's switches written null; what
`save_hf` writes of every row's ids (null or left out) HF reads back to the same logits; and
every error about a config.json names the file's key, in the CLI too. Each parity test prints
its max |logit difference| against HF's eager forward (`pytest -s` shows them)."""

import json
import re

import pytest
import torch
import transformers

from helpers import one_line
from llmtrace_book import Config, LlmTraceError, generate, load_model
from llmtrace_book.__main__ import main
from llmtrace_book.config import FIELD_DEFAULTS
from llmtrace_book.model import state_dict_from_weights
from llmtrace_book.weights.hf import save_hf
from tiny_checkpoint import ROWS, hf_config, make_tiny_checkpoint

TOL = 1e-4
IDS = torch.randint(3, 32000, (1, 11), generator=torch.Generator().manual_seed(5))  # [1, T]


def hf_model(d):
    return transformers.AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32).eval()


def hf_logits(hf, ids=IDS) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.as_tensor(ids).reshape(1, -1)).logits[0]  # [T, V]


def max_diff(model, hf, what: str) -> float:
    """The largest |logit| difference of the library's prefill from HF's, printed."""
    diff = (model.run(IDS, keep_values=False)[0][0] - hf_logits(hf)).abs().max().item()
    print(f"{what}: max |logit difference| vs HF {diff:.2e}")
    return diff


def written_back(model, d):
    """save_hf's checkpoint of a loaded model, and HF's model of it."""
    out = save_hf(d, model.config, state_dict_from_weights(model.config, model.weights))
    return out, hf_model(out)


def parity(tmp_path, family, **overrides):
    """(config.json as HF wrote it, the library's model): the library's logits are HF's, and
    HF's own class reads what save_hf writes back to the same logits."""
    d = make_tiny_checkpoint(tmp_path / family, family=family, **overrides)
    model, hf = load_model(d), hf_model(d)
    label = f"{family} {overrides}"
    assert max_diff(model, hf, label) < TOL
    _, back = written_back(model, tmp_path / "back")
    assert max_diff(model, back, f"{label}, written back") < TOL
    return json.loads((d / "config.json").read_text()), model


# --- 1. Gemma 4 with no soft cap -----------------------------------------------------------------
def test_gemma4_soft_cap_null_is_none(tmp_path):
    """save_pretrained writes final_logit_softcapping: null for a model with no cap; save_hf
    writes the same, and reads its own file back."""
    written, model = parity(tmp_path, "gemma4_text", final_logit_softcapping=None)
    assert written["final_logit_softcapping"] is None and model.config.final_softcap == 0.0
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["final_logit_softcapping"] is None
    assert Config.from_hf(tmp_path / "back", name=model.config.name) == model.config


# --- 2. Gemma 4 whose full layers have the sliding layers' shape ------------------------------
@pytest.mark.parametrize("k_eq_v", [False, True])
def test_gemma4_per_layer_config_empty(tmp_path, k_eq_v):
    """With global_head_dim equal to head_dim (and, with attention_k_eq_v, as many KV heads),
    HF's per_layer_config holds no override: save_pretrained writes {}."""
    kv = {"num_global_key_value_heads": 2} if k_eq_v else {}
    written, model = parity(tmp_path, "gemma4_text", global_head_dim=16,
                            attention_k_eq_v=k_eq_v, **kv)
    assert written["per_layer_config"] == {}
    c = model.config
    assert (c.global_head_dim or c.head_dim, c.global_kv_heads or c.n_kv_heads, c.k_eq_v) == (
        16, 2, k_eq_v)


def test_gemma4_per_layer_kv_heads_without_k_eq_v(tmp_path):
    """HF's class reads per_layer_config's num_key_value_heads whatever attention_k_eq_v says:
    full layers of 1 KV head with a V projection of their own."""
    per = {i: {"head_dim": 32, "num_key_value_heads": 1} for i in (1, 3, 5)}
    _, model = parity(tmp_path, "gemma4_text", attention_k_eq_v=False, per_layer_config=per)
    assert (model.config.global_kv_heads, model.config.k_eq_v) == (1, False)
    assert model.weights.layers[1].v_proj.shape == (32, 64)


# --- 3. a shared expert of width 0 --------------------------------------------------------------
@pytest.mark.parametrize("family, change", [
    ("deepseek_v3", {"n_shared_experts": 0}), ("deepseek_v2", {"n_shared_experts": 0}),
    ("qwen3_next", {"shared_expert_intermediate_size": 0})])
def test_shared_expert_of_width_0(tmp_path, family, change):
    """HF's class builds the shared expert with no columns (and Qwen3-Next its gate, which
    scales zeros); save_pretrained writes those tensors."""
    _, model = parity(tmp_path, family, **change)
    assert all(lw.moe.shared is None for lw in model.weights.layers if lw.moe is not None)


# --- 4. Qwen3-Next with no DeltaNet layer -------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_qwen3_next_every_layer_full(tmp_path, family):
    """Every layer full attention: RoPE still turns a quarter of each head; decode too."""
    _, model = parity(tmp_path, family, layer_types=["full_attention"] * 4)
    assert model.config.layer_types == ("full",) * 4
    g = generate(model, IDS, 4, stop_at_eos=False, trace=False)
    ref = hf_logits(hf_model(tmp_path / family), g.ids)[IDS.shape[1] - 1:-1]  # [4, V]
    assert (torch.stack(g.step_logits) - ref).abs().max().item() < TOL


# --- a sibling: DeepSeek-V3's switches typed `bool | None` -------------------------------------
@pytest.mark.parametrize("key", ["norm_topk_prob", "rope_interleave"])
def test_deepseek_v3_switch_null_is_false(tmp_path, key):
    """DeepseekV3Config takes null for these; its class tests them for truth: false."""
    written, model = parity(tmp_path, "deepseek_v3", **{key: None})
    assert written[key] is None
    assert (model.config.moe_renormalize if key == "norm_topk_prob"
            else model.config.rope_interleave) is False


# --- 5. every row's ids through save_hf ---------------------------------------------------------
ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


@pytest.fixture(scope="module", params=list(ROWS))
def row(request, tmp_path_factory):
    f = request.param
    return f, make_tiny_checkpoint(tmp_path_factory.mktemp(f) / f, family=f)


def variant(src, d, key: str, mode: str):
    """The checkpoint with one id null or left out of config.json (the weights linked, no
    tokenizer: a null BOS would contradict its add_bos_token)."""
    d.mkdir()
    (d / "model.safetensors").symlink_to(src / "model.safetensors")
    c = json.loads((src / "config.json").read_text())
    if mode == "null":
        c[key] = None
    else:
        c.pop(key, None)
    (d / "config.json").write_text(json.dumps(c))
    return d


def hf_builds(d) -> bool:
    config = transformers.AutoConfig.from_pretrained(d)
    try:
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(config)
    except (AssertionError, ValueError, IndexError):  # e.g. a padding_idx past the vocabulary
        return False
    return True


@pytest.mark.parametrize("mode", ["null", "absent"])
@pytest.mark.parametrize("key", ID_KEYS)
def test_save_hf_writes_back_each_id(row, tmp_path, key, mode):
    """HF reads the same ids from save_hf's file as from the source (a null stays null, a key
    left out gets the class's default), loads it, and computes the library's logits."""
    f, src = row
    d = variant(src, tmp_path / "in", key, mode)
    source = transformers.AutoConfig.from_pretrained(d)
    try:
        model = load_model(d)
    except LlmTraceError as e:  # the class's default id is past the tiny vocabulary of 32000
        assert mode == "absent" and getattr(source, key) >= 32000
        assert f"{key}={getattr(source, key)} is not below vocab_size=32000" in one_line(e)
        return
    out = save_hf(tmp_path / "out", model.config,
                  state_dict_from_weights(model.config, model.weights))
    written = json.loads((out / "config.json").read_text())
    back = transformers.AutoConfig.from_pretrained(out)
    for k in ID_KEYS:
        assert written[k] == getattr(back, k) == getattr(source, k), k
    assert Config.from_hf(out, name=model.config.name) == model.config
    if not hf_builds(d):  # SmolLM3's default pad_token_id, 128004: HF refuses both alike
        assert mode == "absent" and not hf_builds(out)
        return
    assert max_diff(model, hf_model(out), f"{f} {key} {mode}, written back") < TOL


# --- 6. errors name the config.json key ---------------------------------------------------------
KEY_ERRORS = [
    ("qwen3_next", {"linear_num_value_heads": 3},
     "linear_num_value_heads=3 must be a multiple of linear_num_key_heads=2"),
    ("qwen3_next", {"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim=1 must be at least 2"),
    ("qwen3_5_text", {"linear_num_key_heads": 3},
     "linear_num_value_heads=4 must be a multiple of linear_num_key_heads=3"),
    ("gemma4_text", {"num_kv_shared_layers": 6},
     "num_kv_shared_layers=6 must be below num_hidden_layers=6"),
    ("gemma4_text", {"num_kv_shared_layers": -1}, "num_kv_shared_layers=-1 must be at least 0"),
    ("gemma4_text", {"hidden_size_per_layer_input": -1},
     "hidden_size_per_layer_input=-1 must be at least 0"),
    ("gemma4_text", {"vocab_size_per_layer_input": 0},
     "hidden_size_per_layer_input=8 needs vocab_size_per_layer_input"),
    ("gemma4_text", {"per_layer_config": {i: {"head_dim": 32, "num_key_value_heads": 3}
                                          for i in ("1", "3", "5")}},
     "num_attention_heads=4 is not a multiple of per_layer_config.num_key_value_heads=3"),
    ("mixtral", {"num_experts_per_tok": 5},
     "num_experts_per_tok=5 must lie in 1 .. num_local_experts=4"),
    ("qwen2", {"num_attention_heads": 3},
     "hidden_size=64 / num_attention_heads=3 gives heads of 21 dims, odd"),
]


def internal_fields(message: str, c: dict) -> set:
    """The library's own field names a message says that are no key of the file."""
    keys = set(c) | {k for v in c.values() if isinstance(v, dict) for k in v}
    words = set(re.findall(r"\b[a-z][a-z0-9]*(?:_[a-z0-9]+)+\b", message))
    return {w for w in words if w in FIELD_DEFAULTS and w not in keys}


@pytest.mark.parametrize("family, change, said", KEY_ERRORS)
def test_errors_name_the_config_json_key(tmp_path, capsys, family, change, said):
    c = {**hf_config(family).to_dict(), **change}
    with pytest.raises(LlmTraceError) as err:
        Config.from_hf(c, name="x")
    assert said in one_line(err) and not internal_fields(str(err.value), c)
    (tmp_path / "config.json").write_text(json.dumps(c))
    assert main(["--shapes-only", "--model", str(tmp_path), "hi"]) != 0
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("family", list(ROWS))
def test_no_error_names_an_internal_field(family):
    """Each integer, number and switch of the row's config.json set to values that break a
    rule: every refusal names keys of the file, never a field of `Config` the file lacks."""
    base = hf_config(family).to_dict()
    said = {}
    for key, value in base.items():
        if isinstance(value, bool):
            tries = (not value,)
        elif isinstance(value, int):
            tries = (-1, 0, 1, 3, 5, value + 1, 40000)
        elif isinstance(value, float):
            tries = (-1.0, 0.0, 0.5)
        else:
            continue
        for x in tries:
            c = {**base, key: x}
            try:
                Config.from_hf(c, name="x")
            except LlmTraceError as e:
                if internal_fields(one_line(e), c):
                    said[f"{key}={x}"] = str(e)
    assert not said, said
