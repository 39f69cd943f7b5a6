"""Huffman coding of low-entropy symbols in tuples: several symbols per coded byte.

zstd's Huffman coder (:func:`.entropy.huffman_frame`) spends at least one bit on
every byte, so it cannot code symbols of ~1 bit each anywhere near their
entropy. Here ``size`` consecutive symbols (2 or 4) form one byte, in base
``radix`` (16 or 4: ``radix ** size == 256``): the ``radix - 1`` most frequent
symbols are digits of their own and every other symbol is the *escape* digit,
its value sent in a second Huffman frame. A byte then carries 2-4x the
information of one symbol, which brings Huffman within a few percent of the
symbols' order-0 entropy (on real bucket-id streams often below it: a byte also
captures what neighbouring symbols have in common), at Huffman's speed: ~100x
faster than the ANS stage both ways. Decoding is one table lookup per byte.

Layout: ``u8 size, u8 direct`` (digits that stand for a symbol), the ``direct``
symbols (one byte each, digit order), ``varint escapes, varint tuple-frame
bytes``, the tuple frame (``ceil(count / size)`` bytes: the first symbol in the
most significant digit, the last byte padded with digit 0), the escape frame
(the escaped symbols, one byte each; absent without escapes).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from ._numpy_paths import nonzero_positions, positions_of
from .entropy import expand_frame, huffman_frame
from .scratch import scratch
from .varint import decode_varint, encode_varint

__all__ = ["TUPLE_SIZES", "encode_symbol_tuples", "decode_symbol_tuples", "tuple_header_bytes"]

#: Symbols per byte, and the digit radix of each.
TUPLE_SIZES = {2: 16, 4: 4}
# Streams of at most this many symbols are packed and unpacked in NumPy (its calls cost
# less than torch's on them).
_NUMPY_UP_TO = 1 << 14
# One table entry per byte value packs its ``size`` symbols into one integer of this dtype.
_PACKED = {2: torch.int16, 4: torch.int32}


@functools.lru_cache(maxsize=None)
def _digit_table(size: int, radix: int) -> torch.Tensor:
    """The digits of every byte value, most significant first: ``size`` int32 per byte
    value, flat (made once per tuple size; never modified)."""
    values = torch.arange(256, dtype=torch.int64).reshape(-1, 1)
    powers = radix ** torch.arange(size - 1, -1, -1, dtype=torch.int64)
    return ((values // powers) % radix).to(torch.int32).reshape(-1)


def _escape_positions(
    packed: torch.Tensor, digits_or_symbols: torch.Tensor, escape: int, size: int, radix: int, expected: int
) -> torch.Tensor:
    """Ascending positions of the ``expected`` (about) escapes, found from the packed bytes first.

    The escape digit is the largest (all its bits set), so a few byte-wide ANDs over
    ``count / size`` bytes find the tuples that hold one; only their ``size`` symbols are
    then compared with ``escape`` (a full comparison and ``nonzero`` cost ~4x more, unless
    escapes are so frequent that most tuples hold one).
    """
    if expected * 16 > digits_or_symbols.numel():
        return positions_of(digits_or_symbols, escape)
    digit_bits = radix.bit_length() - 1
    marked = packed.clone()
    for shift in range(1, digit_bits):
        marked &= packed >> shift
    marked &= 0x55 if digit_bits == 2 else 0x11  # the lowest bit of every digit
    tuples = nonzero_positions(marked)
    # The padded tail holds digit 0, never an escape; nonzero + index_select beat masks.
    candidates = (tuples.reshape(-1, 1) * size + torch.arange(size)).reshape(-1)
    hits = positions_of(digits_or_symbols.index_select(0, candidates), escape)
    return candidates.index_select(0, hits)


def encode_symbol_tuples(symbols: torch.Tensor, counts: torch.Tensor, size: int) -> bytes:
    """Code ``symbols`` (integers below 256, any dtype) in tuples of ``size``.

    ``counts``: the symbols' histogram (``bincount``), which ranks them.
    """
    if size not in TUPLE_SIZES:
        raise ValueError(f"tuple size must be one of {sorted(TUPLE_SIZES)}, got {size}")
    radix = TUPLE_SIZES[size]
    flat = symbols.reshape(-1).cpu()
    # The symbol table in NumPy: on a few hundred entries its calls cost a fraction of
    # torch's (and keep the GIL, which each torch call hands to the other codec thread).
    table = counts.cpu().numpy().reshape(-1).astype(np.int64)
    if table.size > 256:
        if bool((table[256:] > 0).any()):
            raise ValueError("tuple coding takes symbols below 256")
        table = table[:256]
    present = int(np.count_nonzero(table))
    direct = present if present <= radix else radix - 1
    ranked = np.argsort(-table, kind="stable")[:direct]
    # digit of every symbol value: its rank among the direct symbols, else the escape digit.
    digit_of = np.full(256, radix - 1, dtype=np.uint8)
    digit_of[ranked] = np.arange(direct, dtype=np.uint8)
    count = flat.numel()
    escapes = count - int(table[ranked].sum()) if present > direct else 0  # every other symbol escapes
    if count <= _NUMPY_UP_TO:
        packed, values = _packed_in_numpy(flat.numpy(), digit_of, size, radix, escapes)
    else:
        packed, values = _packed(flat, torch.from_numpy(digit_of), size, radix, escapes)
    escaped = huffman_frame(values) if values is not None else b""
    frame = huffman_frame(packed)
    head = bytes([size, direct]) + ranked.astype(np.uint8).tobytes()
    return b"".join([head, encode_varint(0 if values is None else values.size), encode_varint(len(frame)), frame, escaped])


def _packed(
    flat: torch.Tensor, digit_of: torch.Tensor, size: int, radix: int, escapes: int
) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """``(tuple bytes, escaped symbols as uint8 or None)`` of ``flat`` (CPU symbols), with
    ``escapes`` of them known to escape."""
    count = flat.numel()
    padding = (-count) % size
    digits = torch.zeros(count + padding, dtype=torch.uint8)  # padded with digit 0
    index = scratch("tuple-index", count, torch.int32, flat.device).copy_(flat)
    torch.index_select(digit_of, 0, index, out=digits[:count])
    columns = digits.reshape(-1, size)
    packed = columns[:, 0].clone()
    for column in range(1, size):
        # Horner in uint8: every partial value stays below radix ** size = 256.
        packed.mul_(radix).add_(columns[:, column])
    values = None
    if escapes:
        positions = _escape_positions(packed, digits, radix - 1, size, radix, escapes)
        values = flat.index_select(0, positions).to(torch.uint8).numpy()
    return packed.numpy(), values


def _packed_in_numpy(
    flat: np.ndarray, digit_of: np.ndarray, size: int, radix: int, escapes: int
) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """:func:`_packed` of a short stream, in NumPy (the same bytes)."""
    count = flat.size
    digits = np.zeros(count + (-count) % size, dtype=np.uint8)
    digits[:count] = digit_of[flat]
    columns = digits.reshape(-1, size)
    packed = columns[:, 0].copy()
    for column in range(1, size):
        packed *= radix
        packed += columns[:, column]
    values = None
    if escapes:
        values = flat[np.flatnonzero(digits[:count] == radix - 1)].astype(np.uint8)
    return packed, values


def tuple_header_bytes(data: Any) -> int:
    """The bytes of an :func:`encode_symbol_tuples` output before its frames (the symbol table)."""
    view = memoryview(data).cast("B")
    _, cursor = decode_varint(view, 2 + view[1])
    return decode_varint(view, cursor)[1]


def decode_symbol_tuples(data: Any, count: int) -> torch.Tensor:
    """Inverse of :func:`encode_symbol_tuples`: the ``count`` symbols as uint8.

    Raises:
        CorruptCheckpointError: the data is damaged or does not hold ``count`` symbols.
    """
    view = memoryview(data).cast("B")
    if len(view) < 2 or view[0] not in TUPLE_SIZES:
        raise CorruptCheckpointError("symbol tuples: the header is damaged")
    size, direct = view[0], view[1]
    radix = TUPLE_SIZES[size]
    if not 1 <= direct <= radix or len(view) < 2 + direct:
        raise CorruptCheckpointError("symbol tuples: the header is damaged")
    escape_count, cursor = decode_varint(view, 2 + direct)
    frame_bytes, cursor = decode_varint(view, cursor)
    if cursor + frame_bytes > len(view) or escape_count > count or (escape_count and direct != radix - 1):
        raise CorruptCheckpointError("symbol tuples: sizes do not match the header")
    if count <= _NUMPY_UP_TO:
        return _decode_in_numpy(view, count, size, direct, cursor, frame_bytes, escape_count)
    symbols_of = torch.frombuffer(bytearray(view[2 : 2 + direct]), dtype=torch.uint8)
    is_direct = torch.zeros(256, dtype=torch.bool)
    is_direct[symbols_of.long()] = True
    if int(is_direct.sum()) != direct:
        raise CorruptCheckpointError("symbol tuples: a symbol has two digits")
    # Escapes decode first to a placeholder no direct symbol has, then get their values.
    marker = int(torch.nonzero(~is_direct)[0]) if direct < 256 else 0
    digit_symbols = torch.full((radix,), marker, dtype=torch.uint8)
    digit_symbols[:direct] = symbols_of
    table = digit_symbols.index_select(0, _digit_table(size, radix))
    table = table.reshape(256, size).view(_PACKED[size]).reshape(-1)
    packed_count = -(-count // size)
    packed = torch.frombuffer(bytearray(expand_frame(view[cursor : cursor + frame_bytes], packed_count)), dtype=torch.uint8)
    padded = table.index_select(0, packed.int()).view(torch.uint8)
    symbols = padded[:count]
    escapes_at = cursor + frame_bytes
    if escape_count:
        values = torch.frombuffer(bytearray(expand_frame(view[escapes_at:], escape_count)), dtype=torch.uint8)
        if bool(is_direct.index_select(0, values.int()).any()):
            raise CorruptCheckpointError("symbol tuples: an escaped symbol has a digit of its own")
        positions = _escape_positions(packed, padded, marker, size, radix, escape_count)
        if positions.numel() != escape_count or (escape_count and int(positions[-1]) >= count):
            raise CorruptCheckpointError("symbol tuples: escapes do not match their digits")
        symbols.index_put_((positions,), values)
    elif escapes_at != len(view):
        raise CorruptCheckpointError("symbol tuples: bytes follow the tuple frame")
    elif direct < radix and bool((symbols == marker).any()):
        raise CorruptCheckpointError("symbol tuples: a digit stands for no symbol")
    return symbols


def _decode_in_numpy(view: memoryview, count: int, size: int, direct: int, cursor: int, frame_bytes: int, escape_count: int) -> torch.Tensor:
    """:func:`decode_symbol_tuples` of a short stream after its header, in NumPy (the same
    symbols, and the same errors)."""
    radix = TUPLE_SIZES[size]
    symbols_of = np.frombuffer(view[2 : 2 + direct], dtype=np.uint8)
    is_direct = np.zeros(256, dtype=bool)
    is_direct[symbols_of] = True
    if int(is_direct.sum()) != direct:
        raise CorruptCheckpointError("symbol tuples: a symbol has two digits")
    marker = int(np.flatnonzero(~is_direct)[0]) if direct < 256 else 0
    digit_symbols = np.full(radix, marker, dtype=np.uint8)
    digit_symbols[:direct] = symbols_of
    table = digit_symbols[_digit_table(size, radix).numpy()].reshape(256, size)
    packed_count = -(-count // size)
    packed = np.frombuffer(expand_frame(view[cursor : cursor + frame_bytes], packed_count), dtype=np.uint8)
    padded = table[packed].reshape(-1)
    symbols = padded[:count]
    escapes_at = cursor + frame_bytes
    if escape_count:
        values = np.frombuffer(expand_frame(view[escapes_at:], escape_count), dtype=np.uint8)
        if bool(is_direct[values].any()):
            raise CorruptCheckpointError("symbol tuples: an escaped symbol has a digit of its own")
        positions = np.flatnonzero(padded == marker)
        if positions.size != escape_count or (escape_count and int(positions[-1]) >= count):
            raise CorruptCheckpointError("symbol tuples: escapes do not match their digits")
        symbols[positions] = values
    elif escapes_at != len(view):
        raise CorruptCheckpointError("symbol tuples: bytes follow the tuple frame")
    elif direct < radix and bool((symbols == marker).any()):
        raise CorruptCheckpointError("symbol tuples: a digit stands for no symbol")
    return torch.from_numpy(symbols)
