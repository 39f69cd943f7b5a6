"""Real text that ships with every Python: the standard library's own source files.

Two data sets are built from it, deterministically (sorted file order, no randomness):

- :func:`source_corpus`: the concatenated source of the standard library's ``.py`` files
  as ASCII codes, for character-level language modelling.
- :func:`docstring_dataset`: the docstrings of functions and classes labelled with the
  top-level package they come from (``asyncio``, ``email``, ...), a text classification
  task for fine-tuning a pretrained encoder.

The exact bytes depend on the Python version (the file list and contents change between
releases); within one interpreter they are fixed.
"""

from __future__ import annotations

import ast
import os
import sysconfig
from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["stdlib_root", "source_corpus", "docstring_dataset", "DOCSTRING_PACKAGES"]

_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}

#: The classes of the docstring task: top-level standard-library packages with many
#: documented functions and classes, on clearly different subjects.
DOCSTRING_PACKAGES = (
    "asyncio", "email", "logging", "multiprocessing", "tkinter", "unittest", "xml", "http",
)


def stdlib_root() -> Path:
    """The directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def _python_files(root: Path, top_levels: tuple[str, ...] = ()) -> list[Path]:
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in _SKIPPED_DIRS)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = Path(directory) / name
            if top_levels and path.relative_to(root).parts[0] not in top_levels:
                continue
            found.append(path)
    return found


@lru_cache(maxsize=4)
def source_corpus(max_chars: int) -> torch.Tensor:
    """The first ``max_chars`` characters of the stdlib's sources as int64 codes in [0, 128).

    Files are taken in sorted path order; non-ASCII characters become ``?``.
    """
    pieces: list[bytes] = []
    total = 0
    for path in _python_files(stdlib_root()):
        data = path.read_bytes().decode("utf-8", errors="replace").encode("ascii", errors="replace")
        pieces.append(data)
        total += len(data)
        if total >= max_chars:
            break
    blob = b"".join(pieces)[:max_chars]
    if len(blob) < max_chars // 2:
        raise RuntimeError(f"the standard library at {stdlib_root()} holds too little source text")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()


def _first_sentences(docstring: str, max_words: int) -> str:
    words = " ".join(docstring.split()).split(" ")
    return " ".join(words[:max_words])


@lru_cache(maxsize=4)
def docstring_dataset(max_words: int = 32) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``(texts, labels)``: stdlib docstrings and the index of their package in
    :data:`DOCSTRING_PACKAGES`; duplicates and very short docstrings are dropped."""
    texts: list[str] = []
    labels: list[int] = []
    seen: set[str] = set()
    root = stdlib_root()
    for path in _python_files(root, DOCSTRING_PACKAGES):
        label = DOCSTRING_PACKAGES.index(path.relative_to(root).parts[0].removesuffix(".py"))
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            docstring = ast.get_docstring(node)
            if not docstring or len(docstring) < 20:
                continue
            text = _first_sentences(docstring, max_words)
            if text in seen:
                continue
            seen.add(text)
            texts.append(text)
            labels.append(label)
    return tuple(texts), tuple(labels)
