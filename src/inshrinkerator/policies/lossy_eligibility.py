"""Which tensors a lossy baseline policy may quantize, and which references it may code against.

A lossy codec only sees floating tensors with finite values that are big enough
for quantization to pay: everything else (integers, bools, step counters, RNG
states, tiny tensors, tensors holding NaN or infinity) is stored exactly. A
reference is usable for a delta only when it has the tensor's dtype and shape
and finite values.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..codecs.lossy_input import all_finite
from .state_layout import TensorRole

__all__ = ["quantizable", "usable_reference", "lossy_roles", "check_common_knobs", "OPTIMIZER_MOMENT_ROLES"]

#: Optimizer tensors a policy may quantize when asked to include optimizer state.
OPTIMIZER_MOMENT_ROLES = (TensorRole.FIRST_MOMENT, TensorRole.SECOND_MOMENT, TensorRole.MOMENTUM_BUFFER)


def lossy_roles(include_optimizer_state: bool) -> tuple[TensorRole, ...]:
    """The roles a weights-first baseline quantizes: weights, plus the moments if asked."""
    return (TensorRole.WEIGHT, *(OPTIMIZER_MOMENT_ROLES if include_optimizer_state else ()))


def check_common_knobs(min_numel: Any, include_optimizer_state: Any) -> None:
    """``ValueError`` unless ``min_numel`` is a positive int and the flag a bool."""
    if not isinstance(min_numel, int) or isinstance(min_numel, bool) or min_numel < 1:
        raise ValueError(f"min_numel must be a positive int, got {min_numel!r}")
    if not isinstance(include_optimizer_state, bool):
        raise ValueError(f"include_optimizer_state must be a bool, got {include_optimizer_state!r}")


def _finite(tensor: torch.Tensor) -> bool:
    return all_finite(tensor)


def quantizable(tensor: torch.Tensor, min_numel: int) -> bool:
    """True for a floating tensor of at least ``min_numel`` finite values."""
    return tensor.dtype.is_floating_point and tensor.numel() >= max(min_numel, 1) and _finite(tensor)


def usable_reference(tensor: torch.Tensor, reference: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``reference`` when a delta against it is possible, else ``None``."""
    if (
        reference is None
        or reference.dtype != tensor.dtype
        or reference.shape != tensor.shape
        or not _finite(reference)
    ):
        return None
    return reference
