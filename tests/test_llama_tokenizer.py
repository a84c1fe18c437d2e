"""TinyLlama's (Llama-2's) SentencePiece tokenizer, rebuilt offline."""

import hashlib

import pytest

from llmtrace_book.tokenize import display_piece
from llmtrace_book.weights.tokenizer_llama import LLAMA2_BYTES, LLAMA2_SHA256, llama_cpp_vectors, tokenizer_model_path
from helpers import PROMPT


def test_file_is_llama2s_byte_for_byte(llama_tok):
    data = tokenizer_model_path().read_bytes()
    assert len(data) == LLAMA2_BYTES == 499_723
    assert hashlib.sha256(data).hexdigest() == LLAMA2_SHA256


def test_llama_cpp_vectors(llama_tok):
    cases = llama_cpp_vectors()
    assert len(cases) == 46
    failures = [(text, ids) for text, ids in cases if llama_tok.encode(text, bos=False) != ids]
    assert failures == []


def test_prompt_and_paris(llama_tok):
    ids = llama_tok.encode(PROMPT)
    assert ids == [1, 450, 7483, 310, 3444, 338]
    assert [llama_tok.id_to_piece(i) for i in ids] == ["<s>", "▁The", "▁capital", "▁of", "▁France", "▁is"]
    assert llama_tok.id_to_piece(3681) == "▁Paris" and llama_tok.piece_to_id("▁Paris") == 3681
    assert llama_tok.decode([3681]) == "Paris"  # decoding one id drops its leading space ...
    assert display_piece(llama_tok, 3681) == " Paris"  # ... which the piece keeps
    assert (llama_tok.bos_id, llama_tok.eos_id, llama_tok.vocab_size) == (1, 2, 32000)


def test_byte_fallback(llama_tok):
    ids = llama_tok.encode("🦙", bos=False)
    assert [llama_tok.id_to_piece(i) for i in ids] == ["▁", "<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]
    assert llama_tok.decode(ids) == "🦙"


@pytest.mark.parametrize("text", ["Hello  world", "\tindent", "2024-11-29"])
def test_whitespace_and_digits_kept(llama_tok, text):
    assert llama_tok.decode(llama_tok.encode(text)) == text
