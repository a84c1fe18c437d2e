"""The embedded model's byte-level BPE, built from the GGUF vocabulary."""

import pytest

from llmtrace_book.tokenize import display_piece
from helpers import PROMPT


def test_prompt_ids(embedded):
    tok = embedded.tokenizer
    ids = tok.encode(PROMPT)
    assert ids == [504, 3575, 282, 4649, 314]
    assert [tok.id_to_piece(i) for i in ids] == ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]
    assert tok.piece_to_id("ĠParis") == 7042 and display_piece(tok, 7042) == " Paris"
    assert tok.decode(ids) == PROMPT
    assert tok.encode("hi", bos=True)[0] == tok.bos_id == 1


@pytest.mark.parametrize("text", ["2024", "x = 12345;", "naïve café ☕", "  two  spaces", "<|im_start|>user"])
def test_round_trip(embedded, text):
    tok = embedded.tokenizer
    assert tok.decode(tok.encode(text)) == text


def test_digits_are_split_one_by_one(embedded):
    tok = embedded.tokenizer
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]
    assert tok.encode("<|im_start|>") == [1]  # control tokens are special, not split
