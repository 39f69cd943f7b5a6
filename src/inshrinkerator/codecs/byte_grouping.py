"""Lossless byte grouping + zstd, the default codec for tensors.

A float's exponent is highly predictable while its low mantissa bits are close
to random. The codec cuts a tensor into chunks of elements and splits each chunk
into byte *planes* (all lowest bytes together, ..., all top bytes together).
For floats the top two bytes of each element are first rotated left by one bit,
so the sign moves down and the top plane holds exactly the exponent (fp32,
bf16) or its top 8 bits (fp64), or the exponent and top mantissa bits (fp16).

Each plane of each chunk is stored one of two ways, chosen from a sample of it:

- raw, when its estimated order-0 entropy says it is near random (most mantissa
  planes: coding them would save under ~5% and cost most of the codec's time).
  Two adjacent raw planes of the input bytes travel as one interleaved pair;
- one zstd frame (see :mod:`.entropy`): Huffman-coded literals with almost no
  LZ matching for weights' exponent planes, where matches cost more than they
  save; Huffman plus light LZ where a probe shows repeats pay (runs of zeros,
  the rows of Adam's second moment) and for every integer or bool plane (the
  high bytes of small integers, sequences). A frame that is not smaller is raw.

Chunks are coded in parallel. Byte planes are a byte-level layout of CPU buffers
handed to zstd, so they are built with numpy at this I/O edge.

A tensor larger than a *slice* (``slice_bytes``, 32 MiB by default) is coded one slice
of elements at a time, one stream per slice, so encoding holds one slice's output, not
the whole tensor's: :meth:`ByteGroupingCodec.encode_lazily` returns streams that are
encoded as they are iterated (the container writer writes each one as it comes), and
decoding fills the output slice by slice.

Stream layout (all integers little-endian); a stream covers one slice of elements (the
whole tensor when there is one stream), cut into chunks of ``chunk`` elements from its
start::

    u32 piece_count                      chunks x planes, chunk-major, plane 0 = lowest byte
    piece_count x u8   mode              0 = raw plane bytes, 1 = one zstd frame,
                                         2 = planes p, p+1 raw and interleaved (2 bytes
                                         per element, as in memory), 3 = the empty
                                         second half of such a pair
    piece_count x u32  stored size
    the pieces, back to back

Params: ``{"chunk": elements per chunk}``: one stream for the whole tensor (every tensor
of at most one slice, and every file written before slices existed); or
``{"chunk": c, "slice": s}``: ``ceil(elements / s)`` streams, stream ``i`` holding
elements ``[i*s, (i+1)*s)``. (Elements count complex numbers as two floats.)
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional, Union, overload

import numpy as np
import torch

from ..errors import CorruptCheckpointError, FormatError
from ._parallel import parallel_map, worker_count
from .base import Codec, Encoded, TensorSpec
from .entropy import byte_entropy_bits, expand_frame, huffman_frame, lz_frame
from .raw import tensor_byte_view
from .registry import register_codec

__all__ = ["ByteGroupingCodec", "SLICE_BYTES", "SliceStreams", "tensor_byte_rows"]

_ROTATED = {torch.float32, torch.float16, torch.bfloat16, torch.float64}
# complex numbers are pairs of floats: group them as such
_COMPLEX_PARTS = {torch.complex64: torch.float32, torch.complex128: torch.float64}

# Piece modes. A *pair* holds two adjacent raw planes p, p+1 interleaved as they lie in
# memory (the element's 16 bits): one strided 16-bit copy instead of two 8-bit ones
# when encoding and decoding. The pair's second plane is an empty *paired* piece.
_RAW, _ZSTD, _PAIR, _PAIRED = 0, 1, 2, 3
_COUNT = struct.Struct("<I")
# Bytes sampled (evenly spread) to estimate a plane's entropy.
_SAMPLE_BYTES = 4096
# Estimated bits/byte above which a float plane is stored raw: coding it would save
# under ~5% of it (weights' low mantissa planes: 7.94-7.97 bits; Adam moments': ~7.7)
# while costing most of the codec's time. (The estimate from 4096 samples reads
# ~0.045 bits low on uniform bytes.)
_NEAR_RANDOM_BITS = 7.55
# How a plane that is worth coding is coded: zstd's Huffman literals alone, or light
# LZ on top (three times slower; it pays on repeats: runs of zeros, the rows of Adam's
# second moment, whose exponent planes shrink 8-20% more). Exponent planes below
# _EXPONENT_LZ_BITS (weights': 2.3-2.8 bits; matches only cost there) and other planes
# above _PROBE_BELOW_BITS (random bytes plus some zeros) go straight to Huffman; the
# rest are probed: both coders run on a few spread slices, and LZ must win by 10%.
_EXPONENT_LZ_BITS = 3.0
_PROBE_BELOW_BITS = 7.0
_PROBE_BYTES = 16384
_PROBE_SLICES = 4
_LZ_PROBE_GAIN = 0.90
# Tensors smaller than this are coded in one chunk (thread hand-offs cost more).
_MIN_PARALLEL_BYTES = 1 << 18
_MAX_CHUNK_ELEMENTS = 1 << 28
# Tensor bytes coded (and held, encoded) at a time: the extra memory of encoding a
# huge tensor is about one slice. 16 chunks of the default size, enough to keep
# every worker busy between two slices.
SLICE_BYTES = 32 << 20
_MAX_SLICE_ELEMENTS = 1 << 62


def _lane_dtype(dtype: torch.dtype) -> torch.dtype:
    return _COMPLEX_PARTS.get(dtype, dtype)


def tensor_byte_rows(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a ``(elements, itemsize)`` uint8 array, C order, on the CPU.

    Complex tensors count as pairs of floats. No copy when the tensor is already a
    contiguous CPU tensor; the result then shares its memory.
    """
    return tensor_byte_view(tensor).reshape(-1, _lane_dtype(tensor.dtype).itemsize)


def _byte_planes(rows: np.ndarray, rotate: bool) -> list[np.ndarray]:
    """The byte planes of ``rows`` (plane 0 = lowest byte).

    Plain planes are strided views of ``rows`` (copied once, when the stream is
    assembled). With ``rotate``, each element's top 16 bits are rotated left by one,
    so the sign leaves the top byte (which becomes the exponent) for the bottom of
    the next; those two planes are new arrays.
    """
    planes = [rows[:, p] for p in range(rows.shape[1])]
    if rotate and len(planes) >= 2:
        # A contiguous copy first: numpy's ufuncs are several times slower on strided
        # input. (For 2-byte dtypes this is the caller's memory itself: it is only read.)
        top = np.ascontiguousarray(rows[:, -2:].view(np.uint16).reshape(-1))
        rotated = np.left_shift(top, 1)
        rotated |= top >> 15
        planes[-2], planes[-1] = rotated.astype(np.uint8), (rotated >> 8).astype(np.uint8)
    return planes


def _write_unrotated_top(rows: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> None:
    """Undo the rotation of :func:`_byte_planes`, writing into the top two bytes of ``rows``."""
    rotated = hi.astype(np.uint16)
    rotated <<= 8
    rotated |= lo
    top = rotated >> 1
    rotated <<= 15
    top |= rotated
    rows[:, -2:].view(np.uint16).reshape(-1)[:] = top


def _probe(data: np.ndarray) -> np.ndarray:
    """A few evenly spread slices of ``data``, side by side (local runs and repeats survive)."""
    slices, size = _PROBE_SLICES, _PROBE_BYTES // _PROBE_SLICES
    stride = (data.size - size) // (slices - 1)
    return np.concatenate([data[i * stride : i * stride + size] for i in range(slices)])


def _code_float_plane(plane: Any, count: int, level: Optional[int], exponent: bool) -> tuple[int, Any]:
    """``(mode, payload)`` for one plane of a float chunk; raw payloads stay views."""
    step = max(1, count // _SAMPLE_BYTES)
    bits = byte_entropy_bits(np.ascontiguousarray(plane[::step])) if count >= 1024 else 4.0
    if bits > _NEAR_RANDOM_BITS:
        return _RAW, plane
    data = np.ascontiguousarray(plane)
    if level is not None:
        frame = lz_frame(data, level)
    elif count <= 2 * _PROBE_BYTES or (bits < _EXPONENT_LZ_BITS if exponent else bits > _PROBE_BELOW_BITS):
        frame = huffman_frame(data)
    else:
        probe = _probe(data)
        if len(lz_frame(probe)) < _LZ_PROBE_GAIN * len(huffman_frame(probe)):
            frame = lz_frame(data)
        else:
            frame = huffman_frame(data)
    return (_ZSTD, frame) if len(frame) < count else (_RAW, plane)


def _code_integer_plane(plane: Any, count: int, level: Optional[int]) -> tuple[int, Any]:
    # Integer planes are often sequences or repeats that an order-0 estimate calls
    # random (indices, counters); LZ finds those, and costs little on random bytes.
    frame = lz_frame(np.ascontiguousarray(plane), level)
    return (_ZSTD, frame) if len(frame) < count else (_RAW, plane)


def _encode_chunk(rows: np.ndarray, is_float: bool, level: Optional[int]) -> list[tuple[int, Any]]:
    count, itemsize = rows.shape
    planes = _byte_planes(rows, rotate=is_float)
    if not is_float:
        return [_code_integer_plane(plane, count, level) for plane in planes]
    top = itemsize - 1
    pieces = [_code_float_plane(plane, count, level, p == top) for p, plane in enumerate(planes)]
    plain = itemsize - 2 if itemsize >= 2 else 0  # planes that are views of the input bytes
    for p in range(0, plain - 1, 2):
        if pieces[p][0] == _RAW and pieces[p + 1][0] == _RAW:
            pieces[p] = (_PAIR, rows[:, p : p + 2].view(np.uint16).reshape(-1))
            pieces[p + 1] = (_PAIRED, b"")
    return pieces


def _slice_source(tensor: torch.Tensor) -> Callable[[int, int], np.ndarray]:
    """``rows(start, stop)``: the byte rows of lanes ``[start, stop)`` of ``tensor``.

    A contiguous tensor is sliced first and only the slice is brought to the CPU (no
    copy at all for a CPU tensor); any other layout is made contiguous on the CPU once.
    """
    flat = tensor.detach()
    if flat.is_contiguous() and not flat.is_conj() and not flat.is_neg():
        flat = flat.reshape(-1)
        if flat.dtype.is_complex:
            flat = torch.view_as_real(flat).reshape(-1)
        return lambda start, stop: tensor_byte_rows(flat[start:stop])
    rows = tensor_byte_rows(tensor)
    return lambda start, stop: rows[start:stop]


class SliceStreams(Sequence[np.ndarray]):
    """The streams of a tensor coded slice by slice, each encoded when it is taken.

    Nothing is kept: iterating twice encodes twice, and the tensor must not change
    until the streams have been consumed. ``list(streams)`` gives the eager result.
    """

    def __init__(
        self, encode_slice: Callable[[int, int], np.ndarray], bounds: list[tuple[int, int]]
    ) -> None:
        self._encode_slice = encode_slice
        self._bounds = bounds

    def __len__(self) -> int:
        return len(self._bounds)

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...

    def __getitem__(self, index: Union[int, slice]) -> Union[np.ndarray, list[np.ndarray]]:
        if isinstance(index, slice):
            return [self._encode_slice(*bounds) for bounds in self._bounds[index]]
        return self._encode_slice(*self._bounds[index])

    def __iter__(self) -> Iterator[np.ndarray]:
        for bounds in self._bounds:
            yield self._encode_slice(*bounds)


@register_codec
class ByteGroupingCodec(Codec):
    """Byte planes per chunk, each zstd-coded or raw.

    Args:
        level: ``None`` (default) to choose per plane between Huffman-only and zstd
            level 1 (see the module doc); an int in ``[-7, 22]`` codes every plane that
            is not near random with that stock zstd level.
        chunk_bytes: tensor bytes per chunk; chunks are the unit of parallelism.
        slice_bytes: tensor bytes coded at a time (rounded to whole chunks); tensors
            larger than this get one stream per slice. An encoder-side choice that the
            params record, so it is not part of the config.
    """

    codec_id = "byte_grouping"

    def __init__(
        self,
        level: Optional[int] = None,
        chunk_bytes: int = 1 << 21,
        *,
        slice_bytes: int = SLICE_BYTES,
    ) -> None:
        if level is not None and (
            not isinstance(level, int) or isinstance(level, bool) or not -7 <= level <= 22
        ):
            raise ValueError(f"zstd level must be None or an int in [-7, 22], got {level!r}")
        if (
            not isinstance(chunk_bytes, int)
            or isinstance(chunk_bytes, bool)
            or not (1 << 12) <= chunk_bytes <= (1 << 28)
        ):
            raise ValueError(f"chunk_bytes must be an int in [4096, 2**28], got {chunk_bytes!r}")
        if not isinstance(slice_bytes, int) or isinstance(slice_bytes, bool) or slice_bytes < 1:
            raise ValueError(f"slice_bytes must be a positive int, got {slice_bytes!r}")
        self.level = level
        self.chunk_bytes = chunk_bytes
        self._slice_bytes = slice_bytes

    def _chunk_elements(self, count: int, itemsize: int) -> int:
        """Elements per chunk: ``chunk_bytes`` worth, but split mid-sized tensors across workers."""
        nbytes = count * itemsize
        chunks = -(-nbytes // self.chunk_bytes)
        if nbytes >= 2 * _MIN_PARALLEL_BYTES:
            chunks = max(chunks, min(worker_count(), nbytes // _MIN_PARALLEL_BYTES))
        return max(1, -(-count // max(chunks, 1)))

    def _layout(self, tensor: torch.Tensor) -> tuple[int, int, int]:
        """``(lanes, elements per chunk, elements per slice)`` for ``tensor``."""
        lanes = tensor.numel() * (2 if tensor.dtype.is_complex else 1)
        itemsize = _lane_dtype(tensor.dtype).itemsize
        chunk = self._chunk_elements(lanes, itemsize)
        return lanes, chunk, max(1, self._slice_bytes // (chunk * itemsize)) * chunk

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        lanes, chunk, per_slice = self._layout(tensor)
        if lanes > per_slice:
            lazy = self.encode_lazily(tensor, reference)
            return Encoded(streams=list(lazy.streams), params=lazy.params)
        is_float = _lane_dtype(tensor.dtype).is_floating_point
        stream = _encode_rows(tensor_byte_rows(tensor), chunk, is_float, self.level)
        return Encoded(streams=[stream], params={"chunk": chunk})

    def encode_lazily(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        """:meth:`encode`, except that a tensor larger than a slice gets a :class:`SliceStreams`:
        each stream is encoded when it is taken, so a caller that writes each one out before
        taking the next holds one slice's output at a time.
        """
        lanes, chunk, per_slice = self._layout(tensor)
        if lanes <= per_slice:
            return self.encode(tensor, reference)
        rows = _slice_source(tensor)
        is_float, level = _lane_dtype(tensor.dtype).is_floating_point, self.level
        bounds = [(start, min(start + per_slice, lanes)) for start in range(0, lanes, per_slice)]
        streams = SliceStreams(
            lambda start, stop: _encode_rows(rows(start, stop), chunk, is_float, level), bounds
        )
        # a Sequence where Encoded says list: the writer only iterates it
        return Encoded(streams=streams, params={"chunk": chunk, "slice": per_slice})  # type: ignore[arg-type]

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if not isinstance(params, dict):
            raise FormatError(f"byte_grouping: params {str(params)[:80]!r} are not an object")
        chunk = _count_param(params, "chunk", _MAX_CHUNK_ELEMENTS)
        lane = _lane_dtype(spec.dtype)
        count = spec.nbytes // lane.itemsize
        if "slice" in params:
            per_slice = _count_param(params, "slice", _MAX_SLICE_ELEMENTS)
            expected = -(-count // per_slice)
        else:
            per_slice, expected = max(count, 1), 1
        if len(streams) != expected:
            raise FormatError(f"byte_grouping: expected {expected} stream(s), got {len(streams)}")
        out = torch.empty(spec.shape, dtype=spec.dtype)
        rows = tensor_byte_rows(out)
        for index, stream in enumerate(streams):
            _decode_rows(stream, rows[index * per_slice : (index + 1) * per_slice], chunk, lane)
        if spec.dtype == torch.bool and count and int(rows.max()) > 1:
            raise CorruptCheckpointError("byte_grouping: bool tensor holds bytes other than 0 and 1")
        return out


def _count_param(params: dict[str, Any], name: str, limit: int) -> int:
    value = params.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
        raise FormatError(f"byte_grouping: params {str(params)[:80]!r} lack a valid {name!r} size")
    return value


def _encode_rows(rows: np.ndarray, chunk: int, is_float: bool, level: Optional[int]) -> np.ndarray:
    """One stream: ``rows`` cut into chunks of ``chunk`` elements, coded in parallel."""
    plans = parallel_map(
        lambda start: _encode_chunk(rows[start : start + chunk], is_float, level),
        range(0, rows.shape[0], chunk),
    )
    return _assemble(plans)


def _decode_rows(stream: Any, rows: np.ndarray, chunk: int, lane: torch.dtype) -> None:
    """Fill ``rows`` (the byte rows of one stream's elements) from ``stream``."""
    itemsize = lane.itemsize
    starts = range(0, rows.shape[0], chunk)
    pieces = _parse_index(stream, len(starts) * itemsize)
    rotated = lane.is_floating_point and itemsize >= 2
    plain = itemsize - 2 if rotated else itemsize

    def expand(index: int) -> None:
        target = rows[starts[index] : starts[index] + chunk]
        size = target.shape[0]
        chunk_pieces = pieces[index * itemsize : (index + 1) * itemsize]
        for p, (mode, payload) in enumerate(chunk_pieces):
            if mode == _PAIR:
                _check_pair(chunk_pieces, p, plain, size)
                target[:, p : p + 2].view(np.uint16).reshape(-1)[:] = np.frombuffer(payload, dtype="<u2")
            elif mode == _PAIRED:
                if p == 0 or chunk_pieces[p - 1][0] != _PAIR:
                    raise CorruptCheckpointError("byte_grouping: a paired piece without its pair")
            elif p < plain:
                target[:, p] = _expand_piece(mode, payload, size)
        if rotated:
            hi, lo = (_expand_piece(*chunk_pieces[p], size) for p in (itemsize - 1, itemsize - 2))
            _write_unrotated_top(target, hi, lo)

    parallel_map(expand, range(len(starts)))


def _assemble(plans: list[list[tuple[int, Any]]]) -> np.ndarray:
    """The stream: the index, then every chunk's pieces, each copied once into one buffer."""
    pieces = [piece for plan in plans for piece in plan]
    sizes = [payload.nbytes if isinstance(payload, np.ndarray) else len(payload) for _, payload in pieces]
    head = _COUNT.size + 5 * len(pieces)
    offsets = np.cumsum([head] + sizes).tolist()
    out = np.empty(offsets[-1], dtype=np.uint8)
    out[: _COUNT.size] = np.frombuffer(_COUNT.pack(len(pieces)), dtype=np.uint8)
    out[_COUNT.size : _COUNT.size + len(pieces)] = [mode for mode, _ in pieces]
    out[_COUNT.size + len(pieces) : head] = np.asarray(sizes, dtype="<u4").view(np.uint8)
    per_chunk = len(plans[0]) if plans else 0

    def place(chunk: int) -> None:
        for index in range(chunk * per_chunk, (chunk + 1) * per_chunk):
            mode, payload = pieces[index]
            target = out[offsets[index] : offsets[index + 1]]
            if mode == _PAIR:
                target.view(np.uint16)[:] = payload  # little-endian: the bytes as they lay
            elif mode == _RAW:
                target[:] = payload
            elif mode == _ZSTD:
                target[:] = np.frombuffer(payload, dtype=np.uint8)

    if offsets[-1] >= _MIN_PARALLEL_BYTES:
        parallel_map(place, range(len(plans)))
    else:
        for chunk in range(len(plans)):
            place(chunk)
    return out


def _parse_index(stream: Any, expected: int) -> list[tuple[int, memoryview]]:
    """``(mode, payload)`` of every piece; :class:`CorruptCheckpointError` if the index is bad."""
    view = memoryview(stream).cast("B")
    if len(view) < _COUNT.size:
        raise CorruptCheckpointError("byte_grouping: stream is shorter than its index")
    (count,) = _COUNT.unpack(view[: _COUNT.size])
    if count != expected:
        raise CorruptCheckpointError(
            f"byte_grouping: stream holds {count} pieces, the tensor needs {expected}"
        )
    head = _COUNT.size + 5 * count
    if len(view) < head:
        raise CorruptCheckpointError("byte_grouping: stream is truncated inside its index")
    modes = np.frombuffer(view[_COUNT.size : _COUNT.size + count], dtype=np.uint8).tolist()
    sizes = np.frombuffer(view[_COUNT.size + count : head], dtype="<u4").astype(np.int64)
    if int(sizes.sum()) != len(view) - head:
        raise CorruptCheckpointError(
            f"byte_grouping: pieces add up to {int(sizes.sum())} bytes, the stream holds {len(view) - head}"
        )
    ends = (np.cumsum(sizes) + head).tolist()
    starts = [head] + ends[:-1]
    return [(mode, view[start:end]) for mode, start, end in zip(modes, starts, ends)]


def _check_pair(chunk_pieces: list[tuple[int, memoryview]], plane: int, plain: int, size: int) -> None:
    """A pair must cover two plain planes, hold 2 bytes per element and be followed by its mate."""
    payload = chunk_pieces[plane][1]
    if plane + 1 >= plain or chunk_pieces[plane + 1][0] != _PAIRED or len(chunk_pieces[plane + 1][1]):
        raise CorruptCheckpointError(f"byte_grouping: a plane pair at plane {plane} does not fit the tensor")
    if len(payload) != 2 * size:
        raise CorruptCheckpointError(
            f"byte_grouping: a plane pair holds {len(payload)} bytes, its two planes hold {2 * size}"
        )


def _expand_piece(mode: int, payload: memoryview, size: int) -> np.ndarray:
    """One plane of ``size`` bytes from its stored piece."""
    if mode == _RAW:
        if len(payload) != size:
            raise CorruptCheckpointError(
                f"byte_grouping: a raw piece holds {len(payload)} bytes, its plane holds {size}"
            )
        return np.frombuffer(payload, dtype=np.uint8)
    if mode == _ZSTD:
        try:
            return np.frombuffer(expand_frame(payload, size), dtype=np.uint8)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"byte_grouping: {exc}") from None
    if mode in (_PAIR, _PAIRED):
        raise CorruptCheckpointError("byte_grouping: a plane pair where a single plane belongs")
    raise CorruptCheckpointError(f"byte_grouping: unknown piece mode {mode}")
