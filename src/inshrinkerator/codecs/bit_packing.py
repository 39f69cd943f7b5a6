"""Fixed-width packing of small integer codes into bytes (the storage of quantized tensors).

Code ``i`` occupies bits ``[i * bits, (i + 1) * bits)`` of the stream, least
significant bit first, bytes in order; the last byte is zero-padded. So two
4-bit codes share a byte with the first in the low nibble.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CorruptCheckpointError

__all__ = ["pack_codes", "unpack_codes", "packed_size"]

MAX_BITS = 8


def packed_size(count: int, bits: int) -> int:
    """Bytes that ``count`` codes of ``bits`` bits take."""
    return -(-count * bits // 8)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"code width must be an int in [1, {MAX_BITS}] bits, got {bits!r}")


def _or_shifted(columns: torch.Tensor, width: int) -> torch.Tensor:
    """Row-wise OR of ``columns[:, j] << (j * width)`` (uint8)."""
    packed = columns[:, 0].clone()
    for j in range(1, columns.shape[1]):
        packed |= columns[:, j] << (j * width)
    return packed


def _pad(flat: torch.Tensor, multiple: int) -> torch.Tensor:
    padding = (-flat.numel()) % multiple
    return torch.cat([flat, flat.new_zeros(padding)]) if padding else flat


def pack_codes(codes: torch.Tensor, bits: int) -> bytes:
    """Pack integer ``codes`` (any shape, flattened; each in ``[0, 2**bits)``) into bytes.

    Raises:
        ValueError: ``bits`` is out of range or a code does not fit in it.
    """
    _check_bits(bits)
    flat = codes.detach().reshape(-1).to("cpu")
    if flat.numel() == 0:
        return b""
    if int(flat.min()) < 0 or int(flat.max()) >= 1 << bits:
        raise ValueError(f"codes lie outside [0, {1 << bits}) and do not fit in {bits} bits")
    small = flat.to(torch.uint8)
    if 8 % bits == 0:  # whole codes per byte: combine them directly
        return _or_shifted(_pad(small, 8 // bits).reshape(-1, 8 // bits), bits).numpy().tobytes()
    # Otherwise 8 codes fill exactly ``bits`` bytes: build each group as one 56-bit-at-most
    # integer, then cut it into bytes.
    groups = _pad(flat.to(torch.int64), 8).reshape(-1, 8)
    value = groups[:, 0].clone()
    for j in range(1, 8):
        value |= groups[:, j] << (j * bits)
    cut = torch.stack([(value >> (8 * k)) & 0xFF for k in range(bits)], dim=1).to(torch.uint8)
    return cut.reshape(-1)[: packed_size(flat.numel(), bits)].numpy().tobytes()


def unpack_codes(data: Any, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: an int64 tensor of ``count`` codes.

    Raises:
        CorruptCheckpointError: ``data`` is not exactly the size ``count`` codes pack into.
    """
    _check_bits(bits)
    view = memoryview(data).cast("B")
    expected = packed_size(count, bits)
    if len(view) != expected:
        raise CorruptCheckpointError(
            f"packed codes hold {len(view)} bytes, expected {expected} for {count} {bits}-bit codes"
        )
    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    packed = torch.frombuffer(bytearray(view), dtype=torch.uint8)
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
        return ((packed.unsqueeze(1) >> shifts) & mask).reshape(-1)[:count].to(torch.int64)
    groups = _pad(packed.to(torch.int64), bits).reshape(-1, bits)
    value = groups[:, 0].clone()
    for k in range(1, bits):
        value |= groups[:, k] << (8 * k)
    codes = torch.stack([(value >> (j * bits)) & mask for j in range(8)], dim=1)
    return codes.reshape(-1)[:count]
