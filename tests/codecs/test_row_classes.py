"""Row classes: a matrix's ids coded in one stream per class of rows (DynaQuant flag 8)."""

from __future__ import annotations

import pytest
import torch

from inshrinkerator.codecs import DynaQuantCodec, DynaQuantDeltaCodec, TensorSpec, dynaquant
from inshrinkerator.codecs.bucket_delta import EntropyStats, encode_bucket_ids
from inshrinkerator.codecs.octave_groups import GROUP_MIN_ELEMENTS
from inshrinkerator.codecs.row_classes import (
    ROW_CLASS_MIN_ELEMENTS,
    RowGroups,
    choose_row_classes,
    read_row_classes,
)
from inshrinkerator.codecs.varint import encode_varint
from inshrinkerator.errors import CorruptCheckpointError, FormatError

from .lossy_codec_checks import check_damaged_streams, same_bits

_ROWS_FLAG = 8


def _row_octaves(rows: int = 64, cols: int = 128, seed: int = 0) -> torch.Tensor:
    # A second moment whose rows (units) sit up to 12 octaves apart, each spread over about one.
    generator = torch.Generator().manual_seed(seed)
    octave = torch.randint(0, 13, (rows, 1), generator=generator).double()
    return torch.exp2(octave + torch.randn((rows, cols), generator=generator, dtype=torch.float64) * 0.5 - 24).float()


def _flags(encoded) -> int:
    return bytes(encoded.streams[0])[1]


def _decode(codec, encoded, tensor, reference=None) -> torch.Tensor:
    return codec.decode(encoded.streams, encoded.params, TensorSpec.of(tensor), reference)


def test_rows_octaves_apart_are_coded_per_class_smaller_and_decode_the_same(monkeypatch) -> None:
    tensor = _row_octaves()
    codec = DynaQuantCodec(bins=8, domain="log")
    encoded = codec.encode(tensor)
    assert _flags(encoded) & _ROWS_FLAG
    assert same_bits(_decode(codec, encoded, tensor), encoded.reconstruction)
    # The same levels and ids coded whole: the same reconstruction, a larger stream.
    monkeypatch.setattr(dynaquant, "choose_row_classes", lambda *args: None)
    whole = DynaQuantCodec(bins=8, domain="log").encode(tensor)
    assert not _flags(whole) & _ROWS_FLAG
    assert same_bits(whole.reconstruction, encoded.reconstruction)
    assert len(bytes(whole.streams[0])) > 1.3 * len(bytes(encoded.streams[0]))


def test_rows_alike_keep_the_whole_coding() -> None:
    tensor = torch.randn((64, 128), generator=torch.Generator().manual_seed(1)) * 0.05
    ids = torch.randint(0, 9, (64 * 128,), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    assert choose_row_classes(ids, 9, 64) is None
    assert not _flags(DynaQuantCodec(bins=8).encode(tensor)) & _ROWS_FLAG


def test_only_whole_matrices_without_a_reference_use_row_classes() -> None:
    tensor = _row_octaves()
    # A vector (the same values, flat) and a matrix below the size considered.
    assert not _flags(DynaQuantCodec(bins=8, domain="log").encode(tensor.reshape(-1))) & _ROWS_FLAG
    small = tensor[: ROW_CLASS_MIN_ELEMENTS // 128 - 1]
    assert not _flags(DynaQuantCodec(bins=8, domain="log").encode(small)) & _ROWS_FLAG
    # A delta codes its ids against the reference's: never per class of rows, and a delta
    # stream that claims row classes is refused.
    reference = DynaQuantCodec(bins=8, domain="log").encode(tensor).reconstruction
    codec = DynaQuantDeltaCodec(bins=8, domain="log")
    delta = codec.encode((tensor * 1.3).contiguous(), reference)
    stream = bytearray(bytes(delta.streams[0]))
    assert not stream[1] & _ROWS_FLAG
    stream[1] |= _ROWS_FLAG
    with pytest.raises(FormatError):
        codec.decode([bytes(stream)], delta.params, TensorSpec.of(tensor), reference)


def test_entropy_figures_count_only_the_coding_stored(monkeypatch) -> None:
    tensor = _row_octaves()
    stats = EntropyStats()
    DynaQuantCodec(bins=8, domain="log").with_hints(stats=stats).encode(tensor)
    # Every id once, and each row's class (the side stream).
    assert stats.symbols == tensor.numel() + tensor.shape[0]
    monkeypatch.setattr(dynaquant, "choose_row_classes", lambda *args: None)
    whole = EntropyStats()
    DynaQuantCodec(bins=8, domain="log").with_hints(stats=whole).encode(tensor)
    assert whole.symbols == tensor.numel()


def test_chosen_classes_are_dense_and_each_holds_enough_ids() -> None:
    tensor = _row_octaves(rows=96, cols=64, seed=3)
    codec = DynaQuantCodec(bins=8, domain="log")
    codec.encode(tensor)
    ids = codec.fitted_table.ids(dynaquant._signed_keys(tensor.reshape(-1)))
    classes = choose_row_classes(ids, codec.fitted_table.count, 96)
    assert classes is not None and classes.dtype == torch.uint8 and classes.numel() == 96
    counts = torch.bincount(classes.long())
    assert counts.numel() >= 2 and bool((counts * 64 >= GROUP_MIN_ELEMENTS).all())
    # Too few ids: not considered.
    assert choose_row_classes(ids[: ROW_CLASS_MIN_ELEMENTS - 64], codec.fitted_table.count, 63) is None


def test_row_groups_gather_and_scatter_are_inverse() -> None:
    generator = torch.Generator().manual_seed(4)
    classes = torch.randint(0, 3, (10,), generator=generator, dtype=torch.uint8)
    classes[:3] = torch.tensor([0, 1, 2], dtype=torch.uint8)
    groups = RowGroups(classes, 3, 7)
    values = torch.randn(70, generator=generator)
    grouped = groups.gather(values)
    assert groups.sizes == [7 * int((classes == c).sum()) for c in range(3)]
    assert torch.equal(grouped, values[groups.order()])
    # Within a group, rows keep their order.
    first = [row for row in range(10) if classes[row] == 0]
    assert torch.equal(grouped[: 7 * len(first)], values.reshape(10, 7)[first].reshape(-1))
    assert torch.equal(groups.scatter(grouped, torch.empty(70)), values)


def test_damaged_row_class_streams_are_refused() -> None:
    tensor = _row_octaves()
    codec = DynaQuantCodec(bins=8, domain="log", protect=0.01)
    check_damaged_streams(codec, tensor)
    encoded = codec.encode(tensor)
    assert _flags(encoded) & _ROWS_FLAG
    # The same stream read as a vector: row classes need a matrix.
    with pytest.raises(FormatError):
        codec.decode(encoded.streams, encoded.params, TensorSpec(torch.float32, (tensor.numel(),)))


@pytest.mark.parametrize(
    "classes, count",
    [
        (torch.zeros(64, dtype=torch.uint8), 2),  # class 1 holds no rows
        (torch.zeros(64, dtype=torch.uint8), 1),  # one class
        (torch.zeros(64, dtype=torch.uint8), 256),  # more classes than a row can name
    ],
)
def test_bad_row_class_headers_are_refused(classes: torch.Tensor, count: int) -> None:
    coded = encode_bucket_ids(classes, max(count, 2))
    side = memoryview(encode_varint(count) + encode_varint(len(coded)) + coded)
    with pytest.raises(CorruptCheckpointError):
        read_row_classes(side, 0, (64, 128), "dynaquant")
    with pytest.raises(CorruptCheckpointError):  # cut short
        read_row_classes(side[: len(side) - 2], 0, (64, 128), "dynaquant")


def test_row_counts_taken_a_block_of_rows_at_a_time_choose_the_same_classes(monkeypatch) -> None:
    from inshrinkerator.codecs import row_classes

    tensor = _row_octaves(rows=80, cols=96, seed=5)
    codec = DynaQuantCodec(bins=8, domain="log")
    codec.encode(tensor)
    ids = codec.fitted_table.ids(dynaquant._signed_keys(tensor.reshape(-1)))
    whole = choose_row_classes(ids, codec.fitted_table.count, 80)
    monkeypatch.setattr(row_classes, "_HISTOGRAM_BLOCK", 3 * 96 + 5)  # blocks of 3 rows, the last of 2
    blocks = choose_row_classes(ids, codec.fitted_table.count, 80)
    assert whole is not None and torch.equal(whole, blocks)


def test_row_classes_beyond_the_stated_count_are_refused() -> None:
    classes = torch.tensor([0, 1, 2, 3] * 16, dtype=torch.uint8)
    coded = encode_bucket_ids(classes, 4)
    side = memoryview(encode_varint(2) + encode_varint(len(coded)) + coded)
    with pytest.raises(FormatError):
        read_row_classes(side, 0, (64, 128), "dynaquant")
