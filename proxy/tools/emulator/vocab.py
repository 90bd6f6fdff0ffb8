"""A fixed, deterministic word-ish vocabulary and a tokenizer over it.

Token ids below ``len(VOCAB)`` are vocabulary entries; any other piece of text (prompt words,
loop units) gets a stable id derived from its hash, above the vocabulary range.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

import xxhash

_COMMON = (
    "the", "a", "and", "of", "to", "in", "is", "it", "that", "for", "on", "with", "as", "this",
    "model", "answer", "value", "result", "because", "so", "then", "we", "can", "see", "number",
    "first", "next", "step", "each", "more", "less", "than", "true", "here", "there", "now",
    "time", "data", "state", "order", "token", "batch", "same", "output", "input", "check",
)  # fmt: skip
_ONSETS = ("b", "c", "d", "f", "g", "l", "m", "n", "p", "r", "s", "t", "v", "br", "st", "tr")
_VOWELS = ("a", "e", "i", "o", "u")
_CODAS = ("", "n", "r", "s", "l")
_PUNCT = (".", ",", "!", "?", ";", ":")
_SYLLABLE_WORDS = 280
_TOKEN_RE = re.compile(r"\s*\w+|\s*[^\w\s]|\s+")
_EXTERNAL_BASE = 100_000
_EXTERNAL_SPAN = 1_000_000


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """Token strings by id and the reverse map."""

    tokens: tuple[str, ...]
    ids: dict[str, int]

    def __len__(self) -> int:
        return len(self.tokens)

    def text(self, token_id: int) -> str:
        if 0 <= token_id < len(self.tokens):
            return self.tokens[token_id]
        return f"<{token_id}>"

    def token_id(self, piece: str) -> int:
        found = self.ids.get(piece)
        if found is not None:
            return found
        return _EXTERNAL_BASE + xxhash.xxh32_intdigest(piece.encode()) % _EXTERNAL_SPAN


def _syllable_words() -> list[str]:
    words: list[str] = []
    for i in range(_SYLLABLE_WORDS):
        onset = _ONSETS[i % len(_ONSETS)]
        vowel = _VOWELS[(i // len(_ONSETS)) % len(_VOWELS)]
        coda = _CODAS[(i // (len(_ONSETS) * len(_VOWELS))) % len(_CODAS)]
        second = _VOWELS[(i * 7) % len(_VOWELS)] + _CODAS[(i * 3) % len(_CODAS)]
        words.append(onset + vowel + coda + ("" if i % 3 == 0 else _ONSETS[i * 5 % 16] + second))
    return words


@cache
def vocabulary() -> Vocabulary:
    """The emulator's vocabulary (built once per process, immutable)."""
    pieces: list[str] = [" " + w for w in _COMMON]
    pieces.extend(" " + w for w in _syllable_words())
    pieces.extend(_PUNCT)
    unique = tuple(dict.fromkeys(pieces))
    return Vocabulary(tokens=unique, ids={t: i for i, t in enumerate(unique)})


def split_text(text: str) -> list[str]:
    """Split text into word-ish pieces, each keeping its leading whitespace."""
    return _TOKEN_RE.findall(text)


def encode(text: str) -> list[int]:
    """Token ids of ``text``."""
    vocab = vocabulary()
    return [vocab.token_id(p) for p in split_text(text)]


@dataclass(frozen=True, slots=True)
class Piece:
    """One token outside or inside the vocabulary: id and text."""

    token_id: int
    text: str


def encode_pieces(text: str) -> list[Piece]:
    vocab = vocabulary()
    return [Piece(vocab.token_id(p), p) for p in split_text(text)]
