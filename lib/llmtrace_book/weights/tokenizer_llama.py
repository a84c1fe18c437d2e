"""TinyLlama's tokenizer, offline: Llama-2's SentencePiece model rebuilt from
llama.cpp's test vocabulary.

The `llama-cpp-python==0.3.36` source distribution on PyPI ships
`vendor/llama.cpp/models/ggml-vocab-llama-spm.gguf`: Llama-2's 32,000 pieces with their scores and
types, and `.inp`/`.out` files of test strings with the ids llama.cpp expects. A SentencePiece
`ModelProto` holding those pieces, with the trainer and normalizer fields Meta's file carries
(BPE, byte fallback, a dummy-prefix space, extra whitespace kept), serializes to Meta's
`tokenizer.model` byte for byte: `build` checks the SHA-256 before writing anything.

    python -m llmtrace_book.weights.tokenizer_llama     # fetch the sdist once, write tokenizer.model
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ..disk_cache import atomic_path, cache_dir, command
from ..errors import LlmTraceError

SDIST = "llama-cpp-python==0.3.36"
MEMBER_DIR = "vendor/llama.cpp/models/"
VOCAB = "ggml-vocab-llama-spm.gguf"
LLAMA2_SHA256 = "9e556afd44213b6bd1be2b850ebbbd98f5481437a8021afaf58ee7fb1818d347"
LLAMA2_BYTES = 499_723


def setup_command() -> str:
    """`make setup` in the checkout, the Python command that builds the tokenizer elsewhere."""
    return command("setup", "llmtrace_book.weights.tokenizer_llama")


# Meta's Llama-2 tokenizer.model, as `print(model_proto.trainer_spec)` shows it:
# every field it sets.
TRAINER_SPEC = dict(
    input=["/large_experiments/theorem/datasets/MERGED/all.test1.merged"],
    model_prefix="spm_model_32k_200M_charcov099995_allowWSO__v2", model_type="BPE",
    vocab_size=32000, self_test_sample_size=0, input_format="text", character_coverage=0.99995,
    input_sentence_size=200000000,
    seed_sentencepiece_size=1000000, shrinking_factor=0.75, num_threads=80, num_sub_iterations=2,
    max_sentence_length=4192, shuffle_input_sentence=True, max_sentencepiece_length=16,
    split_by_unicode_script=True, split_by_whitespace=True, split_by_number=True,
    treat_whitespace_as_suffix=False, split_digits=True, allow_whitespace_only_pieces=True,
    vocabulary_output_piece_score=True, hard_vocab_limit=True, use_all_vocab=False,
    byte_fallback=True, required_chars="", unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
    unk_surface=" \u2047 ", unk_piece="<unk>",
    bos_piece="<s>", eos_piece="</s>", pad_piece="<pad>", train_extremely_large_corpus=False,
    enable_differential_privacy=False, differential_privacy_noise_level=0.0,
    differential_privacy_clipping_threshold=0,
)
NORMALIZER_SPEC = dict(name="identity", precompiled_charsmap=b"", add_dummy_prefix=True,
                       remove_extra_whitespaces=False, normalization_rule_tsv="")


def vocab_dir() -> Path:
    return cache_dir() / "llama-spm-vocab"


def tokenizer_model_path() -> Path:
    return cache_dir() / "tinyllama" / "tokenizer.model"


def fetch_vocab(timeout: float = 300) -> Path:
    """Download the sdist from PyPI (pip, no build) and keep the vocabulary and its test vectors."""
    dest = vocab_dir()
    if all((dest / f"{VOCAB}{ext}").is_file() for ext in ("", ".inp", ".out")):
        return dest
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST,
               "-d", tmp]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=timeout)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
            detail = (getattr(e, "stderr", "") or "").strip().splitlines()[-1:] or [str(e)]
            raise LlmTraceError(f"could not download {SDIST} from PyPI ({detail[0]}): "
                                f"check the connection and run `{setup_command()}` again") from None
        (archive,) = Path(tmp).glob("*.tar.gz")
        with atomic_path(dest, directory=True) as out, tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if member.name.split("/", 1)[-1].startswith(MEMBER_DIR + VOCAB):
                    with tar.extractfile(member) as src:
                        (out / Path(member.name).name).write_bytes(src.read())
    return dest


def build_model_proto(vocab_gguf: Path) -> bytes:
    """Serialize a SentencePiece ModelProto from the GGUF vocabulary and Meta's specs."""
    from gguf import GGUFReader

    fields = GGUFReader(vocab_gguf).fields
    tokens, scores, types = (fields[f"tokenizer.ggml.{k}"].contents()
                             for k in ("tokens", "scores", "token_type"))
    return model_proto(tokens, scores, types)


def model_proto(tokens: list[str], scores: list[float], types: list[int], **spec) -> bytes:
    """A SentencePiece ModelProto of these pieces (GGUF's token types are SentencePiece's), with
    Meta's trainer and normalizer specs changed by `spec` (a trainer or normalizer field)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    for token, score, kind in zip(tokens, scores, types):
        piece = proto.pieces.add(piece=token, score=score)
        if kind != pb.ModelProto.SentencePiece.NORMAL:  # Meta's file leaves NORMAL implicit
            piece.type = kind
    trainer = {k: v for k, v in spec.items() if k in TRAINER_SPEC}
    normalizer = {k: v for k, v in spec.items() if k in NORMALIZER_SPEC}
    trainer = dict(TRAINER_SPEC, **trainer, model_type=pb.TrainerSpec.BPE)
    proto.trainer_spec.CopyFrom(pb.TrainerSpec(**trainer))
    proto.normalizer_spec.CopyFrom(pb.NormalizerSpec(**dict(NORMALIZER_SPEC, **normalizer)))
    return proto.SerializeToString()


def gguf_sentencepiece(meta: dict, bos_id: int | None, eos_id: int | None) -> bytes:
    """The SentencePiece model of a GGUF file whose vocabulary is one
    (`tokenizer.ggml.model = llama`: Llama 2, TinyLlama, Mistral 7B v0.1), built as Meta's
    tokenizer.model is: its pieces, scores and types, with the file's special ids and its
    space prefix."""
    tokens, scores, types = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores",
                                                                     "token_type"))
    unk = meta.get("tokenizer.ggml.unknown_token_id", 0)  # llama.cpp's default for this kind
    ids = {"unk_id": unk, "bos_id": bos_id, "eos_id": eos_id}
    spec = {k: -1 if i is None else i for k, i in ids.items()}  # -1: SentencePiece's "none"
    spec.update({k.replace("_id", "_piece"): tokens[i] for k, i in ids.items() if i is not None})
    return model_proto(tokens, scores, types, vocab_size=len(tokens), **spec,
                       add_dummy_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)))


def build(fetch: bool = True) -> Path:
    """Write tokenizer.model to the cache (once) and return its path. Refuses a file whose hash
    differs from Meta's."""
    target = tokenizer_model_path()
    if target.is_file() and target.stat().st_size == LLAMA2_BYTES and \
            hashlib.sha256(target.read_bytes()).hexdigest() == LLAMA2_SHA256:
        return target  # else a truncated or altered file: build it again
    source = fetch_vocab() if fetch else vocab_dir()
    if not (source / VOCAB).is_file():
        raise LlmTraceError(f"TinyLlama's tokenizer is not built yet: run `{setup_command()}` "
                            f"(it fetches {SDIST} from PyPI once)")
    try:
        data = build_model_proto(source / VOCAB)
    except Exception as e:  # a vocabulary cut short or altered in the cache: fetch it again
        shutil.rmtree(source, ignore_errors=True)
        if not fetch:
            raise LlmTraceError(f"the cached vocabulary {source} was damaged ({type(e).__name__})"
                                f" and is now removed: run `{setup_command()}` to fetch it again"
                                ) from None
        data = build_model_proto(fetch_vocab() / VOCAB)
    digest = hashlib.sha256(data).hexdigest()
    if digest != LLAMA2_SHA256:
        raise LlmTraceError(f"rebuilt tokenizer.model has sha256 {digest[:16]}..., not Llama-2's "
                            f"{LLAMA2_SHA256[:16]}...: "
                            "check the sentencepiece and protobuf versions")
    with atomic_path(target) as tmp:
        tmp.write_bytes(data)
    return target


def llama_tokenizer():
    """TinyLlama's SentencePiece tokenizer (BOS added by default), from the cache."""
    from ..tokenize import SentencePieceTokenizer

    return SentencePieceTokenizer(build(fetch=False), add_bos=True)


def llama_cpp_vectors() -> list[tuple[str, list[int]]]:
    """llama.cpp's cases for this vocabulary: (text, ids without BOS)."""
    d = vocab_dir()
    texts = (d / f"{VOCAB}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outs = (d / f"{VOCAB}.out").read_text(encoding="utf-8").split("\n")
    if texts[-1] == "":
        texts = texts[:-1]
    return [(t, [int(x) for x in o.split()]) for t, o in zip(texts, outs)]


if __name__ == "__main__":
    try:
        path = build()
    except LlmTraceError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{path}: {path.stat().st_size:,} bytes, sha256 {LLAMA2_SHA256} "
          "(Llama-2's tokenizer.model)")
