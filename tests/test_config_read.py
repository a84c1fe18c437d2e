"""A config.json is taken at its word: a key left out gets the default HF's own config class of
that model_type gives it (checked against the class, on the same file), a value that makes no
model is refused by its config.json key, and config reading holds no `value or default`."""

import ast
import inspect
import json

import pytest
import torch
import transformers

from helpers import one_line
from llmtrace_book import Config, LlmTraceError, load_model
from llmtrace_book import config as config_module
from llmtrace_book import families
from llmtrace_book.families import _read, gemma3, mistral, qwen2
from llmtrace_book.weights import gguf as gguf_module
from tiny_checkpoint import make_tiny_checkpoint

# The keys every file gives (they fix the weights' shapes); the rest is left out
SHAPES = dict(vocab_size=60000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
              num_attention_heads=32)
FAMILIES = tuple(families.REGISTRY)


def both(tmp_path, settings: dict):
    """(llmtrace's Config, HF's AutoConfig) of one config.json."""
    (tmp_path / "config.json").write_text(json.dumps(settings))
    return Config.from_hf(tmp_path), transformers.AutoConfig.from_pretrained(tmp_path)


def hf_end_ids(hf) -> tuple:
    eos = hf.eos_token_id
    return tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_key_left_out_gets_hfs_default(tmp_path, family):
    vocab = {"vocab_size": 128256} if family == "smollm3" else {}  # its default ids: 128000...
    # DeepseekV2Config's num_experts_per_tok is None: no model; llmtrace asks for it
    routed = {"num_experts_per_tok": 6} if family == "deepseek_v2" else {}
    ours, hf = both(tmp_path, {"model_type": family, **SHAPES, **vocab, **routed})
    assert type(hf).__name__ == families.REGISTRY[family].config_class
    if family == "gemma4_text":  # its full layers' head_dim is theirs (per_layer_config)
        full = hf.layer_types.index("full_attention")
        assert ours.global_head_dim == hf.per_layer_config[full].head_dim == 512
        hf.allow_global_per_layer_attribute_access = True  # the sliding layers' values
        assert ours.ple_size == hf.hidden_size_per_layer_input == 256
        assert ours.ple_vocab == hf.vocab_size_per_layer_input
        assert ours.kv_shared_layers == hf.num_kv_shared_layers == 0
        assert ours.sliding_window == hf.sliding_window == 512
        assert ours.layer_types == tuple(t.split("_")[0] for t in hf.layer_types)
        rope = hf.rope_parameters
        assert ours.rope_theta == rope["full_attention"]["rope_theta"]
        assert ours.rope_partial == rope["full_attention"]["partial_rotary_factor"]
        assert ours.rope_local_theta == rope["sliding_attention"]["rope_theta"]
    # latent attention has a K and V per head, whatever num_key_value_heads says (HF reads none)
    latent = family in families.MLA_COMPUTED
    assert ours.n_kv_heads == (hf.num_attention_heads if latent else hf.num_key_value_heads)
    width = getattr(hf, "head_dim", None)  # Qwen2Config has none: hidden / heads
    assert ours.head_dim == (hf.hidden_size // 32 if width is None else width)
    assert ours.max_positions == hf.max_position_embeddings
    assert ours.norm_eps == hf.rms_norm_eps
    assert ours.tied_lm_head == hf.tie_word_embeddings
    assert ours.bos_id == hf.bos_token_id
    assert ours.end_ids == hf_end_ids(hf)
    rope = hf.rope_parameters
    if family == "gemma4_text":
        pass  # read above
    elif family == "gemma3_text":
        assert ours.rope_theta == rope["full_attention"]["rope_theta"]
        assert ours.rope_local_theta == rope["sliding_attention"]["rope_theta"]
        assert ours.attn_scale == hf.query_pre_attn_scalar ** -0.5
        assert ours.layer_types == tuple(t.split("_")[0] for t in hf.layer_types)
    elif family == "olmo3":  # a base per kind, the same by default; every fourth layer full
        assert ours.rope_theta == rope["full_attention"]["rope_theta"]
        assert (ours.rope_local_theta or ours.rope_theta) == rope["sliding_attention"][
            "rope_theta"]
        assert ours.layer_types == tuple(t.split("_")[0] for t in hf.layer_types)
    else:
        assert ours.rope_theta == rope["rope_theta"]
    if family == "smollm3":  # no_rope_layer_interval 4: no layer of 2 without RoPE
        assert ours.no_rope_layers == () and hf.no_rope_layers == [1, 1]
        assert ours.sliding_window == 0 and hf.use_sliding_window is False
    if family in ("mistral", "gemma3_text", "olmo3"):
        assert ours.sliding_window == hf.sliding_window == 4096


@pytest.mark.parametrize("family, key", [
    ("llama", "num_key_value_heads"), ("qwen3", "num_key_value_heads"), ("llama", "head_dim"),
    ("mistral", "head_dim"), ("mistral", "sliding_window"), ("llama", "bos_token_id"),
    ("qwen2", "eos_token_id"), ("mistral", "eos_token_id")])
def test_a_null_means_what_hf_makes_of_it(tmp_path, family, key):
    ours, hf = both(tmp_path, {"model_type": family, **SHAPES, key: None})
    width = getattr(hf, "head_dim", None)
    assert ours.n_kv_heads == hf.num_key_value_heads
    assert ours.head_dim == (hf.hidden_size // 32 if width is None else width)
    assert ours.sliding_window == (getattr(hf, "sliding_window", None) or 0)  # None: none
    assert (ours.bos_id, ours.end_ids) == (hf.bos_token_id, hf_end_ids(hf))


def hf_logits(d, ids):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        d, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(ids).logits[0]  # [T, V]


IDS = torch.randint(3, 32000, (1, 11), generator=torch.Generator().manual_seed(5))  # [1, T]


def test_llama_without_rms_norm_eps_runs_hfs(tmp_path):
    """HF's LlamaConfig gives 1e-6; the 1e-5 that was used before moves the logits by 9e-3 on
    this checkpoint (measured), ninety times the tolerance."""
    d = make_tiny_checkpoint(tmp_path / "llama", rms_norm_eps=1e-6)
    c = json.loads((d / "config.json").read_text())
    del c["rms_norm_eps"]
    (d / "config.json").write_text(json.dumps(c))
    model, ref = load_model(d), hf_logits(d, IDS)
    assert model.config.norm_eps == 1e-6
    ours = model.run(IDS, keep_values=False)[0][0]  # [T, V]
    assert (ours - ref).abs().max().item() < 1e-4
    old = model.__class__(model.config.replace(norm_eps=1e-5), model.weights)
    assert (old.run(IDS, keep_values=False)[0][0] - ref).abs().max().item() > 1e-3


def test_qwen3_without_head_dim_is_128_as_hfs(tmp_path):
    d = make_tiny_checkpoint(tmp_path / "qwen3", family="qwen3", head_dim=128)
    c = json.loads((d / "config.json").read_text())
    del c["head_dim"]
    (d / "config.json").write_text(json.dumps(c))
    model = load_model(d)  # once said the checkpoint "disagrees" with its config
    assert model.config.head_dim == 128 != 64 // 4
    ours = model.run(IDS, keep_values=False)[0][0]
    assert (ours - hf_logits(d, IDS)).abs().max().item() < 1e-4


def test_mistral_without_sliding_window_has_hfs_window(ckpt):
    c = json.loads((ckpt / "config.json").read_text())
    c.pop("sliding_window", None)
    (ckpt / "config.json").write_text(json.dumps({**c, "model_type": "mistral"}))
    hf = transformers.AutoConfig.from_pretrained(ckpt)
    assert load_model(ckpt).config.sliding_window == hf.sliding_window == 4096


GEMMA = {"model_type": "gemma3_text", **SHAPES}
LLAMA4 = {"model_type": "llama4_text"}
FULL_ROPE = {"full_attention": {"rope_type": "default", "rope_theta": 0},
             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}


@pytest.mark.parametrize("settings, says", [
    ({"rope_theta": 0}, "rope_theta=0 must be a positive number"),
    ({"rope_theta": -1.0}, "rope_theta=-1.0 must be a positive number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
     "rope_parameters.rope_theta=0 must be a positive number"),
    ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
     "rope_parameters.rope_theta=500000 and rope_theta=10000 disagree: keep one"),
    ({**GEMMA, "rope_parameters": FULL_ROPE},
     "rope_parameters.full_attention.rope_theta=0 must be a positive number"),
    ({**GEMMA, "rope_local_base_freq": 0}, "rope_local_base_freq=0 must be a positive number"),
    ({**GEMMA, "rope_theta": -5}, "rope_theta=-5 must be a positive number"),
    ({"num_key_value_heads": 0}, "num_key_value_heads=0 must be at least 1"),
    ({"num_key_value_heads": 5}, "num_attention_heads=32 is not a multiple of "
                                 "num_key_value_heads=5"),
    ({"model_type": "qwen2", "num_attention_heads": 4},
     "num_key_value_heads=32 (num_key_value_heads left out of the file: Qwen2Config's default)"),
    ({**GEMMA, "query_pre_attn_scalar": 0}, "query_pre_attn_scalar=0 must be a positive number"),
    ({**GEMMA, "query_pre_attn_scalar": -4}, "query_pre_attn_scalar=-4 must be a positive"),
    ({"head_dim": 0}, "head_dim=0 must be at least 1"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window=0 must be at least 1"),
    ({"rms_norm_eps": None}, "rms_norm_eps is null: give a number, or leave the key out for "
                             "LlamaConfig's 1e-06"),
    ({"model_type": "mistral", "num_key_value_heads": None},
     "num_key_value_heads is null: give an integer, or leave the key out for MistralConfig's 8"),
    ({"rms_norm_eps": -1e-5}, "rms_norm_eps=-1e-05 must be >= 0"),
    ({"max_position_embeddings": 0}, "max_position_embeddings=0 must be at least 1"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "rope_parameters.partial_rotary_factor=0.5 (RoPE on part of each head) is not implemented"),
    ({**GEMMA, "attention_bias": True}, "attention_bias=true (projections with a bias vector)"),
    ({"eos_token_id": [2, "x"]}, "eos_token_id must be a token id, a list of them or null"),
    ({"eos_token_id": 60000}, "eos_token_id=60000 is not below vocab_size=60000"),
    ({"model_type": "llama4"}, "model_type 'llama4' (Llama 4 with its vision tower, "
                               "Llama4ForConditionalGeneration) is not implemented: llmtrace "
                               "computes its text model, model_type 'llama4_text'"),
    ({**LLAMA4, "attn_temperature_tuning": 4},
     "attn_temperature_tuning must be true or false, got 4"),
    ({**LLAMA4, "attention_chunk_size": None, "layer_types": ["chunked_attention"] * 2},
     "layer_types names chunked_attention layers but attention_chunk_size is null"),
    ({**LLAMA4, "no_rope_layers": [1]}, "no_rope_layers must list 1 (RoPE) or 0 (none) for each "
                                        "of the 2 layers"),
    ({**LLAMA4, "moe_layers": [2]}, "moe_layers must list layer indices 0 .. 1"),
    ({**LLAMA4, "floor_scale": 0}, "floor_scale=0 must be at least 1"),
    ({**LLAMA4, "num_experts_per_tok": 17},
     "num_experts_per_tok=17 must lie in 1 .. num_local_experts=16"),
])
def test_a_value_that_makes_no_model_is_refused_by_its_key(settings, says):
    with pytest.raises(LlmTraceError) as err:
        Config.from_hf({**SHAPES, **settings})
    assert says in one_line(err)


def test_the_cli_refuses_query_pre_attn_scalar_zero(tmp_path, capsys):
    """Once a ZeroDivisionError traceback from the API, exit status 1 from the CLI."""
    from llmtrace_book.__main__ import main

    (tmp_path / "config.json").write_text(json.dumps({**GEMMA, "query_pre_attn_scalar": 0}))
    assert main(["--shapes-only", "--model", str(tmp_path), "Hi"]) == 2
    err = capsys.readouterr().err
    assert "query_pre_attn_scalar=0 must be a positive number" in err and "Traceback" not in err


# --- no `value or default` in config reading -------------------------------------------------
WRITERS = ("to_hf", "write", "llama_hf", "gemma3_to_hf")  # writing a config.json, where 0 -> null is the meaning


def or_fallbacks(source: str) -> list[str]:
    """Each `x or y` in the source that falls back from a value read (a `get` call) or to a
    number: the pattern that once turned a rope_theta of 0 into 10,000."""
    found = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.Module)) or getattr(fn, "name", "") in WRITERS:
            continue
        body = fn.body if isinstance(fn, ast.FunctionDef) else [
            n for n in fn.body if not isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        for node in (n for stmt in body for n in ast.walk(stmt)):
            if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and any(
                    reads_or_number(v) for v in node.values):
                found.append(ast.unparse(node))
    return found


def reads_or_number(node) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, (ast.List, ast.Tuple)):  # `eos or [2]`: an id invented
        return any(reads_or_number(e) for e in node.elts)
    if isinstance(node, ast.Subscript):  # `c["head_dim"] or ...`
        return isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str)
    if isinstance(node, ast.Call):
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        key = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else None
        return name in ("get", "default") and key != "_name_or_path"  # a name is text
    return False


def test_the_scan_finds_the_old_fallbacks():
    old = ('n = get("num_key_value_heads", int, 0) or get("num_attention_heads", int)\n'
           'theta = full.get("rope_theta") or 1_000_000.0\n'
           'name = name or c.get("_name_or_path") or "hf-model"\n'
           'eos, *stops = eos or [2]\n'
           'head_dim = v["head_dim"] or v["hidden_size"] // v["n_heads"]\n')
    assert or_fallbacks(old) == ['get(\'num_key_value_heads\', int, 0) or '
                                 'get(\'num_attention_heads\', int)',
                                 "full.get('rope_theta') or 1000000.0", "eos or [2]",
                                 "v['head_dim'] or v['hidden_size'] // v['n_heads']"]


@pytest.mark.parametrize("module", [config_module, gguf_module, families, _read, gemma3,
                                    mistral, qwen2])
def test_config_reading_has_no_or_fallback(module):
    assert or_fallbacks(inspect.getsource(module)) == []
