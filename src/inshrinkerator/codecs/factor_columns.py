"""Integer factor matrices coded column by column, each column with its own small model.

The factors of a low-rank product (:mod:`.low_rank`) carry the square roots of their
singular values on one scale per factor matrix, so their first columns spread over the
whole ``-15..15`` and their last ones over a few integers. One count table over both
factors codes every column with the same mix; here each column names its own model, in
one byte, from a fixed family of 255 symmetric distributions over ``-limit..limit``:

- codes 1..127: two-sided geometric, ``P(i) ~ (code / 128) ** |i|`` (a discrete Laplace);
- codes 128..255: Gaussian-shaped, ``P(i) ~ ((code - 127) / 129) ** (i * i)``.

Each model's weights are integers computed exactly (``floor(2**20 * r**k)`` with Python
integers, at least 1, so every symbol stays codable), and its probabilities are those
weights over their sum, rounded once to float32: every platform builds the same model
bit for bit, which the entropy coder needs to decode what another wrote. The encoder
gives each column the code of least cost on the column's own counts.

Layout: one code byte per column (the left factor's columns, then the right's), then the
ANS words (u32, little-endian; the constriction library's stack coder) of the columns in
the same order.
"""

from __future__ import annotations

import functools
from typing import Any

import constriction
import numpy as np
import torch

from ..errors import CorruptCheckpointError, FormatError

__all__ = ["decode_factor_columns", "encode_factor_columns", "model_probabilities"]

#: How many models the family holds (codes ``1..MODEL_COUNT``; 0 is never written).
MODEL_COUNT = 255
#: The first code of the Gaussian-shaped models.
_GAUSSIAN_FIRST = 128
#: The weight of symbol 0 before normalisation.
_PEAK = 1 << 20


def _weights(code: int, limit: int) -> list[int]:
    """Integer weights of the symbols ``0..limit`` (by magnitude) of model ``code``."""
    if code < _GAUSSIAN_FIRST:  # r = code / 128, r ** k
        return [max(1, (_PEAK * code**k) >> (7 * k)) for k in range(limit + 1)]
    numerator = code - _GAUSSIAN_FIRST + 1  # r = numerator / 129, r ** (k * k)
    return [max(1, (_PEAK * numerator ** (k * k)) // 129 ** (k * k)) for k in range(limit + 1)]


@functools.lru_cache(maxsize=None)
def model_probabilities(code: int, limit: int) -> np.ndarray:
    """The probabilities (float32) of symbols ``-limit..limit`` under model ``code``."""
    if not 1 <= code <= MODEL_COUNT:
        raise ValueError(f"model codes lie in 1..{MODEL_COUNT}, got {code}")
    half = _weights(code, limit)
    weights = np.array(half[:0:-1] + half, dtype=np.float64)  # exact: integers below 2**53
    probabilities = (weights / weights.sum()).astype(np.float32)
    probabilities.setflags(write=False)  # shared by every caller (cached)
    return probabilities


@functools.lru_cache(maxsize=None)
def _model(code: int, limit: int) -> Any:
    return constriction.stream.model.Categorical(model_probabilities(code, limit), perfect=False)


@functools.lru_cache(maxsize=None)
def _costs(limit: int) -> torch.Tensor:
    """``(MODEL_COUNT, 2 * limit + 1)``: bits each model spends on each symbol."""
    table = np.stack([model_probabilities(code, limit) for code in range(1, MODEL_COUNT + 1)])
    return -torch.from_numpy(table).to(torch.float64).log2()


def encode_factor_columns(left: torch.Tensor, right: torch.Tensor, limit: int) -> bytes:
    """The code bytes and ANS words of ``left`` (``rows x rank``) and ``right`` (``cols x
    rank``), integers within ``+-limit``."""
    columns = [column + limit for column in (*left.cpu().T.to(torch.int64), *right.cpu().T.to(torch.int64))]
    width = 2 * limit + 1
    keys = torch.cat([column + index * width for index, column in enumerate(columns)])
    counts = torch.bincount(keys, minlength=len(columns) * width).reshape(len(columns), width).to(torch.float64)
    codes = (counts @ _costs(limit).T).argmin(dim=1) + 1
    coder = constriction.stream.stack.AnsCoder()
    for column, code in zip(reversed(columns), reversed(codes.tolist())):
        coder.encode_reverse(column.numpy().astype(np.int32), _model(code, limit))
    return codes.to(torch.uint8).numpy().tobytes() + coder.get_compressed().tobytes()


def decode_factor_columns(data: Any, rows: int, cols: int, rank: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(left, right)`` as int64 tensors of :func:`encode_factor_columns`' output.

    Raises:
        FormatError: a code byte names no model, or the stream is too short to hold them.
        CorruptCheckpointError: the words do not decode to exactly these columns.
    """
    view = memoryview(data).cast("B")
    count = 2 * rank
    if len(view) < count:
        raise FormatError(f"low-rank factors: the stream holds {len(view)} bytes, less than its {count} column models")
    codes = list(view[:count])
    if 0 in codes:
        raise FormatError("low-rank factors: a column names model 0, which does not exist")
    words = view[count:]
    if len(words) % 4:
        raise CorruptCheckpointError("low-rank factors: the coded columns are not a whole number of 32-bit words")
    sizes = [rows] * rank + [cols] * rank
    try:
        coder = constriction.stream.stack.AnsCoder(np.frombuffer(words, dtype=np.uint32).copy())
        columns = [np.asarray(coder.decode(_model(code, limit), size), dtype=np.int64) for code, size in zip(codes, sizes)]
    except (ValueError, RuntimeError, AssertionError) as exc:
        raise CorruptCheckpointError(f"low-rank factors: the coded columns do not decode ({exc})") from None
    if not coder.is_empty():
        raise CorruptCheckpointError("low-rank factors: the coded columns do not end where the last column does")
    left = torch.from_numpy(np.stack(columns[:rank], axis=1)) - limit
    right = torch.from_numpy(np.stack(columns[rank:], axis=1)) - limit
    return left, right
