"""Text -> pieces -> ids, and back, behind one small interface.

Two tokenizers, each from the library its model family uses:
- `SentencePieceTokenizer`: TinyLlama's (Llama-2's) 32,000-piece SentencePiece BPE model, with
  "▁" marking a space and byte fallback (<0xE2> ...) for characters outside the vocabulary.
- `HFTokenizer`: a Hugging Face `tokenizers` object; the embedded SmolLM2 model's byte-level BPE
  is built from the GGUF file's tokens and merges (`from_gguf_vocab`).
"""

from __future__ import annotations

from pathlib import Path

from .errors import LlmTraceError


class SentencePieceTokenizer:
    kind = "sentencepiece"

    def __init__(self, model_file: str | Path | None = None, add_bos: bool = True,
                 model_proto: bytes | None = None):
        import sentencepiece as spm

        if model_proto is not None:  # a model built in memory (a GGUF file's vocabulary)
            self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        else:
            self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        # SentencePiece says -1 for an id the model has none of
        self.bos_id, self.eos_id = (None if i < 0 else i
                                    for i in (self.sp.bos_id(), self.sp.eos_id()))
        self.add_bos = add_bos and check_bos(self.bos_id, add_bos)
        self.vocab_size = self.sp.get_piece_size()

    def encode(self, text: str, bos: bool | None = None) -> list[int]:
        ids = self.sp.encode(text)
        return [self.bos_id] + ids if (self.add_bos if bos is None else bos) else ids

    def decode(self, ids) -> str:
        return self.sp.decode(list(map(int, ids)))

    def id_to_piece(self, i: int) -> str:
        return self.sp.id_to_piece(int(i))

    def piece_to_id(self, piece: str) -> int:
        return self.sp.piece_to_id(piece)


class HFTokenizer:
    kind = "byte-level BPE"

    def __init__(self, tok, bos_id: int | None, eos_id: int | None, add_bos: bool = False):
        self.tok = tok  # tokenizers.Tokenizer
        self.bos_id, self.eos_id = bos_id, eos_id  # None: the model has none
        self.add_bos = add_bos and check_bos(bos_id, add_bos)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_file(cls, path: str | Path, bos_id: int, eos_id: int,
                  add_bos: bool = False) -> HFTokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)), bos_id, eos_id, add_bos)

    @classmethod
    def from_gguf_vocab(cls, tokens: list[str], merges: list[str], token_types: list[int],
                        bos_id: int, eos_id: int, add_bos: bool = False) -> HFTokenizer:
        """GPT-2-style byte-level BPE. Like llama.cpp's `smollm` pre-tokenizer, each digit is split
        off on its own before the GPT-2 regex runs. Control tokens (type 3) are special tokens."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        vocab = {t: i for i, t in enumerate(tokens)}
        bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges])
        tok = Tokenizer(bpe)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, token_types) if kind == 3])
        return cls(tok, bos_id, eos_id, add_bos)

    def encode(self, text: str, bos: bool | None = None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id] + ids if (self.add_bos if bos is None else bos) else ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(map(int, ids)), skip_special_tokens=False)

    def id_to_piece(self, i: int) -> str:
        piece = self.tok.id_to_token(int(i))
        if piece is None:
            raise LlmTraceError(f"token id {i} is outside the vocabulary of {self.vocab_size}")
        return piece

    def piece_to_id(self, piece: str) -> int | None:
        return self.tok.token_to_id(piece)


def check_bos(bos_id: int | None, add_bos: bool) -> bool:
    """A tokenizer told to start each text with BOS must have one."""
    if add_bos and bos_id is None:
        raise LlmTraceError("the tokenizer is told to add a BOS token (add_bos_token) but the "
                            "model has none (bos_token_id is null): set add_bos_token to false, "
                            "or give bos_token_id")
    return True


def display_piece(tokenizer, i: int) -> str:
    """A piece as a reader should see it: with its leading space, which decoding a lone id drops
    in SentencePiece ("▁Paris" -> " Paris"), and which byte-level BPE spells "Ġ"."""
    if tokenizer.kind == "sentencepiece":
        return tokenizer.id_to_piece(i).replace("\u2581", " ")
    return tokenizer.decode([i])
