"""The per-element steps of a DynaQuant decode for small tensors, in NumPy.

A delta-coded bias or layer norm of a few hundred elements costs a DynaQuant decode about
60 small torch operations (its predicted ids key by key, the reconstruction), each ~3-8 us
of dispatch on this CPU whatever its size: a char GPT's 10-deep chain decodes ~300 such
tensors at ~360 us each. NumPy's calls cost a fraction of that on arrays this small. The
functions here return exactly what their torch counterparts return (the same integer
arithmetic, the same IEEE comparisons and gathers; tests compare them on every key and on
random tables), or None where they do not apply (another dtype or device, or a larger
tensor), and the caller then takes the torch path.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .log_sketch import MAGNITUDE_KEYS, MANTISSA_BITS, SIGNED_KEYS
from .nonuniform_quantizer import (
    DIRECT_IDS_FRACTION,
    FIRST_NON_FINITE_KEY,
    LOG,
    LevelTable,
    _magnitude_centres,
)

__all__ = ["SMALL_ELEMENTS", "small_predicted_ids", "small_reconstruction"]

#: Tensors of fewer elements take these paths: those whose ids :meth:`LevelTable.ids`
#: finds key by key rather than from the whole key table.
SMALL_ELEMENTS = SIGNED_KEYS // DIRECT_IDS_FRACTION


def _numpy_ids_dtype(table: LevelTable) -> np.dtype:
    return np.dtype(np.uint8) if table.count <= 256 else np.dtype(np.int16)


def _ids_of_keys(table: LevelTable, keys: np.ndarray) -> np.ndarray:
    """:meth:`LevelTable.ids` of int64 signed ``keys`` (its key-by-key path)."""
    positive = _magnitude_centres(torch.device("cpu")).numpy()
    magnitude = keys & (MAGNITUDE_KEYS - 1)
    negative = keys >= MAGNITUDE_KEYS
    centres = positive[magnitude]
    # searchsorted(right=False) in torch is NumPy's side="left": the first boundary >= x.
    nearest = np.searchsorted(table.boundaries().numpy(), np.where(negative, -centres, centres), side="left")
    ids = nearest + (nearest >= table.zero_index)
    protect = magnitude > min(table.protect_above, FIRST_NON_FINITE_KEY - 1)
    if table.domain == LOG:
        protect |= negative & (magnitude > 0)
    ids = np.where(magnitude < max(table.prune_below, 1), table.zero_index, ids)
    ids = np.where(protect, table.protect_id, ids)
    return ids.astype(_numpy_ids_dtype(table))


def _shifted_keys(keys: np.ndarray, shift: int) -> np.ndarray:
    """:func:`.prediction_shift.shift_keys` of int64 ``keys`` by a non-zero ``shift``."""
    magnitude = keys & (MAGNITUDE_KEYS - 1)
    sign = keys - magnitude
    movable = (magnitude > 0) & (magnitude < FIRST_NON_FINITE_KEY)
    moved = np.clip(magnitude + shift, 1, FIRST_NON_FINITE_KEY - 1)
    return np.where(movable, sign + moved, keys)


def small_predicted_ids(table: LevelTable, reference: torch.Tensor, shift: int = 0) -> Optional[torch.Tensor]:
    """:func:`.dynaquant.predicted_ids` of a small non-empty float32 CPU ``reference``, else None."""
    flat = reference.detach().reshape(-1)
    if flat.dtype != torch.float32 or flat.device.type != "cpu" or not 0 < flat.numel() < SMALL_ELEMENTS:
        return None
    # The signed sketch keys: the top bits of the float32 pattern (an arithmetic shift, then
    # the mask, as torch's bitwise_right_shift and bitwise_and do).
    keys = (flat.contiguous().numpy().view(np.int32) >> (23 - MANTISSA_BITS)) & (SIGNED_KEYS - 1)
    keys = keys.astype(np.int64)
    if shift:
        keys = _shifted_keys(keys, shift)
    return torch.from_numpy(_ids_of_keys(table, keys))


def small_reconstruction(
    ids: torch.Tensor,
    table: LevelTable,
    protected_values: torch.Tensor,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    protected_positions: Optional[torch.Tensor],
) -> Optional[torch.Tensor]:
    """:func:`.nonuniform_quantizer.reconstruct` of a few CPU ids (at least one) into float32 or float64
    (level values by id, protected elements from ``protected_values`` at
    ``protected_positions``, which are given whenever there are protected values), else None."""
    if dtype not in (torch.float32, torch.float64) or ids.device.type != "cpu" or not 0 < ids.numel() < SMALL_ELEMENTS:
        return None  # (an empty array from NumPy would come back with a stride of 0)
    if protected_values.numel() and protected_positions is None:
        return None
    levels = table.values.numpy()
    values = np.zeros(levels.size + 1, dtype=np.float32)  # the protect id's slot: 0 until filled
    values[:-1] = levels
    out = values.astype(np.float64) if dtype == torch.float64 else values
    out = out[ids.reshape(-1).numpy()]
    if protected_values.numel():
        out[protected_positions.numpy()] = protected_values.to(dtype).numpy()
    return torch.from_numpy(out).reshape(shape)
