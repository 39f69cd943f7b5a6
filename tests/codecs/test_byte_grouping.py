"""ByteGroupingCodec: exact round trips for every dtype and layout, its format, its errors."""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inshrinkerator.codecs import ByteGroupingCodec, TensorSpec, dtype_from_name, get_codec
from inshrinkerator.errors import CorruptCheckpointError, FormatError

from ..helpers import ALL_DTYPES, assert_same, check_codec_roundtrip, make_tensor

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "codecs"
SHAPES = [(), (0,), (3, 0), (1,), (7,), (33, 65), (4, 3, 1000)]
# Small chunks, so modest tensors already span several chunks and a partial one.
SMALL_CHUNKS = ByteGroupingCodec(chunk_bytes=4096)


def _bits(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _encode(codec: ByteGroupingCodec, tensor: torch.Tensor) -> tuple[bytes, dict, TensorSpec]:
    encoded = codec.encode(tensor)
    return bytes(memoryview(encoded.streams[0]).cast("B")), encoded.params, TensorSpec.of(tensor)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("codec", [ByteGroupingCodec(), SMALL_CHUNKS], ids=["default", "small-chunks"])
def test_round_trip_is_exact_for_every_dtype_and_shape(dtype, shape, codec):
    tensor = make_tensor(dtype, shape, seed=len(shape))
    assert_same(check_codec_roundtrip(codec, tensor), tensor)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.uint16, torch.uint32, torch.uint64])
def test_round_trip_of_the_other_file_dtypes(dtype):
    if dtype.is_complex:
        tensor = torch.randn(2000, dtype=dtype)
    else:
        tensor = torch.randint(0, 30000, (2000,)).to(dtype)
    assert_same(check_codec_roundtrip(SMALL_CHUNKS, tensor), tensor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32])
def test_views_and_non_contiguous_tensors_decode_to_their_values(dtype):
    base = make_tensor(dtype, (64, 90), seed=3)
    views = {
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "column": base[:, 5],
        "expanded": base[0].expand(5, 90),
        "offset slice": base[10:20],
        "permuted 3-d": base.reshape(8, 8, 90).permute(2, 0, 1),
    }
    for name, view in views.items():
        decoded = check_codec_roundtrip(SMALL_CHUNKS, view)
        assert decoded.is_contiguous(), name
        assert_same(decoded, view.contiguous(), name)


def test_encoding_leaves_its_input_untouched_and_gradients_alone():
    for dtype in ALL_DTYPES:
        tensor = make_tensor(dtype, (3000,), seed=4)
        before = _bits(tensor)
        SMALL_CHUNKS.encode(tensor)
        assert _bits(tensor) == before, dtype
    weight = torch.randn(100, requires_grad=True)
    assert_same(check_codec_roundtrip(SMALL_CHUNKS, weight), weight.detach())


def test_conjugate_and_negative_views_are_resolved():
    z = torch.randn(300, dtype=torch.complex64)
    assert_same(check_codec_roundtrip(SMALL_CHUNKS, z.conj()), z.conj().resolve_conj())


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    data=st.binary(min_size=0, max_size=6000),
    chunk_bytes=st.sampled_from([4096, 8192, 1 << 20]),
    level=st.sampled_from([None, None, 1, -1]),
)
def test_any_bit_pattern_round_trips(dtype, data, chunk_bytes, level):
    """Arbitrary bytes (NaN payloads, infinities, denormals, any integer) come back bit for bit."""
    usable = len(data) - len(data) % dtype.itemsize
    if dtype == torch.bool:
        raw = torch.tensor(list(data[:usable]), dtype=torch.uint8) % 2
        tensor = raw.to(torch.bool)
    else:
        tensor = torch.frombuffer(bytearray(data[:usable]), dtype=torch.uint8).view(dtype) if usable else torch.empty(0, dtype=dtype)
    codec = ByteGroupingCodec(level=level, chunk_bytes=chunk_bytes)
    decoded = check_codec_roundtrip(codec, tensor)
    assert _bits(decoded) == _bits(tensor)


@settings(max_examples=25, deadline=None)
@given(
    scale=st.floats(min_value=1e-30, max_value=1e30),
    zero_fraction=st.floats(min_value=0.0, max_value=0.9),
    count=st.integers(min_value=1, max_value=40000),
)
def test_weight_like_data_with_zero_runs_round_trips(scale, zero_fraction, count):
    generator = torch.Generator().manual_seed(count)
    tensor = torch.randn(count, generator=generator) * scale
    tensor[: int(count * zero_fraction)] = 0.0  # a run of zeros, as dead units leave
    decoded = check_codec_roundtrip(SMALL_CHUNKS, tensor)
    assert _bits(decoded) == _bits(tensor)


def test_it_compresses_what_is_compressible_and_never_expands_much():
    weights = torch.randn(200_000) * 0.02
    stored, _, _ = _encode(ByteGroupingCodec(), weights)
    assert len(stored) < weights.numel() * 4 / 1.15  # exponents code to ~1/3 of their bytes

    zeros = torch.zeros(100_000, dtype=torch.int64)
    stored, _, _ = _encode(ByteGroupingCodec(), zeros)
    assert len(stored) < zeros.numel() * 8 / 500

    noise = torch.randint(0, 256, (300_000,), dtype=torch.uint8)
    stored, _, _ = _encode(ByteGroupingCodec(), noise)
    assert len(stored) <= noise.numel() + 64  # raw pieces plus a small index


def test_chunks_hold_at_most_chunk_bytes_and_mid_sized_tensors_feed_every_worker(monkeypatch):
    import inshrinkerator.codecs.byte_grouping as module

    monkeypatch.setattr(module, "worker_count", lambda: 4)
    codec = ByteGroupingCodec()
    assert codec._chunk_elements(10, 4) == 10  # small: one chunk
    big = codec._chunk_elements(10_000_000, 4)
    assert big <= codec.chunk_bytes // 4 and -(-10_000_000 // big) == -(-40_000_000 // codec.chunk_bytes)
    assert -(-150_000 // codec._chunk_elements(150_000, 4)) == 2  # 600 KB: two workers' worth
    assert -(-300_000 // codec._chunk_elements(300_000, 4)) == 4


def test_config_validation_and_registry_round_trip():
    codec = ByteGroupingCodec(level=5, chunk_bytes=8192)
    config = json.loads(json.dumps(codec.get_config()))
    assert config == {"id": "byte_grouping", "level": 5, "chunk_bytes": 8192}
    assert get_codec(config) == codec
    for bad in [{"level": 99}, {"level": "1"}, {"level": True}, {"chunk_bytes": 100}, {"chunk_bytes": 2.5}]:
        with pytest.raises(ValueError):
            ByteGroupingCodec(**bad)
        with pytest.raises(FormatError):
            get_codec({"id": "byte_grouping", **bad})


# --- decoding what it should refuse ------------------------------------------------------


@pytest.fixture(scope="module")
def sample() -> tuple[bytes, dict, TensorSpec, torch.Tensor]:
    tensor = make_tensor(torch.float32, (3000,), seed=9)
    stream, params, spec = _encode(SMALL_CHUNKS, tensor)
    return stream, params, spec, tensor


def _decode(stream: bytes, params: dict, spec: TensorSpec) -> torch.Tensor:
    return SMALL_CHUNKS.decode([stream], params, spec)


@pytest.mark.parametrize(
    "params",
    [{}, {"chunk": 0}, {"chunk": -5}, {"chunk": "768"}, {"chunk": True}, {"chunk": 1 << 40}, {"chunk": 1.5}],
    ids=str,
)
def test_params_that_do_not_fit_are_a_format_error(sample, params):
    stream, _, spec, _ = sample
    with pytest.raises(FormatError) as info:
        _decode(stream, params, spec)
    assert not isinstance(info.value, CorruptCheckpointError)


def test_a_stream_for_another_spec_or_stream_count_is_refused(sample):
    stream, params, spec, _ = sample
    with pytest.raises(FormatError):
        _decode(stream, params, TensorSpec(torch.float32, (6000,)))
    with pytest.raises(FormatError):
        _decode(stream, params, TensorSpec(torch.float64, (3000,)))
    with pytest.raises(FormatError):
        SMALL_CHUNKS.decode([stream, stream], params, spec)
    with pytest.raises(FormatError):
        SMALL_CHUNKS.decode([], params, spec)


def test_every_truncation_is_a_corrupt_checkpoint_error(sample):
    stream, params, spec, _ = sample
    for cut in sorted(set(range(0, 64)) | set(range(64, len(stream), 97))):
        with pytest.raises(CorruptCheckpointError):
            _decode(stream[:cut], params, spec)
    with pytest.raises(CorruptCheckpointError):
        _decode(stream + b"\0", params, spec)


def test_a_damaged_index_is_a_corrupt_checkpoint_error(sample):
    stream, params, spec, _ = sample
    count = struct.unpack_from("<I", stream)[0]
    head = 4 + 5 * count
    for position in range(head):  # the piece count, a mode, or a size that no longer adds up
        damaged = bytearray(stream)
        damaged[position] ^= 0x5A
        with pytest.raises(CorruptCheckpointError):
            _decode(bytes(damaged), params, spec)


def test_damaged_payload_bytes_never_crash(sample):
    """The container's checksums catch payload damage; the codec must still fail cleanly."""
    stream, params, spec, _ = sample
    rng = np.random.default_rng(0)
    for position in rng.integers(0, len(stream), 150):
        damaged = bytearray(stream)
        damaged[position] ^= 1 << int(rng.integers(0, 8))
        try:
            tensor = _decode(bytes(damaged), params, spec)
        except CorruptCheckpointError:
            continue
        assert tensor.dtype == spec.dtype and tuple(tensor.shape) == spec.shape


def test_a_zstd_piece_claiming_a_huge_size_is_refused_before_allocating(sample):
    stream, params, spec, _ = sample
    count = struct.unpack_from("<I", stream)[0]
    modes = stream[4 : 4 + count]
    sizes = struct.unpack_from(f"<{count}I", stream, 4 + count)
    index = modes.index(1)
    start = 4 + 5 * count + sum(sizes[:index])
    frame = stream[start : start + sizes[index]]
    # a frame header with an 8-byte content size field claiming 2**60 bytes
    forged = b"\x28\xb5\x2f\xfd" + bytes([0xC0]) + (1 << 60).to_bytes(8, "little") + frame[6:]
    pieces = [stream[4 + 5 * count + sum(sizes[:i]) : 4 + 5 * count + sum(sizes[: i + 1])] for i in range(count)]
    pieces[index] = forged
    new_sizes = [len(p) for p in pieces]
    rebuilt = stream[:4] + modes + struct.pack(f"<{count}I", *new_sizes) + b"".join(pieces)
    with pytest.raises(CorruptCheckpointError, match="claims"):
        _decode(rebuilt, params, spec)


def test_unknown_piece_modes_and_bad_bool_bytes_are_refused():
    tensor = torch.ones(5000, dtype=torch.bool)
    stream, params, spec = _encode(SMALL_CHUNKS, tensor)
    damaged = bytearray(stream)
    damaged[4] = 7
    with pytest.raises(CorruptCheckpointError, match="mode"):
        _decode(bytes(damaged), params, spec)
    raw_twos = torch.full((5000,), 2, dtype=torch.uint8)
    stream, params, _ = _encode(ByteGroupingCodec(), raw_twos)
    with pytest.raises(CorruptCheckpointError, match="bool"):
        ByteGroupingCodec().decode([stream], params, TensorSpec(torch.bool, (5000,)))


# --- the format is pinned by golden files ------------------------------------------------


def _golden_files() -> list[Path]:
    return sorted((GOLDEN / "byte_grouping").glob("*.json"))


def test_golden_files_exist():
    assert len(_golden_files()) >= 12


@pytest.mark.parametrize("path", _golden_files(), ids=lambda p: p.stem)
def test_golden_encodings_still_decode(path):
    doc = json.loads(path.read_text())
    spec = TensorSpec(dtype_from_name(doc["dtype"]), tuple(doc["shape"]))
    codec = get_codec(doc["codec"])
    decoded = codec.decode([base64.b64decode(s) for s in doc["streams"]], doc["params"], spec)
    assert decoded.dtype == spec.dtype and tuple(decoded.shape) == spec.shape
    assert _bits(decoded) == base64.b64decode(doc["expected"])


def _pieces(stream: bytes) -> tuple[list[int], list[bytes]]:
    count = struct.unpack_from("<I", stream)[0]
    modes = list(stream[4 : 4 + count])
    sizes = struct.unpack_from(f"<{count}I", stream, 4 + count)
    offsets = np.cumsum([4 + 5 * count, *sizes]).tolist()
    return modes, [stream[offsets[i] : offsets[i + 1]] for i in range(count)]


def _stream(modes: list[int], pieces: list[bytes]) -> bytes:
    return struct.pack("<I", len(modes)) + bytes(modes) + struct.pack(f"<{len(modes)}I", *map(len, pieces)) + b"".join(pieces)


def test_near_random_mantissa_planes_travel_as_raw_pairs():
    for dtype, pairs_per_chunk in ((torch.float32, 1), (torch.float64, 3)):
        tensor = torch.randn(5000, dtype=dtype)
        stream, params, spec = _encode(SMALL_CHUNKS, tensor)
        modes, _ = _pieces(stream)
        assert modes.count(2) == modes.count(3) == pairs_per_chunk * -(-5000 // params["chunk"])
        assert _bits(_decode(stream, params, spec)) == _bits(tensor)


@pytest.mark.parametrize(
    "damage",
    ["mate-not-paired", "paired-without-pair", "pair-on-exponent", "pair-wrong-size", "mate-not-empty"],
)
def test_malformed_plane_pairs_are_corruption(damage):
    tensor = torch.randn(2048)
    stream, params, spec = _encode(SMALL_CHUNKS, tensor)
    modes, pieces = _pieces(stream)
    assert modes[:4] == [2, 3, 0, 1]
    if damage == "mate-not-paired":
        modes[1] = 0
    elif damage == "paired-without-pair":
        modes[0] = 0
    elif damage == "pair-on-exponent":
        modes[2], modes[3], pieces[2], pieces[3] = 2, 3, pieces[0], b""
    elif damage == "pair-wrong-size":
        pieces[0] = pieces[0][:-2]
    elif damage == "mate-not-empty":
        pieces[1] = b"\0\0"
    with pytest.raises(CorruptCheckpointError):
        _decode(_stream(modes, pieces), params, spec)


# --- tensors larger than a slice: one stream per slice ----------------------------------

# 8 KiB slices: a few thousand elements already span several slices (and chunks per slice).
SLICED = ByteGroupingCodec(chunk_bytes=4096, slice_bytes=8192)


@pytest.mark.parametrize("dtype", [*ALL_DTYPES, torch.complex64, torch.complex128], ids=str)
def test_tensors_larger_than_a_slice_round_trip_with_one_stream_per_slice(dtype):
    tensor = make_tensor(dtype, (45, 401), seed=11) if not dtype.is_complex else torch.randn(45, 401, dtype=dtype)
    encoded = SLICED.encode(tensor)
    lanes = tensor.numel() * (2 if dtype.is_complex else 1)
    assert set(encoded.params) == {"chunk", "slice"}
    assert len(encoded.streams) == -(-lanes // encoded.params["slice"]) > 1
    assert encoded.params["slice"] % encoded.params["chunk"] == 0
    assert_same(check_codec_roundtrip(SLICED, tensor), tensor)


def test_sliced_views_and_non_contiguous_tensors_round_trip():
    base = make_tensor(torch.float32, (180, 120), seed=12)
    for view in (base.t(), base[::2, 1::3], base[5:80], torch.randn(60, 70, dtype=torch.complex64).conj()):
        assert len(SLICED.encode(view).streams) > 1
        assert_same(check_codec_roundtrip(SLICED, view), view.resolve_conj().contiguous())


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(ALL_DTYPES),
    data=st.binary(min_size=0, max_size=30000),
    slice_bytes=st.sampled_from([1, 4096, 8192, 12288]),
)
def test_any_bit_pattern_round_trips_in_slices(dtype, data, slice_bytes):
    usable = len(data) - len(data) % dtype.itemsize
    if dtype == torch.bool:
        tensor = (torch.tensor(list(data[:usable]), dtype=torch.uint8) % 2).to(torch.bool)
    else:
        tensor = torch.frombuffer(bytearray(data[:usable]), dtype=torch.uint8).view(dtype) if usable else torch.empty(0, dtype=dtype)
    codec = ByteGroupingCodec(chunk_bytes=4096, slice_bytes=slice_bytes)
    assert _bits(check_codec_roundtrip(codec, tensor)) == _bits(tensor)


def test_slices_hold_the_same_pieces_as_one_stream():
    """Slicing changes where pieces are indexed, not how they are coded: same compression."""
    tensor = torch.randn(40_000) * 0.02
    whole = ByteGroupingCodec(chunk_bytes=4096, slice_bytes=1 << 30).encode(tensor)
    sliced = ByteGroupingCodec(chunk_bytes=4096, slice_bytes=16384).encode(tensor)
    assert whole.params == {"chunk": sliced.params["chunk"]} and len(whole.streams) == 1
    whole_modes, whole_pieces = _pieces(bytes(whole.streams[0]))
    modes, pieces = [], []
    for stream in sliced.streams:
        stream_modes, stream_pieces = _pieces(bytes(stream))
        modes += stream_modes
        pieces += stream_pieces
    assert (modes, pieces) == (whole_modes, whole_pieces)
    extra = sum(len(bytes(s)) for s in sliced.streams) - len(bytes(whole.streams[0]))
    assert extra == 4 * (len(sliced.streams) - 1)  # one more piece count per stream


def test_lazy_streams_are_encoded_one_at_a_time_and_match_the_eager_ones(monkeypatch):
    import inshrinkerator.codecs.byte_grouping as module

    tensor = torch.randn(30_000)
    eager = SLICED.encode(tensor)
    lazy = SLICED.encode_lazily(tensor)
    assert isinstance(lazy.streams, module.SliceStreams) and lazy.params == eager.params
    made = []
    original = module._encode_rows
    monkeypatch.setattr(module, "_encode_rows", lambda rows, *rest: made.append(rows.shape[0]) or original(rows, *rest))
    for index, stream in enumerate(lazy.streams):
        assert len(made) == index + 1  # nothing is encoded ahead of the consumer
        assert bytes(stream) == bytes(eager.streams[index])
    assert sum(made) == tensor.numel() and len(lazy.streams) == len(eager.streams)
    assert bytes(lazy.streams[-1]) == bytes(eager.streams[-1])
    assert [bytes(s) for s in lazy.streams[1:3]] == [bytes(s) for s in eager.streams[1:3]]
    small = torch.randn(100)
    assert isinstance(SLICED.encode_lazily(small).streams, list)  # within one slice: eager


def test_slice_bytes_is_not_part_of_the_config():
    assert SLICED.get_config() == ByteGroupingCodec(chunk_bytes=4096).get_config()
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError):
            ByteGroupingCodec(slice_bytes=bad)


@pytest.fixture(scope="module")
def sliced_sample() -> tuple[list[bytes], dict, TensorSpec]:
    tensor = make_tensor(torch.float32, (5000,), seed=13)
    encoded = SLICED.encode(tensor)
    return [bytes(s) for s in encoded.streams], encoded.params, TensorSpec.of(tensor)


@pytest.mark.parametrize("bad", [0, -1, "2000", True, 1.5, None, 1 << 63], ids=repr)
def test_a_bad_slice_param_is_a_format_error(sliced_sample, bad):
    streams, params, spec = sliced_sample
    with pytest.raises(FormatError) as info:
        SLICED.decode(streams, {**params, "slice": bad}, spec)
    assert not isinstance(info.value, CorruptCheckpointError)


def test_sliced_streams_that_do_not_fit_are_refused(sliced_sample):
    streams, params, spec = sliced_sample
    assert len(streams) == 3
    for wrong in (streams[:-1], streams + streams[:1], [], [b"".join(streams)]):
        with pytest.raises(FormatError):
            SLICED.decode(wrong, params, spec)
    with pytest.raises(FormatError):  # a hostile slice of one element: refused at once
        SLICED.decode(streams, {**params, "slice": 1}, TensorSpec(torch.float32, (1 << 40,)))
    with pytest.raises(CorruptCheckpointError):  # the last (short) slice's stream swapped in
        SLICED.decode([streams[2], streams[1], streams[0]], params, spec)
    with pytest.raises(CorruptCheckpointError):
        SLICED.decode([streams[0], streams[1][:-3], streams[2]], params, spec)
    with pytest.raises(FormatError):  # a sliced file read as a one-stream one
        SLICED.decode(streams, {"chunk": params["chunk"]}, spec)


def test_old_and_sliced_goldens_are_both_pinned():
    names = {path.stem for path in _golden_files()}
    assert {"byte_grouping_float32", "byte_grouping_float32_sliced", "byte_grouping_complex64_sliced"} <= names
    for path in _golden_files():
        doc = json.loads(path.read_text())
        assert ("slice" in doc["params"]) == path.stem.endswith("_sliced")
        assert (len(doc["streams"]) > 1) == path.stem.endswith("_sliced")
