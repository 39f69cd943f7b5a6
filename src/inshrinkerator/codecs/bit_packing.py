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


def pack_codes(codes: torch.Tensor, bits: int) -> bytes:
    """Pack integer ``codes`` (any shape, flattened; each in ``[0, 2**bits)``) into bytes.

    Raises:
        ValueError: ``bits`` is out of range or a code does not fit in it.
    """
    _check_bits(bits)
    flat = codes.detach().reshape(-1).to("cpu", torch.int64)
    if flat.numel() == 0:
        return b""
    if int(flat.min()) < 0 or int(flat.max()) >= 1 << bits:
        raise ValueError(f"codes lie outside [0, {1 << bits}) and do not fit in {bits} bits")
    if bits == 8:
        return flat.to(torch.uint8).numpy().tobytes()
    shifts = torch.arange(bits, dtype=torch.int64)
    bit_stream = ((flat.unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    padding = (-bit_stream.numel()) % 8
    if padding:
        bit_stream = torch.cat([bit_stream, bit_stream.new_zeros(padding)])
    weights = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8)
    packed = (bit_stream.reshape(-1, 8) * weights).sum(dim=1, dtype=torch.int64).to(torch.uint8)
    return packed.numpy().tobytes()


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
    packed = torch.frombuffer(bytearray(view), dtype=torch.uint8).to(torch.int64)
    if bits == 8:
        return packed
    shifts = torch.arange(8, dtype=torch.int64)
    bit_stream = ((packed.unsqueeze(1) >> shifts) & 1).reshape(-1)[: count * bits]
    weights = torch.tensor([1 << k for k in range(bits)], dtype=torch.int64)
    return (bit_stream.reshape(count, bits) * weights).sum(dim=1)
