"""FactoredMomentCodec: Adafactor's row/column estimate of a second moment."""

from __future__ import annotations

import pytest
import torch

from inshrinkerator.codecs import FactoredMomentCodec, TensorSpec
from inshrinkerator.errors import FormatError

from .lossy_codec_checks import check_damaged_streams, encode_decode


def test_rank_one_tensors_come_back_exactly_and_sizes_are_tiny() -> None:
    rows, columns = torch.rand(64) + 0.1, torch.rand(48) + 0.1
    tensor = torch.outer(rows, columns)
    decoded = encode_decode(FactoredMomentCodec(), tensor)
    assert torch.allclose(decoded, tensor, rtol=1e-5)
    assert len(FactoredMomentCodec().encode(tensor).streams[0]) == 8 + 4 * (64 + 48)


def test_estimate_is_positive_and_keeps_row_and_column_means() -> None:
    tensor = torch.exp2(torch.randn(16, 4, 3, 3) * 3 - 20)
    tensor[3] = 0.0
    decoded = encode_decode(FactoredMomentCodec(), tensor)
    assert torch.all(decoded[3] == 0) and torch.all(decoded[torch.arange(16) != 3] > 0)
    matrix, estimate = tensor.reshape(16, -1).double(), decoded.reshape(16, -1).double()
    assert torch.allclose(estimate.mean(1), matrix.mean(1), rtol=1e-4)
    assert torch.allclose(estimate.mean(0), matrix.mean(0), rtol=1e-4)


def test_what_it_cannot_store_is_refused() -> None:
    codec = FactoredMomentCodec()
    for tensor in (torch.ones(5), torch.ones(1, 7), -torch.ones(3, 3), torch.full((3, 3), float("inf"))):
        with pytest.raises(ValueError):
            codec.encode(tensor)
    encoded = codec.encode(torch.ones(4, 5))
    with pytest.raises(FormatError):
        codec.decode(encoded.streams, {}, TensorSpec(torch.float32, (5, 4)))
    check_damaged_streams(codec, torch.rand(6, 7))
