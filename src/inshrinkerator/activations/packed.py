"""What the saved-tensor pack hook returns: a handle owning one compressed activation.

A handle is created once per distinct saved tensor and may be handed to autograd by
several ops; autograd may unpack it any number of times. Nothing is freed on unpack: the
compressed bytes live exactly as long as autograd (or anyone) holds the handle. The last
decoded tensor is remembered through a weak reference only, so a second unpack while the
first result is still in use costs nothing and holds nothing extra.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Optional, Protocol, Union

import torch

from .bitpack import PackedCodes, pack_codes, pack_mask, packed_size, unpack_codes, unpack_mask
from .quantizer import QuantizedActivation
from .sz3 import SZ3Activation

__all__ = ["PackedActivation", "TwoValuedMask", "two_valued_mask", "IntegerDeltas", "integer_deltas",
           "CompressedPayload"]


class _Payload(Protocol):
    @property
    def nbytes(self) -> int: ...

    def decode(self) -> torch.Tensor: ...


@dataclass
class TwoValuedMask:
    """A tensor whose values are all 0 or one constant (a dropout mask): one bit per value."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    value: Union[float, bool, int]
    bits: torch.Tensor  # uint8, from pack_mask

    @property
    def nbytes(self) -> int:
        return self.bits.numel() + 32

    def decode(self) -> torch.Tensor:
        mask = unpack_mask(self.bits, math.prod(self.shape)).view(self.shape)
        if self.dtype == torch.bool:
            return mask
        return mask.to(self.dtype) * torch.tensor(self.value, dtype=self.dtype, device=mask.device)


def two_valued_mask(tensor: torch.Tensor) -> Optional[TwoValuedMask]:
    """A :class:`TwoValuedMask` of ``tensor`` if its values are only 0 and one other constant."""
    if tensor.dtype == torch.bool:
        return TwoValuedMask(tuple(tensor.shape), tensor.dtype, True, pack_mask(tensor))
    if tensor.is_complex() or tensor.numel() == 0:
        return None
    low, high = torch.aminmax(tensor.detach().reshape(-1))
    if float(low) != 0 or not 0 < float(high) < math.inf:  # 0 * inf would decode as NaN
        return None
    if not bool(((tensor == 0) | (tensor == high)).all()):
        return None
    value = high.item()
    return TwoValuedMask(tuple(tensor.shape), tensor.dtype, value, pack_mask(tensor != 0))


@dataclass
class IntegerDeltas:
    """An integer tensor (max-pool indices) stored losslessly: bit-packed zigzag deltas."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    first: int
    deltas: PackedCodes

    @property
    def nbytes(self) -> int:
        return self.deltas.nbytes + 32

    def decode(self) -> torch.Tensor:
        unsigned = unpack_codes(self.deltas)
        deltas = (unsigned >> 1) ^ -(unsigned & 1)
        values = torch.cumsum(deltas, dim=0) + self.first
        return values.to(self.dtype).view(self.shape)


_DELTA_LIMIT = 1 << 30


def integer_deltas(tensor: torch.Tensor) -> Optional[IntegerDeltas]:
    """Lossless :class:`IntegerDeltas` of an integer tensor, or None if it would not halve it.

    Neighbouring max-pool indices differ by about the stride, so their deltas pack into a
    few bits each.
    """
    if tensor.dtype not in (torch.int64, torch.int32, torch.int16) or tensor.numel() < 2:
        return None
    flat = tensor.detach().reshape(-1).long()
    deltas = flat[1:] - flat[:-1]
    low, high = torch.aminmax(deltas)
    if int(low) <= -_DELTA_LIMIT or int(high) >= _DELTA_LIMIT:
        return None
    unsigned = torch.cat([deltas.new_zeros(1), (deltas << 1) ^ (deltas >> 63)])
    if 2 * packed_size(unsigned) > tensor.numel() * tensor.element_size():
        return None
    return IntegerDeltas(tuple(tensor.shape), tensor.dtype, int(flat[0]), pack_codes(unsigned))


CompressedPayload = Union[QuantizedActivation, SZ3Activation, TwoValuedMask, IntegerDeltas]


class PackedActivation:
    """The object autograd keeps instead of a saved tensor; :meth:`unpack` rebuilds the tensor."""

    __slots__ = ("payload", "original_bytes", "_decoded", "__weakref__")

    def __init__(self, payload: CompressedPayload, original_bytes: int) -> None:
        self.payload = payload
        self.original_bytes = original_bytes
        self._decoded: Optional[weakref.ref] = None

    @property
    def nbytes(self) -> int:
        """Bytes the payload says it holds (the codec's own accounting)."""
        return self.payload.nbytes

    def unpack(self) -> torch.Tensor:
        """The decoded tensor (same shape, dtype and device as the saved one); callable repeatedly."""
        if self._decoded is not None:
            cached = self._decoded()
            if cached is not None:
                return cached
        tensor = self.payload.decode()
        self._decoded = weakref.ref(tensor)
        return tensor
