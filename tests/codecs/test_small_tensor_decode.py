"""The NumPy decode steps of small DynaQuant tensors: exactly what the torch steps give."""

from __future__ import annotations

import pytest
import torch

from inshrinkerator.codecs.bucket_delta import _SMALL_DECODE, decode_bucket_ids, encode_bucket_ids
from inshrinkerator.codecs.dynaquant import predicted_ids
from inshrinkerator.codecs.log_sketch import MANTISSA_BITS, SIGNED_KEYS
from inshrinkerator.codecs.nonuniform_quantizer import (
    LINEAR,
    LOG,
    reconstruct,
)
from inshrinkerator.codecs.small_tensor_decode import (
    SMALL_ELEMENTS,
    small_predicted_ids,
    small_reconstruction,
)

from .level_tables import random_level_tables


def _tables(domain: str, trials: int = 8) -> list:
    return random_level_tables(domain, trials, bins_step=40, seed=1)


@pytest.mark.parametrize("domain", [LINEAR, LOG])
@pytest.mark.parametrize("shift", [0, 1, -3, 64, -64])
def test_predicted_ids_of_every_key(domain: str, shift: int) -> None:
    # References whose float32 patterns hold every signed key (zeros, subnormals,
    # infinities and NaNs among them), with random low bits, in pieces below the size limit.
    generator = torch.Generator().manual_seed(2)
    every_key = torch.arange(SIGNED_KEYS, dtype=torch.int32)
    low_bits = torch.randint(0, 1 << (23 - MANTISSA_BITS), (SIGNED_KEYS,), dtype=torch.int32, generator=generator)
    patterns = ((every_key << (23 - MANTISSA_BITS)) | low_bits).view(torch.float32)
    chunk = SMALL_ELEMENTS - 1
    for table in _tables(domain):
        for start in range(0, SIGNED_KEYS, chunk):
            reference = patterns[start : start + chunk].clone().reshape(-1, 1)
            small = small_predicted_ids(table, reference, shift)
            expected = predicted_ids(table, reference, shift)
            assert small is not None and small.dtype == expected.dtype and torch.equal(small, expected)


def test_predicted_ids_leave_other_tensors_to_torch() -> None:
    table = _tables(LINEAR, 1)[0]
    assert small_predicted_ids(table, torch.zeros(SMALL_ELEMENTS)) is None
    assert small_predicted_ids(table, torch.zeros(10, dtype=torch.float64)) is None
    assert small_predicted_ids(table, torch.zeros(10, dtype=torch.bfloat16)) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("protected_dtype", [torch.bfloat16, torch.float16])
def test_reconstruction_is_that_of_torch(dtype: torch.dtype, protected_dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(3)
    for table in _tables(LINEAR, 4) + _tables(LOG, 4):
        ids = torch.randint(0, table.count, (3, 700), generator=generator).to(torch.uint8 if table.count <= 256 else torch.int16)
        positions = torch.nonzero(ids.reshape(-1) == table.protect_id).reshape(-1)
        protected = torch.randn(positions.numel(), generator=generator).to(protected_dtype)
        small = small_reconstruction(ids, table, protected, dtype, (3, 700), positions)
        expected = reconstruct(ids, table, protected, dtype, (3, 700), positions)
        assert small is not None and small.dtype == expected.dtype and small.shape == expected.shape
        assert torch.equal(small.view(torch.uint8), expected.view(torch.uint8))
    assert small_reconstruction(ids, table, protected, torch.bfloat16, (3, 700), positions) is None
    assert small_reconstruction(torch.zeros(SMALL_ELEMENTS, dtype=torch.uint8), table, protected[:0], dtype, (SMALL_ELEMENTS,), None) is None


@pytest.mark.parametrize("levels", [3, 17, 129, 300])
@pytest.mark.parametrize("rearrange", [False, True])
@pytest.mark.parametrize("count", [1, 40, 1_500, _SMALL_DECODE - 1, _SMALL_DECODE])
def test_short_direct_streams_round_trip(levels: int, rearrange: bool, count: int) -> None:
    # Direct streams (most ids move) against predictions, regrouped or not, on both sides of
    # the NumPy path's limit; short ones also go through the symmetric models.
    generator = torch.Generator().manual_seed(levels * count)
    dtype = torch.uint8 if levels <= 256 else torch.int16
    predicted = torch.randint(0, levels, (count,), generator=generator).to(dtype)
    moves = torch.randint(-2, 3, (count,), generator=generator)
    ids = ((predicted.long() + moves) % levels).to(dtype)
    stream = encode_bucket_ids(ids, levels, predicted, rearrange)
    decoded = decode_bucket_ids(stream, levels, count, predicted)
    assert decoded.dtype == dtype and torch.equal(decoded, ids)
