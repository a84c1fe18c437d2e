"""Start and end ids are never invented: `eos_token_id: null` is a model with no end id (generate
runs to max_new_tokens, whatever it draws), `bos_token_id: null` one with no BOS, and `save_hf`
writes back what was read, which HF reads the same."""

import json

import pytest
import transformers

from helpers import edit_config, one_line
from llmtrace_book import Config, LlmTraceError, generate, load_model
from llmtrace_book.model import state_dict_from_weights
from llmtrace_book.weights.hf import save_hf


def id_two_wins(logits):
    """A patch on the LM head: id 2 (Llama's </s>, an ordinary piece in Qwen's vocabulary) is
    the greedy choice at every step."""
    out = logits.clone()
    out[..., 2] = out.max() + 10.0
    return out


def test_eos_null_is_no_end_id(ckpt):
    edit_config(ckpt, eos_token_id=None)
    model = load_model(ckpt)
    assert model.config.eos_id is None and model.config.end_ids == ()
    g = generate(model, "Hi", max_new_tokens=4, trace=False, patch={"lm_head": id_two_wins})
    assert g.new_ids == [2, 2, 2, 2] and g.stop_reason == "max_new_tokens"
    edit_config(ckpt, eos_token_id=2)  # the same draw ends at once where 2 is the end id
    g = generate(load_model(ckpt), "Hi", max_new_tokens=4, trace=False,
                 patch={"lm_head": id_two_wins})
    assert g.new_ids == [2] and g.stop_reason == "eos"


def test_qwen_without_end_ids_invents_none():
    """Qwen2Config's default eos_token_id is None: a file that leaves it out has no end id."""
    c = Config.from_hf({"model_type": "qwen2", "vocab_size": 100, "hidden_size": 64,
                        "intermediate_size": 128, "num_hidden_layers": 1,
                        "num_attention_heads": 4, "num_key_value_heads": 2})
    assert (c.bos_id, c.eos_id, c.end_ids) == (None, None, ())


@pytest.mark.parametrize("written", [None, [], 5, [5, 7]])
def test_save_hf_writes_back_what_was_read(ckpt, tmp_path, written):
    edit_config(ckpt, eos_token_id=written, bos_token_id=None)
    model = load_model(ckpt)
    out = save_hf(tmp_path / "saved", model.config,
                  state_dict_from_weights(model.config, model.weights))
    saved = json.loads((out / "config.json").read_text())
    assert saved["bos_token_id"] is None
    assert saved["eos_token_id"] == (None if written == [] else written)  # [] and null: none
    hf = transformers.AutoConfig.from_pretrained(out)
    assert (hf.bos_token_id, hf.eos_token_id) == (None, saved["eos_token_id"])
    again = Config.from_hf(out)
    assert (again.bos_id, again.end_ids) == (None, model.config.end_ids)


def test_bos_null_is_no_bos(ckpt):
    (ckpt / "tokenizer.model").unlink()  # a tokenizer.json, as byte-level BPE models ship
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"[UNK]": 0, "Hi": 1}, unk_token="[UNK]")).save(
        str(ckpt / "tokenizer.json"))
    (ckpt / "tokenizer_config.json").write_text("{}")
    edit_config(ckpt, bos_token_id=None)
    model = load_model(ckpt)
    assert model.config.bos_id is None and model.tokenizer.bos_id is None
    assert model.encode("Hi").tolist() == [[1]]  # nothing put in front
    with pytest.raises(LlmTraceError) as err:
        model.encode("Hi", bos=True)
    assert "has no BOS token (its bos_token_id is null): encode without bos=True" in \
        one_line(err)
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    with pytest.raises(LlmTraceError) as err:
        load_model(ckpt)
    assert "add a BOS token (add_bos_token) but the model has none (bos_token_id is null)" in \
        one_line(err)


def test_config_dataclass_takes_none_for_ids():
    c = Config.from_name("tinyllama").replace(bos_id=None, eos_id=None)
    assert c.end_ids == () and c.to_hf()["eos_token_id"] is None
    with pytest.raises(LlmTraceError, match=r"stop_ids=\(5,\) with no eos_id"):
        c.replace(stop_ids=(5,))
