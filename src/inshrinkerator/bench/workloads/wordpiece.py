"""BERT's uncased WordPiece tokenizer, read from a ``vocab.txt`` (no extra dependency).

Lower-cases, strips accents, splits on whitespace and punctuation, then splits each
word greedily into the longest vocabulary pieces (continuations prefixed ``##``), as
BERT's reference tokenizer does. Chinese-character handling is left out: the texts
tokenized here are English.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path

__all__ = ["WordPieceTokenizer"]


def _is_punctuation(char: str) -> bool:
    code = ord(char)
    if 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126:
        return True
    return unicodedata.category(char).startswith("P")


class WordPieceTokenizer:
    """Text -> vocabulary ids, ``[CLS] pieces [SEP]``, truncated to ``max_length``."""

    def __init__(self, vocab_file: Path, max_chars_per_word: int = 100) -> None:
        tokens = Path(vocab_file).read_text(encoding="utf-8").splitlines()
        self.vocab = {token: index for index, token in enumerate(tokens)}
        self.max_chars_per_word = max_chars_per_word
        self.pad_id = self.vocab["[PAD]"]
        self.unk_id = self.vocab["[UNK]"]
        self.cls_id = self.vocab["[CLS]"]
        self.sep_id = self.vocab["[SEP]"]

    def _words(self, text: str) -> list[str]:
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(c for c in text if unicodedata.category(c) != "Mn")
        words: list[str] = []
        for chunk in text.split():
            current = ""
            for char in chunk:
                if _is_punctuation(char):
                    if current:
                        words.append(current)
                        current = ""
                    words.append(char)
                else:
                    current += char
            if current:
                words.append(current)
        return words

    def _pieces(self, word: str) -> list[int]:
        if len(word) > self.max_chars_per_word:
            return [self.unk_id]
        pieces: list[int] = []
        start = 0
        while start < len(word):
            end = len(word)
            found = None
            while start < end:
                candidate = word[start:end] if start == 0 else "##" + word[start:end]
                if candidate in self.vocab:
                    found = self.vocab[candidate]
                    break
                end -= 1
            if found is None:
                return [self.unk_id]
            pieces.append(found)
            start = end
        return pieces

    def encode(self, text: str, max_length: int) -> list[int]:
        """``[CLS] + pieces + [SEP]``, at most ``max_length`` ids (pieces cut first)."""
        ids: list[int] = []
        for word in self._words(text):
            ids.extend(self._pieces(word))
        return [self.cls_id, *ids[: max_length - 2], self.sep_id]
