"""Chapter 2: byte-pair merges, on the running model's own tokenizer and on words where the
order of equal ranks decides."""

import json
from typing import Callable

from .registry import Case, exercise, run


def bpe_merge(symbols: list[str], priority: Callable[[str, str], int | None]) -> list[str]:
    """Split one word into the tokenizer's pieces by byte-pair merges (chapter 2's loop).

    symbols: the word's first symbols: one per byte for byte-level BPE (printed as GPT-2's
      characters, "Ġ" for a space), one per character for SentencePiece ("▁" for a space).
    priority(left, right): the rank of merging the two pieces, the lower the earlier (merge order
      for byte-level BPE, score order for SentencePiece), or None when they may not merge.
    Returns the list of pieces: merge the adjacent pair with the lowest rank (the leftmost one on
    a tie), again and again, until no adjacent pair may merge."""
    pieces = list(symbols)
    while True:
        pairs = [(priority(a, b), i) for i, (a, b) in enumerate(zip(pieces, pieces[1:]))]
        pairs = [(r, i) for r, i in pairs if r is not None]
        if not pairs:
            return pieces
        _, i = min(pairs)  # the lowest rank; on a tie, the leftmost
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters (a space is "Ġ")."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


WORDS = ["The", " capital", " of", " France", " is", " Paris", " tokenization",
         " unbelievably", " transformers"]
# words of a made-up table where the leftmost and the rightmost pair of equal rank give different
# pieces: (symbols, {pair: rank}, the pieces)
TIES = [(list("aaa"), {("a", "a"): 0}, ["aa", "a"]),
        (list("xaaaaa"), {("a", "a"): 0, ("x", "aa"): 1}, ["xaa", "aa", "a"]),
        (list("abcbc"), {("b", "c"): 3, ("a", "bc"): 5, ("bc", "bc"): 4},
         ["a", "bcbc"])]


def tables(model):
    """(symbols of a word, rank of a merged pair, the text to encode) for the running model's
    tokenizer, or None when it merges no pairs (a word-level tokenizer)."""
    tok = model.tokenizer
    if hasattr(tok, "sp"):  # SentencePiece: a pair merges into a piece of the vocabulary,
        sp = tok.sp  # the piece with the higher score first
        normal = [i for i in range(sp.get_piece_size())
                  if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))]
        by_score = sorted(normal, key=lambda i: -sp.get_score(i))
        piece_rank = {sp.id_to_piece(i): r for r, i in enumerate(by_score)}
        return (lambda w: list("\u2581" + w.strip())), (lambda a, b: piece_rank.get(a + b)), \
            str.strip
    if hasattr(tok, "tok"):  # Hugging Face: byte-level BPE ranks pairs by its merges' order
        spec = json.loads(tok.tok.to_str()).get("model", {})
        merges = spec.get("merges") if spec.get("type") == "BPE" else None
        if not merges:
            return None
        pair_rank = {}
        for r, m in enumerate(merges):
            pair = tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
            pair_rank.setdefault(pair, r)
        byte_char = bytes_to_unicode()
        return (lambda w: [byte_char[b] for b in w.encode("utf-8")]), \
            (lambda a, b: pair_rank.get((a, b))), str
    return None


def model_words(model) -> list:
    """(word, symbols, {pair: rank}, the tokenizer's pieces) of the words it splits by merges."""
    made = tables(model)
    if made is None:
        return []
    symbols, rank, text = made
    words = []
    for word in WORDS:
        sym = symbols(word)
        s = "".join(sym)
        ranks = {}  # every split of every substring of the word that the tokenizer may merge
        for i in range(len(s)):
            for k in range(i + 2, len(s) + 1):
                for j in range(i + 1, k):
                    r = rank(s[i:j], s[j:k])
                    if r is not None:
                        ranks[(s[i:j], s[j:k])] = r
        tok = model.tokenizer
        pieces = [tok.id_to_piece(i) for i in tok.encode(text(word), bos=False)]
        if bpe_merge(sym, lambda a, b: ranks.get((a, b))) == pieces:  # merges alone split it
            words.append((word, sym, ranks, pieces))
    return words


def _mergeable(pieces, priority):
    pairs = [(priority(a, b), i) for i, (a, b) in enumerate(zip(pieces, pieces[1:]))]
    return [(r, i) for r, i in pairs if r is not None]


def _merging(choose):
    def merge(symbols, priority):
        pieces = list(symbols)
        while (pairs := _mergeable(pieces, priority)):
            _, i = choose(pairs)
            pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
        return pieces
    return merge


def _left_to_right(symbols, priority):
    pieces, i = list(symbols), 0
    while i < len(pieces) - 1:
        if priority(pieces[i], pieces[i + 1]) is not None:
            pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
        else:
            i += 1
    return pieces


def _one_pass(symbols, priority):
    pieces = list(symbols)
    if (pairs := _mergeable(pieces, priority)):
        _, i = min(pairs)
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


@exercise(2, bpe_merge)
def _(model) -> Case:
    words = model_words(model)
    cases = [(w, sym, ranks) for w, sym, ranks, _ in words] + [
        ("".join(sym) + " (a made-up table)", sym, ranks) for sym, ranks, _ in TIES]
    want = [p for *_, p in words] + [p for *_, p in TIES]

    def call(fn):
        out = []
        for _, sym, ranks in cases:
            def priority(a, b, ranks=dict(ranks)):
                return ranks.get((a, b))
            got = run(fn, list(sym), priority, names=["symbols", "priority"])
            out.append(list(got) if isinstance(got, (list, tuple)) else got)
        return out

    def compare(got, want):
        for (word, *_), g, w in zip(cases, got, want):
            if g != w:
                return f"the word {word!r}: wanted {w}, got {g}"
        return None
    compare.rtol = None
    what = (f"the tokenizer's own pieces for {len(words)} words and {len(TIES)} ties"
            if words else f"the pieces of {len(TIES)} words of a made-up table (this "
                          f"tokenizer merges no pairs)")
    return Case(call, want, what, compare, [
        (_merging(max), "the LOWEST rank merges first (rank 0 is the first merge)"),
        (_merging(lambda pairs: min(pairs, key=lambda p: (p[0], -p[1]))),
         "on a tie (the same rank twice in a word), the LEFTMOST pair merges first: "
         "min over (rank, index)"),
        (_left_to_right, "merge by rank, not left to right: at each step the lowest-ranked "
                         "adjacent pair, wherever it is"),
        (_one_pass, "one merge is not enough: repeat until no adjacent pair may merge")])
