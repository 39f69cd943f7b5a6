"""Order-0 entropy coding of integer symbols with an ANS coder (the constriction library).

:func:`encode_symbols` codes a 1-D tensor of symbols in ``[0, alphabet)`` within a
fraction of a percent of their empirical order-0 entropy; the symbol counts travel
with the data (zstd-packed), so decoding needs nothing else. This is the shared
entropy stage of the lossy codecs.

Stream layout: ``u32 alphabet, u64 count, u32 table_bytes`` + zstd(u64 counts) + ANS words.
"""

from __future__ import annotations

import struct
from typing import Any

import constriction
import numpy as np
import torch
import zstandard

from ..errors import CorruptCheckpointError, FormatError

__all__ = ["encode_symbols", "decode_symbols", "order0_entropy_bits", "MAX_ALPHABET"]

MAX_ALPHABET = 1 << 20
_HEADER = struct.Struct("<IQI")


def order0_entropy_bits(symbols: torch.Tensor, alphabet: int) -> float:
    """Total order-0 entropy of ``symbols`` in bits (the bound a coder is measured against)."""
    if symbols.numel() == 0:
        return 0.0
    counts = torch.bincount(symbols.reshape(-1).long(), minlength=alphabet).double()
    probs = counts[counts > 0] / symbols.numel()
    return float(-(counts[counts > 0] * torch.log2(probs)).sum())


def _model(counts: np.ndarray) -> Any:
    probabilities = (counts / counts.sum()).astype(np.float32)
    return constriction.stream.model.Categorical(probabilities, perfect=False)


def encode_symbols(symbols: torch.Tensor, alphabet: int) -> bytes:
    """Entropy-code ``symbols`` (integers in ``[0, alphabet)``, any shape; flattened)."""
    if not 1 <= alphabet <= MAX_ALPHABET:
        raise ValueError(f"alphabet must be in [1, {MAX_ALPHABET}], got {alphabet}")
    flat = symbols.detach().reshape(-1).cpu()
    count = flat.numel()
    if count == 0:
        return _HEADER.pack(alphabet, 0, 0)
    low, high = int(flat.min()), int(flat.max())
    if low < 0 or high >= alphabet:
        raise ValueError(f"symbols lie in [{low}, {high}], outside [0, {alphabet})")
    counts = torch.bincount(flat.long(), minlength=alphabet).numpy().astype(np.uint64)
    table = zstandard.ZstdCompressor(level=3).compress(counts.tobytes())
    present = int((counts > 0).sum())
    if present == 1:
        words = b""  # one symbol only: the counts say everything
    else:
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(flat.numpy().astype(np.int32, copy=False), _model(counts))
        words = coder.get_compressed().tobytes()
    return _HEADER.pack(alphabet, count, len(table)) + table + words


def decode_symbols(data: Any, expected_count: int | None = None) -> torch.Tensor:
    """Inverse of :func:`encode_symbols`: an int64 tensor of the symbols.

    Raises:
        FormatError / CorruptCheckpointError: the stream is malformed or does not decode.
    """
    view = memoryview(data).cast("B")
    if len(view) < _HEADER.size:
        raise CorruptCheckpointError("entropy stream is shorter than its header")
    alphabet, count, table_bytes = _HEADER.unpack(view[: _HEADER.size])
    if not 1 <= alphabet <= MAX_ALPHABET or (expected_count is not None and count != expected_count):
        raise FormatError(f"entropy stream claims {count} symbols over {alphabet}, expected {expected_count}")
    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    table_end = _HEADER.size + table_bytes
    if table_end > len(view):
        raise CorruptCheckpointError("entropy stream is truncated inside its count table")
    try:
        raw = zstandard.ZstdDecompressor().decompress(bytes(view[_HEADER.size : table_end]), max_output_size=8 * alphabet)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(f"entropy stream count table is damaged ({exc})") from None
    if len(raw) != 8 * alphabet:
        raise CorruptCheckpointError("entropy stream count table has the wrong size")
    counts = np.frombuffer(raw, dtype=np.uint64)
    if int(counts.sum()) != count:
        raise CorruptCheckpointError("entropy stream counts do not add up to its symbol count")
    present = np.flatnonzero(counts)
    if len(present) == 1:
        return torch.full((count,), int(present[0]), dtype=torch.int64)
    words = view[table_end:]
    if len(words) % 4 or not len(words):
        raise CorruptCheckpointError("entropy stream payload is not a whole number of 32-bit words")
    try:
        coder = constriction.stream.stack.AnsCoder(np.frombuffer(words, dtype=np.uint32).copy())
        symbols = coder.decode(_model(counts), count)
    except (ValueError, RuntimeError, AssertionError) as exc:
        raise CorruptCheckpointError(f"entropy stream does not decode ({exc})") from None
    result = torch.from_numpy(np.asarray(symbols, dtype=np.int64))
    if result.numel() and int(result.max()) >= alphabet:
        raise CorruptCheckpointError("entropy stream decoded to out-of-range symbols")
    return result
