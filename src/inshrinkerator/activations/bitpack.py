"""Bit packing in torch ops (device-agnostic): boolean masks and unsigned integer codes.

:func:`pack_mask` stores a boolean tensor in one bit per element. :func:`pack_codes`
stores non-negative integer codes with *group-wise* bit widths: the codes are cut into
groups of :data:`GROUP` values and every group is written with just enough bits for
its largest value (frame-of-reference packing without the reference, as the codes of
the activation quantizer are already small near zero). The widths, one byte per group,
let the decoder find every group without a sequential scan, so both directions are a
handful of vectorized tensor ops on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GROUP", "PackedCodes", "pack_mask", "unpack_mask", "pack_codes", "unpack_codes"]

GROUP = 64  # values per group; a multiple of 8 so every group fills whole bytes at any width
_MAX_WIDTH = 32


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tensor (any shape, flattened) into ``ceil(n / 8)`` uint8 bytes."""
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=flat.device)
    return (flat.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_mask(packed: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` booleans of a :func:`pack_mask` result, as a flat bool tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.view(-1, 1) >> shifts) & 1
    return bits.reshape(-1)[:count].bool()


def _bit_length(values: torch.Tensor) -> torch.Tensor:
    """Bits needed for each non-negative int64 value (0 for 0), exactly, without floats."""
    width = torch.zeros_like(values, dtype=torch.int64)
    remaining = values.clone()
    for step in (16, 8, 4, 2, 1):
        big = remaining >= (1 << step)
        width += big.long() * step
        remaining = torch.where(big, remaining >> step, remaining)
    return width + (remaining > 0).long()


def _pack_fixed(groups: torch.Tensor, width: int) -> torch.Tensor:
    """Pack int64 values (rows of GROUP values, each < 2**width) at ``width`` bits into bytes."""
    if width > 8:
        low = _pack_fixed(groups & 0xFF, 8)
        return torch.cat([low, _pack_fixed(groups >> 8, width - 8)])
    shifts = torch.arange(0, 8 * width, width, dtype=torch.int64, device=groups.device)
    # the 8 values of an octet occupy disjoint bits of one 64-bit word, so a sum is an OR
    word = (groups.reshape(-1, 8) << shifts).sum(dim=1)
    # little-endian bytes of each word; 8 values x width bits fill exactly `width` bytes
    return word.view(torch.uint8).view(-1, 8)[:, :width].reshape(-1)


def _unpack_fixed(data: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """Inverse of :func:`_pack_fixed`: ``rows`` groups of int64 values."""
    if width > 8:
        low_bytes = rows * GROUP
        low = _unpack_fixed(data[:low_bytes], rows, 8)
        return low | (_unpack_fixed(data[low_bytes:], rows, width - 8) << 8)
    octets = rows * GROUP // 8
    padded = torch.zeros(octets, 8, dtype=torch.uint8, device=data.device)
    padded[:, :width] = data.view(octets, width)
    word = padded.view(-1).view(torch.int64)
    shifts = torch.arange(0, 8 * width, width, dtype=torch.int64, device=data.device)
    values = (word.unsqueeze(1) >> shifts) & ((1 << width) - 1)
    return values.reshape(rows, GROUP)


@dataclass
class PackedCodes:
    """Group-wise bit-packed codes: one width byte per group, then the groups by width."""

    count: int
    widths: torch.Tensor  # uint8, one per group
    data: torch.Tensor  # uint8

    @property
    def nbytes(self) -> int:
        return self.widths.numel() + self.data.numel()


def _groups(codes: torch.Tensor) -> torch.Tensor:
    flat = codes.reshape(-1)
    pad = (-flat.numel()) % GROUP
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, GROUP)


def _widths(groups: torch.Tensor) -> torch.Tensor:
    if not groups.numel():
        return torch.zeros(0, dtype=torch.int64, device=groups.device)
    return _bit_length(groups.amax(dim=1).long())


def packed_size(codes: torch.Tensor) -> int:
    """Bytes :func:`pack_codes` would use for ``codes`` (non-negative), without packing them."""
    widths = _widths(_groups(codes))
    return widths.numel() + int(widths.sum()) * GROUP // 8


def pack_codes(codes: torch.Tensor) -> PackedCodes:
    """Pack non-negative integer codes (< 2**32) with a bit width chosen per group of 64."""
    count = codes.numel()
    groups = _groups(codes)
    if count:
        low, high = torch.aminmax(groups)
        if int(low) < 0 or int(high) >= 1 << _MAX_WIDTH:
            raise ValueError(f"codes must lie in [0, 2**{_MAX_WIDTH}) to be bit-packed")
    widths = _widths(groups)
    pieces = []
    for width in torch.unique(widths).tolist():
        if width:
            rows = torch.nonzero(widths == width).reshape(-1)
            pieces.append(_pack_fixed(torch.index_select(groups, 0, rows).long(), int(width)))
    data = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8, device=codes.device)
    return PackedCodes(count, widths.to(torch.uint8), data)


def unpack_codes(packed: PackedCodes) -> torch.Tensor:
    """The flat int64 codes a :func:`pack_codes` call packed."""
    widths = packed.widths.long()
    groups = torch.zeros(widths.numel(), GROUP, dtype=torch.int64, device=packed.data.device)
    offset = 0
    for width in torch.unique(widths).tolist():
        if not width:
            continue
        rows = torch.nonzero(widths == width).reshape(-1)
        size = rows.numel() * GROUP * int(width) // 8
        values = _unpack_fixed(packed.data[offset:offset + size], rows.numel(), int(width))
        groups.index_copy_(0, rows, values)
        offset += size
    return groups.reshape(-1)[:packed.count]
