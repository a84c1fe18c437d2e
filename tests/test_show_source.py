"""The walk's listings (`book.show_source`) are the library's own code, whole: Llama's parts name
no other family and read no switch of one, and the page shows each exactly as its file has it."""

import inspect
import re
import sys
from pathlib import Path

import pytest

import llmtrace_book
from llmtrace_book import attention as attention_module
from llmtrace_book import block as block_module
from llmtrace_book import embed as embed_module
from llmtrace_book import kv_cache, mlp, norm, rope
from llmtrace_book.model import Model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks"))
import book  # noqa: E402

# Llama's parts, as the walk's chapters list them
PARTS = [attention_module, block_module, embed_module, kv_cache, mlp, norm, rope]
LISTED = [Model.forward, Model.positions, Model.embed, Model.head, Model.block,
          Model.attention, Model.mlp, Model.new_cache]
# what names another family's code: the families and the config fields only they set
FAMILIES = r"Qwen|Gemma|Mistral|Mixtral|OLMo|Olmo|SmolLM3|DeepSeek|gpt-oss|GeGLU|YaRN|yarn"
OTHERS = re.compile(FAMILIES + "|" + "|".join(rf"\b{s}\b" for s in book.FAMILY_SWITCHES))


@pytest.mark.parametrize("part", PARTS + LISTED,
                         ids=lambda p: getattr(p, "__qualname__", p.__name__))
def test_llamas_parts_name_no_other_family_and_read_no_switch(part):
    code = inspect.getsource(inspect.unwrap(part))
    found = sorted({m.group(0) for m in OTHERS.finditer(code)})
    assert not found, f"{getattr(part, '__qualname__', part.__name__)} names {found}"


def test_no_mechanism_of_another_family_is_imported_by_llamas_parts():
    for module in PARTS:
        code = inspect.getsource(module)
        assert "mechanisms" not in code and "families" not in code, module.__name__


def test_the_listing_is_the_source_as_its_file_has_it(monkeypatch):
    said = []
    monkeypatch.setattr(book, "say", said.append)
    book.show_source(attention_module.Attention, Model.forward)
    root = Path(llmtrace_book.__file__).resolve().parent
    for text, obj in zip(said, (attention_module.Attention, inspect.unwrap(Model.forward))):
        where = Path(inspect.getsourcefile(obj)).resolve().relative_to(root)
        assert text == f"From `llmtrace_book/{where}`:\n\n```python\n{inspect.getsource(obj)}```"
        assert "abridged" not in text


def test_a_family_is_a_subclass_that_states_its_parts():
    """Every family's model is a subclass of Model registered under its model_type, and a Llama
    config gets Llama's parts."""
    from llmtrace_book.families import REGISTRY

    assert set(REGISTRY) <= set(Model.families)
    for model_type, cls in Model.families.items():
        assert issubclass(cls, Model), model_type
    from llmtrace_book import meta_model

    m = meta_model("tinyllama-1.1b")
    assert type(m.blocks[0]) is block_module.Block
    assert type(m.blocks[0].attn) is attention_module.Attention
    assert type(m.blocks[0].mlp) is mlp.MLP
    gemma = meta_model("gemma-3-270m")
    assert type(gemma).__name__ == "Gemma3" and type(gemma.blocks[0].attn) is not \
        attention_module.Attention
