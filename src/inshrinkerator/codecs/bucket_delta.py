"""Quantization-aware delta coding of integer bucket ids.

A quantized tensor is a vector of bucket ids in ``[0, levels)``. Between two
checkpoints most elements stay in their bucket, so the ids are coded as cyclic
deltas ``(id - predicted) mod levels`` against a *predicted* id per element
that the decoder recomputes on its own (the caller's business: here, the
bucket the previous reconstructed value falls in). The mostly-zero deltas are
run-length tokenized (:mod:`.zero_runs`) and coded with the shared order-0 ANS
stage (:func:`.entropy.encode_symbols`).

*Rearranged* mode first groups the deltas by predicted bucket (a stable
grouping the decoder rebuilds from the predictions, so no permutation is
stored): buckets whose elements migrate often no longer break the zero runs
of the stable ones. It costs a sort, so callers use it for small tensors.

Without a prediction (a full checkpoint) the ids are coded against their most
frequent id, which then forms the runs.

Stream layout (little-endian; ``varint`` is unsigned LEB128)::

    u8 mode (0 plain, 1 predicted, 2 rearranged), u16 levels, u16 run symbol,
    varint tokens, varint entropy-coded bytes, varint extra bits,
    entropy-coded tokens, extra-bit bytes
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from ..errors import CorruptCheckpointError, FormatError
from .entropy import decode_symbols, encode_symbols, order0_entropy_bits
from .varint import decode_varint, encode_varint
from .zero_runs import from_run_tokens, to_run_tokens, token_alphabet

__all__ = [
    "PLAIN",
    "PREDICTED",
    "REARRANGED",
    "MAX_LEVELS",
    "EntropyStats",
    "id_dtype",
    "encode_bucket_ids",
    "decode_bucket_ids",
]

PLAIN, PREDICTED, REARRANGED = 0, 1, 2
MAX_LEVELS = 1 << 12
_HEAD = struct.Struct("<BHH")
# The shared entropy stage starts its stream with a fixed header: alphabet, count, table bytes.
_SYMBOLS_HEAD = struct.Struct("<IQI")


def id_dtype(levels: int) -> torch.dtype:
    """The smallest integer dtype that holds ids in ``[0, levels)``."""
    return torch.uint8 if levels <= 256 else torch.int16


@dataclass
class EntropyStats:
    """Accumulates the entropy stage's output against the order-0 entropy of its symbols.

    ``payload_bytes`` counts the coded symbols only; ``table_bytes`` the headers and
    symbol-count tables that travel with them.
    """

    symbols: int = 0
    entropy_bits: float = 0.0
    payload_bytes: int = 0
    table_bytes: int = 0
    parts: int = 0
    # Tensors are encoded on several threads at once.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, tokens: torch.Tensor, alphabet: int, coded: bytes) -> None:
        bits = order0_entropy_bits(tokens, alphabet)
        table = _SYMBOLS_HEAD.size + _SYMBOLS_HEAD.unpack_from(coded)[2]
        with self._lock:
            self.symbols += tokens.numel()
            self.entropy_bits += bits
            self.payload_bytes += len(coded) - table
            self.table_bytes += table
            self.parts += 1

    @property
    def payload_overhead(self) -> float:
        """Payload bytes over the order-0 entropy, minus one (0.01: 1% above the bound)."""
        bound = self.entropy_bits / 8
        return self.payload_bytes / bound - 1 if bound > 0 else 0.0


def _rank(predicted: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The stable grouping by predicted bucket: order[k] is the k-th element, rank its inverse.
    order = torch.argsort(predicted.reshape(-1).to(id_dtype(levels)), stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return order, rank


def encode_bucket_ids(
    ids: torch.Tensor,
    levels: int,
    predicted: Optional[torch.Tensor] = None,
    rearrange: bool = False,
    stats: Optional[EntropyStats] = None,
    changed: Optional[torch.Tensor] = None,
    run_symbol: Optional[int] = None,
) -> bytes:
    """Code ``ids`` (integers in ``[0, levels)``) against optional ``predicted`` ids of the same size.

    ``changed`` (optional) lists, ascending, the positions where ids and predictions differ,
    and ``run_symbol`` the most frequent id (without a prediction), when the caller knows them.
    """
    if not 2 <= levels <= MAX_LEVELS:
        raise ValueError(f"levels must be in [2, {MAX_LEVELS}], got {levels}")
    ids = ids.reshape(-1)
    count = ids.numel()
    if predicted is None:
        mode = PLAIN
        if run_symbol is None:
            run_symbol = int(torch.bincount(ids.long(), minlength=levels).argmax()) if count else 0
        if not 0 <= run_symbol < levels:
            raise ValueError(f"run symbol {run_symbol} is not an id in [0, {levels})")
        positions = changed if changed is not None else torch.nonzero(ids != run_symbol).reshape(-1)
        base = torch.full_like(positions, run_symbol)
    else:
        predicted = predicted.reshape(-1)
        if predicted.numel() != count:
            raise ValueError("predicted ids must match the ids in size")
        run_symbol = 0
        mode = REARRANGED if rearrange else PREDICTED
        positions = changed if changed is not None else torch.nonzero(ids != predicted).reshape(-1)
        base = predicted[positions].long()
    values = torch.remainder(ids[positions].long() - base, levels)
    if mode == REARRANGED:
        _, rank = _rank(predicted, levels)
        positions, order = torch.sort(rank[positions])
        values = values[order]
    runs = to_run_tokens(positions, values, count, levels)
    alphabet = token_alphabet(levels)
    coded = encode_symbols(runs.tokens, alphabet)
    if stats is not None:
        stats.add(runs.tokens, alphabet, coded)
    head = _HEAD.pack(mode, levels, run_symbol) + b"".join(
        encode_varint(n) for n in (runs.tokens.numel(), len(coded), runs.extra_bit_count)
    )
    return b"".join([head, coded, runs.extra_bits])


def decode_bucket_ids(
    data: Any, levels: int, count: int, predicted: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Inverse of :func:`encode_bucket_ids`: the ids, in :func:`id_dtype` of ``levels``.

    Raises:
        FormatError / CorruptCheckpointError: the stream does not describe ``count`` ids
        over ``levels`` levels, or needs a prediction that was not given.
    """
    view = memoryview(data).cast("B")
    if len(view) < _HEAD.size:
        raise CorruptCheckpointError("bucket-id stream is shorter than its header")
    mode, stored_levels, run_symbol = _HEAD.unpack_from(view)
    tokens, cursor = decode_varint(view, _HEAD.size)
    coded_bytes, cursor = decode_varint(view, cursor)
    extra_bits, cursor = decode_varint(view, cursor)
    if stored_levels != levels or run_symbol >= levels or mode not in (PLAIN, PREDICTED, REARRANGED):
        raise FormatError(
            f"bucket-id stream (mode {mode}, {stored_levels} levels) does not fit {levels} levels"
        )
    if mode != PLAIN:
        if predicted is None:
            raise FormatError("bucket-id stream was coded against predicted ids that were not given")
        if predicted.numel() != count:
            raise FormatError("predicted ids do not match the tensor's size")
    extra_bytes = -(-extra_bits // 8)
    if cursor + coded_bytes + extra_bytes != len(view) or tokens > count:
        raise CorruptCheckpointError("bucket-id stream size does not match its header")
    symbols = decode_symbols(view[cursor : cursor + coded_bytes], tokens)
    extra = bytes(view[cursor + coded_bytes :])
    positions, values = from_run_tokens(symbols, extra, extra_bits, levels, count)
    dtype = id_dtype(levels)
    if mode == PLAIN:
        ids = torch.full((count,), run_symbol, dtype=dtype)
        ids[positions] = torch.remainder(values + run_symbol, levels).to(dtype)
        return ids
    predicted = predicted.reshape(-1)
    ids = predicted.to(dtype=dtype, device="cpu", copy=True)
    if mode == REARRANGED:
        order, _ = _rank(ids, levels)
        positions = order[positions]
    ids[positions] = torch.remainder(ids[positions].long() + values, levels).to(dtype)
    return ids
