"""Integer factor matrices coded column by column, each column with its own small model.

The factors of a low-rank product (:mod:`.low_rank`) carry the square roots of their
singular values on one scale per factor matrix, so their first columns spread over the
whole ``-15..15`` and their last ones over a few integers. One count table over both
factors codes every column with the same mix; here each column names its own model, in
one byte, from the fixed family of 255 symmetric distributions over ``-limit..limit`` of
:mod:`.symmetric_models` (discrete Laplace and Gaussian shapes, built bit for bit the same
on every platform). The encoder gives each column the code of least cost on the column's
own counts.

Layout: one code byte per column (the left factor's columns, then the right's), then the
ANS words (u32, little-endian; the constriction library's stack coder) of the columns in
the same order.
"""

from __future__ import annotations

from typing import Any

import constriction
import numpy as np
import torch

from ..errors import CorruptCheckpointError, FormatError
from .symmetric_models import MODEL_COUNT, categorical_model, model_costs, model_probabilities

__all__ = ["MODEL_COUNT", "decode_factor_columns", "encode_factor_columns", "model_probabilities"]


def encode_factor_columns(left: torch.Tensor, right: torch.Tensor, limit: int) -> bytes:
    """The code bytes and ANS words of ``left`` (``rows x rank``) and ``right`` (``cols x
    rank``), integers within ``+-limit``."""
    # Columns of a few hundred integers: NumPy's calls cost less than torch's on them.
    columns = [*(left.cpu().numpy().T.astype(np.int64) + limit), *(right.cpu().numpy().T.astype(np.int64) + limit)]
    width = 2 * limit + 1
    counts = np.stack([np.bincount(column, minlength=width) for column in columns])
    codes = (torch.from_numpy(counts.astype(np.float64)) @ model_costs(limit).T).argmin(dim=1) + 1
    coder = constriction.stream.stack.AnsCoder()
    for column, code in zip(reversed(columns), reversed(codes.tolist())):
        coder.encode_reverse(column.astype(np.int32), categorical_model(code, limit))
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
        columns = [np.asarray(coder.decode(categorical_model(code, limit), size), dtype=np.int64) for code, size in zip(codes, sizes)]
    except (ValueError, RuntimeError, AssertionError) as exc:
        raise CorruptCheckpointError(f"low-rank factors: the coded columns do not decode ({exc})") from None
    if not coder.is_empty():
        raise CorruptCheckpointError("low-rank factors: the coded columns do not end where the last column does")
    left = torch.from_numpy(np.stack(columns[:rank], axis=1)) - limit
    right = torch.from_numpy(np.stack(columns[rank:], axis=1)) - limit
    return left, right
