"""What the lossy codecs accept, and the precision they compute in.

Lossy codecs take floating tensors with finite values only: a NaN or an
infinity has no meaningful quantized value, so policies keep such tensors
lossless and a codec refuses them instead of writing garbage. Arithmetic runs
in float32 (float64 tensors in float64), whatever the stored dtype, so the
encoder's reconstruction and the decoder's output are computed by the same
operations in the same precision and agree bit for bit.
"""

from __future__ import annotations

import torch

from ..errors import FormatError
from .base import TensorSpec

__all__ = ["working_dtype", "all_finite", "below_normal", "checked_float_input", "require_float_spec"]


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The precision a lossy codec computes in for a tensor of ``dtype``."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of a floating tensor is finite.

    One sum in the working dtype settles it almost always (a NaN or an infinity makes
    the sum non-finite; a sum of finite values that overflows falls back to the exact
    check): ~18x faster than ``isfinite(tensor).all()``, which writes a mask first.
    """
    if tensor.numel() == 0:
        return True
    if bool(torch.isfinite(tensor.sum(dtype=working_dtype(tensor.dtype)))):
        return True
    return bool(torch.isfinite(tensor).all())


def below_normal(tensor: torch.Tensor) -> bool:
    """Whether every value of a floating tensor is zero or subnormal (below its dtype's
    smallest normal number): levels fitted to it round to zero, a change coded against
    it is all rounding error, and its exact bytes cost next to nothing.

    The first value settles it for almost every trained weight, so the whole tensor is
    read only when that one is zero or subnormal.
    """
    flat = tensor.detach().reshape(-1)
    tiny = torch.finfo(tensor.dtype).tiny
    if flat.numel() == 0 or not abs(float(flat[0])) < tiny:
        return False
    return bool(flat.abs().max() < tiny)


def checked_float_input(tensor: torch.Tensor, codec_id: str) -> torch.Tensor:
    """``tensor`` flattened and cast to its working dtype.

    Raises:
        ValueError: the tensor is not floating point or holds NaN / infinity.
    """
    if not tensor.dtype.is_floating_point:
        raise ValueError(f"{codec_id}: needs a floating tensor, got {tensor.dtype}")
    flat = tensor.detach().reshape(-1).to(working_dtype(tensor.dtype))
    if not all_finite(flat):
        raise ValueError(
            f"{codec_id}: the tensor holds NaN or infinite values, which cannot be quantized; "
            "store it with a lossless codec"
        )
    return flat


def require_float_spec(spec: TensorSpec, codec_id: str) -> torch.dtype:
    """The working dtype for decoding ``spec``; :class:`FormatError` if it is not floating."""
    if not spec.dtype.is_floating_point:
        raise FormatError(f"{codec_id}: cannot decode into a {spec.dtype} tensor")
    return working_dtype(spec.dtype)
