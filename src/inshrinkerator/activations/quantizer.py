"""An error-bounded uniform quantizer for activations, in torch ops (any device).

Bins are ``step = 2 eb`` wide and every value comes back as its bin's centre, so
``|x - x_hat| <= eb`` for every element and, inside a bin, the error is spread evenly over
``[-eb, eb]`` with mean zero (the model the adaptive bound in ``adaptive.py`` relies on).
Two bin layouts:

- **mid-tread** (the default): ``k = round(x / step)``, ``x_hat = k * step``. Zeros stay
  zero; values within ``eb`` of zero become zero; no value changes sign.
- **positive** (a non-negative tensor with exact zeros, i.e. a ReLU output): zeros are
  bin 0 and stay exactly zero, a positive ``x`` goes to ``k = floor(x / step) + 1`` and
  comes back as ``(k - 1/2) * step > 0``. So the ReLU mask read back is exact: what is
  zero stays zero and what is positive stays positive.

The bins are narrowed by the worst float rounding of the reconstruction, so the bound
holds for the decoded values in the tensor's own dtype (see :func:`quantize`). The integer
codes are bit-packed per group of 64 (``bitpack.py``), a chunk of 2**20 values at a time so
the integer temporaries stay small; a chunk with many zero codes is stored as a zero mask
plus the packed non-zero codes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .bitpack import PackedCodes, pack_codes, pack_mask, packed_size, unpack_codes, unpack_mask

__all__ = ["QuantizedActivation", "QuantizedChunk", "quantize", "working_dtype"]

_MAX_CODE = (1 << 31) - 1  # bins beyond this would not fit the 32-bit packing


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the arithmetic runs in: float64 stays, everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _bound_in(dtype: torch.dtype, error_bound: float) -> float:
    """The largest value of ``dtype`` that is <= ``error_bound`` (so a check in it is exact)."""
    value = torch.tensor(error_bound, dtype=torch.float64).to(dtype)
    if float(value) > error_bound:
        value = torch.nextafter(value, torch.zeros_like(value))
    return float(value)


_CHUNK = 1 << 20  # values coded at a time: bounds the integer temporaries to a few MB


@dataclass
class QuantizedChunk:
    """Up to ``_CHUNK`` consecutive values: packed codes, and a zero mask if stored sparsely."""

    count: int
    sparse_mask: Optional[torch.Tensor]  # packed bits of (code != 0)
    codes: PackedCodes

    @property
    def nbytes(self) -> int:
        return (0 if self.sparse_mask is None else self.sparse_mask.numel()) + self.codes.nbytes


@dataclass
class QuantizedActivation:
    """A quantized activation: step, layout flags and the packed chunks; decodes anywhere."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    step: float
    positive: bool  # the positive layout (zero bin + positive bins), else mid-tread
    signed: bool  # codes can be negative (zigzag-packed)
    chunks: list[QuantizedChunk]

    @property
    def nbytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks) + 32

    def decode(self) -> torch.Tensor:
        """The reconstruction, in the original dtype, shape and device."""
        work = working_dtype(self.dtype)
        out = torch.empty(math.prod(self.shape), dtype=self.dtype, device=self.device)
        offset = 0
        for chunk in self.chunks:
            unsigned = unpack_codes(chunk.codes)
            if chunk.sparse_mask is not None:
                nonzero = unpack_mask(chunk.sparse_mask, chunk.count)
                codes = torch.zeros(chunk.count, dtype=torch.int64, device=unsigned.device)
                codes.masked_scatter_(nonzero, _from_nonzero_unsigned(unsigned, self.signed))
            else:
                codes = _from_unsigned(unsigned, self.signed)
            out[offset:offset + chunk.count] = _reconstruct(codes, self.step, self.positive, work)
            offset += chunk.count
        return out.view(self.shape)


def _reconstruct(codes: torch.Tensor, step: float, positive: bool, work: torch.dtype) -> torch.Tensor:
    values = codes.to(work)
    if not positive:
        return values.mul_(step)
    # (k - 1/2) * step for k >= 1; sign(0) = 0 keeps bin 0 at zero
    return (values - 0.5).mul_(torch.sign(values)).mul_(step)


def _zigzag(codes: torch.Tensor) -> torch.Tensor:
    # 0, -1, 1, -2, 2 ... -> 0, 1, 2, 3, 4: small magnitudes stay small
    return (codes << 1) ^ (codes >> (8 * codes.element_size() - 1))


def _unzigzag(unsigned: torch.Tensor) -> torch.Tensor:
    return (unsigned >> 1) ^ -(unsigned & 1)


def _to_unsigned(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    return _zigzag(codes) if signed else codes


def _from_unsigned(unsigned: torch.Tensor, signed: bool) -> torch.Tensor:
    return _unzigzag(unsigned) if signed else unsigned


def _to_nonzero_unsigned(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    # codes are never 0 here, so shift the zigzag order down by one: -1, 1, -2 ... -> 0, 1, 2 ...
    return (_zigzag(codes) if signed else codes) - 1


def _from_nonzero_unsigned(unsigned: torch.Tensor, signed: bool) -> torch.Tensor:
    return _unzigzag(unsigned + 1) if signed else unsigned + 1


_SPARSE_MIN_ZEROS = 0.1  # below this zero fraction a zero mask cannot pay for itself


def quantize(tensor: torch.Tensor, error_bound: float) -> Optional[QuantizedActivation]:
    """Quantize a floating tensor so that every element is within ``error_bound`` of the original.

    Why the bound holds in floating point: computing ``x / step`` can put a value one bin off
    only when it sits within ``|x| eps`` of a bin edge, and rounding the centre (in the working
    dtype, then in the output dtype) moves it by at most ``|x| (eps_work + eps_out) / 2``. The
    bins are narrowed by ``slack = peak (eps_out + 2 eps_work)``, which covers both, so no check
    is needed; if that slack would eat half the bound, the result is verified instead.

    Returns ``None`` when the bound cannot be met (non-finite values, a bound below the
    dtype's resolution at the tensor's magnitude, more bins than 32-bit codes hold, a bin
    beyond the dtype's largest value): the caller keeps the tensor then.
    """
    if not tensor.is_floating_point() or not error_bound > 0 or not math.isfinite(error_bound):
        return None
    if tensor.numel() == 0:
        return None
    work = working_dtype(tensor.dtype)
    flat = tensor.detach().reshape(-1).to(work)
    low, high = torch.aminmax(flat)
    low_value, high_value = float(low), float(high)
    peak = max(abs(low_value), abs(high_value))
    if not math.isfinite(peak):
        return None
    bound = _bound_in(work, error_bound)
    slack = peak * (torch.finfo(tensor.dtype).eps + 2 * torch.finfo(work).eps)
    step = 2.0 * (bound - slack) if slack < bound / 2 else bound
    if not step > 0 or peak / step >= _MAX_CODE - 2:  # a bound that underflowed the working dtype
        return None
    if peak + step > torch.finfo(tensor.dtype).max:
        # The bin nearest a value within a step of the dtype's largest lies beyond it, and
        # would come back as inf (float32 values of +-3e38 under a bound of 6e37).
        return None
    code_dtype = torch.int32 if peak / step < (1 << 29) else torch.int64
    nonnegative = low_value >= 0
    positive = nonnegative and int(torch.count_nonzero(flat)) < flat.numel()
    signed = low_value < 0
    chunks = []
    for start in range(0, flat.numel(), _CHUNK):
        chunk = _quantize_chunk(flat[start:start + _CHUNK], step, bound, positive, signed, code_dtype,
                                tensor.dtype, verify=slack >= bound / 2)
        if chunk is None:
            return None
        chunks.append(chunk)
    return QuantizedActivation(tuple(tensor.shape), tensor.dtype, tensor.device, step, positive, signed,
                               chunks)


def _quantize_chunk(flat: torch.Tensor, step: float, bound: float, positive: bool, signed: bool,
                    code_dtype: torch.dtype, dtype: torch.dtype, verify: bool) -> Optional[QuantizedChunk]:
    if positive:
        # sign() is 0 for the zeros, so they land in bin 0; positives land in bins >= 1
        codes = (flat / step).floor_().add_(1).mul_(torch.sign(flat)).to(code_dtype)
    else:
        codes = torch.round(flat / step).to(code_dtype)
    if verify:
        recon = _reconstruct(codes, step, positive, flat.dtype).to(dtype).to(flat.dtype)
        if bool(((flat - recon).abs() > bound).any()):
            return None
    zero_fraction = 1.0 - int(torch.count_nonzero(codes)) / codes.numel()
    mask: Optional[torch.Tensor] = None
    unsigned = _to_unsigned(codes, signed)
    if zero_fraction >= _SPARSE_MIN_ZEROS:
        nonzero = codes != 0
        sparse = _to_nonzero_unsigned(torch.masked_select(codes, nonzero), signed)
        if (codes.numel() + 7) // 8 + packed_size(sparse) < packed_size(unsigned):
            mask, unsigned = pack_mask(nonzero), sparse
    return QuantizedChunk(codes.numel(), mask, pack_codes(unsigned))
