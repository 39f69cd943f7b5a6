"""A fixed family of symmetric distributions over ``-limit..limit``, and streams coded with one.

A stream of small signed integers whose counts would cost more to store than to guess
(a few hundred symbols: a bias's ids, a column of low-rank factors) names its model in
one byte instead of carrying a count table. The family holds 255 models:

- codes 1..127: two-sided geometric, ``P(i) ~ (code / 128) ** |i|`` (a discrete Laplace);
- codes 128..255: Gaussian-shaped, ``P(i) ~ ((code - 127) / 129) ** (i * i)``.

Each model's weights are integers computed exactly (``floor(2**20 * r**k)`` with Python
integers, at least 1, so every symbol stays codable), and its probabilities are those
weights over their sum, rounded once to float32: every platform builds the same model
bit for bit, which the entropy coder needs to decode what another wrote. An encoder
gives each stream the code of least cost on the stream's own counts
(:func:`best_model`).

A *symmetric stream* (:func:`encode_symmetric`) is, little-endian: ``varint limit``, ``u8
code``, then the ANS words (u32; the constriction library's stack coder) of the values.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import constriction
import numpy as np
import torch

from ..errors import CorruptCheckpointError, FormatError
from .varint import decode_varint, encode_varint

__all__ = [
    "MAX_STREAM_LIMIT",
    "MODEL_COUNT",
    "best_model",
    "categorical_model",
    "decode_symmetric",
    "encode_symmetric",
    "model_costs",
    "model_probabilities",
    "symmetric_header_bytes",
]

#: How many models the family holds (codes ``1..MODEL_COUNT``; 0 is never written).
MODEL_COUNT = 255
#: The largest ``limit`` a symmetric stream may declare (the models of wider ranges cost
#: seconds to build exactly, and a stream that wide is better served by a count table).
MAX_STREAM_LIMIT = 64
#: The first code of the Gaussian-shaped models.
_GAUSSIAN_FIRST = 128
#: The weight of symbol 0 before normalisation.
_PEAK = 1 << 20


def _weight(code: int, k: int) -> int:
    """The integer weight of the symbols ``+-k`` under model ``code``."""
    if code < _GAUSSIAN_FIRST:  # r = code / 128, r ** k
        return max(1, (_PEAK * code**k) >> (7 * k))
    numerator = code - _GAUSSIAN_FIRST + 1  # r = numerator / 129, r ** (k * k)
    return max(1, (_PEAK * numerator ** (k * k)) // 129 ** (k * k))


def _weights(code: int, limit: int) -> list[int]:
    """Integer weights of the symbols ``0..limit`` (by magnitude) of model ``code``."""
    weights: list[int] = []
    for k in range(limit + 1):
        weights.append(_weight(code, k))
        if weights[-1] == 1:  # the weights fall with k: the floor holds from here on
            weights.extend([1] * (limit - k))
            break
    return weights


@functools.lru_cache(maxsize=None)
def _weight_rows(width: int) -> np.ndarray:
    """``(MODEL_COUNT, width + 1)`` float64: every model's weights of ``0..width`` (exact:
    integers below 2**21). A model's weights do not depend on its limit, only their sum."""
    rows = np.array([_weights(code, width) for code in range(1, MODEL_COUNT + 1)], dtype=np.float64)
    rows.setflags(write=False)
    return rows


def _probability_rows(limit: int) -> np.ndarray:
    # Every model's probabilities over -limit..limit (float32), one row per code.
    half = _weight_rows(max(limit, MAX_STREAM_LIMIT))[:, : limit + 1]
    weights = np.concatenate([half[:, :0:-1], half], axis=1)
    # Sums of integers below 2**53 are exact in any order: each row is what it would be alone.
    return (weights / weights.sum(axis=1, keepdims=True)).astype(np.float32)


@functools.lru_cache(maxsize=None)
def model_probabilities(code: int, limit: int) -> np.ndarray:
    """The probabilities (float32) of symbols ``-limit..limit`` under model ``code``."""
    if not 1 <= code <= MODEL_COUNT:
        raise ValueError(f"model codes lie in 1..{MODEL_COUNT}, got {code}")
    probabilities = _probability_rows(limit)[code - 1].copy()
    probabilities.setflags(write=False)  # shared by every caller (cached)
    return probabilities


@functools.lru_cache(maxsize=None)
def categorical_model(code: int, limit: int) -> Any:
    """Model ``code`` over ``-limit..limit`` as the entropy coder's categorical model (of the
    symbols ``0..2 * limit``, i.e. the values shifted by ``limit``)."""
    return constriction.stream.model.Categorical(model_probabilities(code, limit), perfect=False)


@functools.lru_cache(maxsize=None)
def model_costs(limit: int) -> torch.Tensor:
    """``(MODEL_COUNT, 2 * limit + 1)``: bits each model spends on each symbol."""
    return -torch.from_numpy(_probability_rows(limit)).to(torch.float64).log2()


def best_model(counts: torch.Tensor, limit: int) -> tuple[int, float]:
    """``(code, bits)``: the model of least cost on ``counts`` (of the symbols
    ``-limit..limit``, in that order) and what it spends on them in all."""
    costs = model_costs(limit) @ counts.to(torch.float64)
    index = int(costs.argmin())
    return index + 1, float(costs[index])


def encode_symmetric(values: torch.Tensor, limit: int, code: Optional[int] = None) -> bytes:
    """A symmetric stream of ``values`` (integers within ``+-limit``, ``1 <= limit <=``
    :data:`MAX_STREAM_LIMIT`) under model ``code``; by default the model of least cost on
    their counts (:func:`best_model`, for a caller that has not chosen it already)."""
    if not 1 <= limit <= MAX_STREAM_LIMIT:
        raise ValueError(f"a symmetric stream's limit lies in 1..{MAX_STREAM_LIMIT}, got {limit}")
    shifted = values.detach().reshape(-1).cpu().to(torch.int64) + limit
    if shifted.numel() and (int(shifted.min()) < 0 or int(shifted.max()) > 2 * limit):
        raise ValueError(f"values lie outside +-{limit}")
    if code is None:
        code, _ = best_model(torch.bincount(shifted, minlength=2 * limit + 1), limit)
    elif not 1 <= code <= MODEL_COUNT:
        raise ValueError(f"model codes lie in 1..{MODEL_COUNT}, got {code}")
    coder = constriction.stream.stack.AnsCoder()
    if shifted.numel():
        coder.encode_reverse(shifted.numpy().astype(np.int32), categorical_model(code, limit))
    return encode_varint(limit) + bytes([code]) + coder.get_compressed().tobytes()


def symmetric_header_bytes(data: Any) -> int:
    """The bytes of a symmetric stream that are not coded values (its limit and code)."""
    _, cursor = decode_varint(memoryview(data).cast("B"), 0)
    return cursor + 1


def decode_symmetric(data: Any, count: int) -> torch.Tensor:
    """Inverse of :func:`encode_symmetric`: ``count`` int64 values.

    Raises:
        FormatError: the stream declares a limit or a model that does not exist.
        CorruptCheckpointError: the words do not decode to exactly ``count`` values.
    """
    view = memoryview(data).cast("B")
    limit, cursor = decode_varint(view, 0)
    if not 1 <= limit <= MAX_STREAM_LIMIT:
        raise FormatError(f"symmetric stream: limit {limit} is outside 1..{MAX_STREAM_LIMIT}")
    if cursor >= len(view):
        raise CorruptCheckpointError("symmetric stream: its model code is cut off")
    code = view[cursor]
    if code == 0:
        raise FormatError("symmetric stream: it names model 0, which does not exist")
    words = view[cursor + 1 :]
    if len(words) % 4:
        raise CorruptCheckpointError("symmetric stream: its words are not a whole number of 32 bits")
    try:
        coder = constriction.stream.stack.AnsCoder(np.frombuffer(words, dtype=np.uint32).copy())
        shifted = np.asarray(coder.decode(categorical_model(code, limit), count), dtype=np.int64)
    except (ValueError, RuntimeError, AssertionError) as exc:
        raise CorruptCheckpointError(f"symmetric stream: the words do not decode ({exc})") from None
    if not coder.is_empty():
        raise CorruptCheckpointError("symmetric stream: the words do not end where the last value does")
    return torch.from_numpy(shifted) - limit
