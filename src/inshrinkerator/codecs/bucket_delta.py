"""Quantization-aware delta coding of integer bucket ids.

A quantized tensor is a vector of bucket ids in ``[0, levels)``. Between two
checkpoints most elements stay in their bucket, so the ids are coded as cyclic
deltas ``(id - predicted) mod levels`` against a *predicted* id per element
that the decoder recomputes on its own (the caller's business: here, the
bucket the previous reconstructed value falls in). The mostly-zero deltas are
run-length tokenized (:mod:`.zero_runs`) and coded with the shared order-0 ANS
stage (:func:`.entropy.encode_symbols`).

*Rearranged* mode first groups the deltas by predicted bucket (a stable
grouping the decoder rebuilds from the predictions, so no permutation is
stored): buckets whose elements migrate often no longer break the zero runs
of the stable ones. It costs a sort, so callers use it for small tensors.

Without a prediction (a full checkpoint) the ids are coded against their most
frequent id, which then forms the runs.

*Direct* layout: when fewer than half the deltas are zero, run-length tokens
cannot pay (the runs are too short); the per-element values are then coded as
they are (the ids themselves without a prediction), which also makes decoding a
single pass.

Entropy stage: symbols that fit a byte are Huffman-coded by zstd, one symbol
per byte (:func:`.entropy.huffman_frame`) or, for low-entropy streams where
Huffman's one-bit floor would cost 10-100%, two or four symbols per byte
(:mod:`.symbol_tuples`); both run at ~1 GB/s both ways, and the smaller of the two
candidates tried is kept (on bucket-id streams tuples often code below the
order-0 entropy of the single symbols). The order-0 ANS stage
(:func:`.entropy.encode_symbols`, ~0.1% above the bound, but ~100x slower) is used
for larger alphabets, for small streams where it is smaller, and for any stream
where the Huffman candidates would be more than ``HUFFMAN_SLACK`` (5%) above the
order-0 bound.

Short direct streams (a bias's ids, a layer norm's change) spend much of their bytes on
the count table or Huffman tree. For them a third candidate is tried: each id as its
signed cyclic distance from a centre (the most frequent id without a prediction, else 0),
coded under one of a fixed family of symmetric models named in a byte
(:mod:`.symmetric_models`), which needs no table.

Stream layout (little-endian; ``varint`` is unsigned LEB128)::

    u8 mode (bits 0-1: 0 plain, 1 predicted, 2 rearranged; bit 2: direct layout;
    bit 3: Huffman frame; bit 4: symbol tuples; bit 5: symmetric model; none of the three:
    ANS), u16 levels, u16 run symbol (with bit 5: the centre), varint symbols,
    varint entropy-coded bytes, varint extra bits, entropy-coded symbols, extra-bit bytes

With bit 5 (direct layout only) the entropy-coded symbols are a symmetric stream
(:func:`.symmetric_models.encode_symmetric`) of the values ``v`` in ``-limit..limit``,
``limit <= levels // 2``, and the direct symbol of each id is ``(centre + v) mod levels``.

Streams without the layout and coder bits (run tokens, ANS) are the format of
DynaQuant stream version 1 and still decode; bit 4 is new in version 3, bit 5 later in
version 3 (readers before it refuse such a stream with a ``FormatError``).
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from ..errors import CorruptCheckpointError, FormatError
from ._numpy_paths import positions_differing, stable_argsort
from .entropy import (
    decode_symbols,
    encode_symbols,
    encoded_size_floor,
    expand_frame,
    histogram_bits,
    huffman_frame,
)
from .scratch import reusing_scratch
from .symbol_tuples import (
    TUPLE_SIZES,
    decode_symbol_tuples,
    encode_symbol_tuples,
    tuple_header_bytes,
)
from .symmetric_models import (
    MAX_STREAM_LIMIT,
    best_model,
    decode_symmetric,
    encode_symmetric,
    symmetric_header_bytes,
)
from .varint import decode_varint, encode_varint
from .zero_runs import from_run_tokens, to_run_tokens, token_alphabet

__all__ = [
    "PLAIN",
    "PREDICTED",
    "REARRANGED",
    "MAX_LEVELS",
    "EntropyStats",
    "ANS",
    "HUFFMAN",
    "TUPLES",
    "SYMMETRIC",
    "id_dtype",
    "encode_bucket_ids",
    "decode_bucket_ids",
]

PLAIN, PREDICTED, REARRANGED = 0, 1, 2
#: The entropy coders of the symbols (the mode byte's bits 3, 4 and 5).
ANS, HUFFMAN, TUPLES, SYMMETRIC = 0, 1, 2, 3
_MODE_MASK, _DIRECT, _HUFFMAN, _TUPLES, _SYMMETRIC = 3, 4, 8, 16, 32
_CODER_FLAGS = {ANS: 0, HUFFMAN: _HUFFMAN, TUPLES: _TUPLES, SYMMETRIC: _SYMMETRIC}
# Direct streams of at most this many ids are also tried under a symmetric model.
_SYMMETRIC_UP_TO = 1 << 11
# Below this many bits per symbol Huffman's one-bit floor makes tuples pay: tuples of 4 and 2
# are tried; above it, pairs and single symbols.
_TUPLES_BELOW_BITS = 3.5
# Tuple sizes are tried only while at most this share of the symbols must escape.
_MAX_ESCAPES = 0.25
MAX_LEVELS = 1 << 12
#: Huffman coding is used while it stays within this fraction above the order-0 bound (the
#: issue-5 bound on the entropy stage; ~1% is typical, small alphabets of skewed deltas reach 3-5%).
HUFFMAN_SLACK = 0.05
# Streams up to this many symbols are coded both ways and the smaller kept.
_SMALL_STREAM = 1 << 16
# Run tokens are considered when at least this fraction of the deltas is zero; direct
# coding is considered too up to the second fraction.
_RUNS_FROM, _DIRECT_UP_TO = 0.5, 0.9
_HEAD = struct.Struct("<BHH")
# The shared entropy stage starts its stream with a fixed header: alphabet, count, table bytes.
_SYMBOLS_HEAD = struct.Struct("<IQI")
# Streams of fewer ids are put together in NumPy at decode (its calls cost a fraction of
# torch's on a few thousand ids; :mod:`.small_tensor_decode`).
_SMALL_DECODE = 1 << 13


def id_dtype(levels: int) -> torch.dtype:
    """The smallest integer dtype that holds ids in ``[0, levels)``."""
    return torch.uint8 if levels <= 256 else torch.int16


@dataclass
class EntropyStats:
    """Accumulates the entropy stage's output against the order-0 entropy of its symbols.

    ``payload_bytes`` counts the coded symbols only; ``table_bytes`` the headers and
    symbol-count tables that travel with them.
    """

    symbols: int = 0
    entropy_bits: float = 0.0
    payload_bytes: int = 0
    table_bytes: int = 0
    parts: int = 0
    # Tensors are encoded on several threads at once.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(
        self,
        tokens: torch.Tensor,
        alphabet: int,
        coded: bytes,
        table: Optional[int] = None,
        bits: Optional[float] = None,
    ) -> None:
        """Count ``tokens`` coded as ``coded``, of which ``table`` bytes are not payload
        (default: the ANS stage's header and count table); ``bits``: their order-0 entropy,
        when the caller has it."""
        if bits is None:
            bits = histogram_bits(torch.bincount(tokens.reshape(-1), minlength=alphabet))
        if table is None:
            table = _SYMBOLS_HEAD.size + _SYMBOLS_HEAD.unpack_from(coded)[2]
        with self._lock:
            self.symbols += tokens.numel()
            self.entropy_bits += bits
            self.payload_bytes += len(coded) - table
            self.table_bytes += table
            self.parts += 1

    def merge(self, other: "EntropyStats") -> None:
        """Add the counts of ``other`` (figures gathered apart, e.g. for an encoding that
        was then chosen among several)."""
        with self._lock:
            self.symbols += other.symbols
            self.entropy_bits += other.entropy_bits
            self.payload_bytes += other.payload_bytes
            self.table_bytes += other.table_bytes
            self.parts += other.parts

    @property
    def payload_overhead(self) -> float:
        """Payload bytes over the order-0 entropy, minus one (0.01: 1% above the bound)."""
        bound = self.entropy_bits / 8
        return self.payload_bytes / bound - 1 if bound > 0 else 0.0


def _order(predicted: torch.Tensor, levels: int) -> torch.Tensor:
    # The stable grouping by predicted bucket: order[k] is the k-th element.
    return stable_argsort(predicted.reshape(-1).to(id_dtype(levels)))


def _rank(predicted: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    # _order and its inverse permutation.
    order = _order(predicted, levels)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return order, rank


def _byte_symbols(symbols: torch.Tensor) -> Any:
    return symbols.to(device="cpu", dtype=torch.uint8).contiguous().numpy()


def encode_id_symbols(
    symbols: torch.Tensor, alphabet: int, small_stream: int = _SMALL_STREAM, counts: Optional[torch.Tensor] = None
) -> tuple[int, bytes, Optional[float]]:
    """``(coder, data, bits)``: ``symbols`` (in ``[0, alphabet)``) coded by the cheaper adequate
    coder, and their order-0 entropy in bits when it was computed (else None). ``counts``:
    their histogram (``alphabet`` bins), when the caller has it.

    When the alphabet fits a byte: the smaller of two Huffman candidates (symbol tuples of 4
    and 2 below :data:`_TUPLES_BELOW_BITS` bits per symbol, else pairs and single symbols),
    if it stays within :data:`HUFFMAN_SLACK` of the order-0 bound (small streams: when it is
    not larger than the ANS stage's output); otherwise the ANS stage.
    """
    count = symbols.numel()
    bits = None
    if alphabet <= 256 and count:
        if counts is None or counts.numel() != alphabet:
            counts = torch.bincount(symbols.reshape(-1).cpu(), minlength=alphabet)
        counts = counts.cpu()
        bits = histogram_bits(counts)
        bound = bits / 8
        best: Optional[tuple[int, bytes]] = None
        sizes = (4, 2) if 8 * bound < _TUPLES_BELOW_BITS * count else (2, 1)
        ranked = np.sort(counts.numpy())[::-1]  # a table: NumPy's calls cost less (histogram_bits)
        # A tuple size whose escape digit would stand for many symbols does not pay.
        sizes = [size for size in sizes if size == 1 or int(ranked[TUPLE_SIZES[size] - 1 :].sum()) <= _MAX_ESCAPES * count]
        for size in sizes or [1]:
            if size == 1:
                candidate = (HUFFMAN, huffman_frame(_byte_symbols(symbols)))
            else:
                candidate = (TUPLES, encode_symbol_tuples(symbols, counts, size))
            if best is None or len(candidate[1]) < len(best[1]):
                best = candidate
        assert best is not None
        if count <= small_stream:
            # The ANS stage cannot be smaller than its floor, and the Huffman candidate
            # wins a tie: where it is within the floor, the ANS pass is not run.
            if len(best[1]) <= encoded_size_floor(counts.numpy(), bits):
                return (*best, bits)
            coded = encode_symbols(symbols, alphabet)
            return (*best, bits) if len(best[1]) <= len(coded) else (ANS, coded, bits)
        if len(best[1]) <= (1 + HUFFMAN_SLACK) * bound + 64:
            return (*best, bits)
    return ANS, encode_symbols(symbols, alphabet), bits


def coded_table_bytes(coder: int, data: bytes) -> int:
    """The bytes of ``data`` (from :func:`encode_id_symbols`) that are not coded symbols."""
    if coder == HUFFMAN:
        return 0
    if coder == TUPLES:
        return tuple_header_bytes(data)
    if coder == SYMMETRIC:
        return symmetric_header_bytes(data)
    return _SYMBOLS_HEAD.size + _SYMBOLS_HEAD.unpack_from(data)[2]


def decode_id_symbols(data: Any, coder: int, count: int, alphabet: int) -> torch.Tensor:
    """Inverse of :func:`encode_id_symbols`: ``count`` symbols (uint8 from Huffman, else int64).

    Raises:
        CorruptCheckpointError / FormatError: the data does not hold ``count`` symbols below
            ``alphabet``.
    """
    if coder != ANS:
        if alphabet > 256:
            raise FormatError(f"bucket-id stream: a Huffman frame cannot hold an alphabet of {alphabet}")
        if count == 0:
            if len(data):
                raise CorruptCheckpointError("bucket-id stream: an empty Huffman frame holds data")
            return torch.empty(0, dtype=torch.uint8)
        if coder == TUPLES:
            symbols = decode_symbol_tuples(data, count)
        else:
            symbols = torch.frombuffer(bytearray(expand_frame(data, count)), dtype=torch.uint8)
    else:
        symbols = decode_symbols(data, count)
    if symbols.numel() and int(symbols.max()) >= alphabet:
        raise CorruptCheckpointError(f"bucket-id stream: symbols lie outside their alphabet of {alphabet}")
    return symbols


def _cyclic_difference(ids: torch.Tensor, base: torch.Tensor, levels: int) -> torch.Tensor:
    """``(ids - base) mod levels`` elementwise, for ids and base in ``[0, levels)``."""
    if levels <= 128 and ids.dtype == base.dtype == torch.uint8:
        # In wrapping uint8 arithmetic d = ids - base is the result when ids >= base, and
        # d + levels otherwise (d then wraps to above 128 > d + levels): the smaller of the two.
        difference = ids - base
        return torch.minimum(difference, difference + levels)
    difference = ids.to(torch.int16) - base.to(torch.int16)
    return torch.where(difference < 0, difference + levels, difference)


def _cyclic_sum(base: torch.Tensor, values: torch.Tensor, levels: int) -> torch.Tensor:
    """``(base + values) mod levels`` elementwise, for both in ``[0, levels)``."""
    if levels <= 128 and base.dtype == values.dtype == torch.uint8:
        # The sum s stays below 256; s - levels wraps to above 128 > s when s < levels.
        total = base + values
        return torch.minimum(total, total - levels)
    total = base.to(torch.int16) + values.to(torch.int16)
    return torch.where(total >= levels, total - levels, total)


def encode_bucket_ids(
    ids: torch.Tensor,
    levels: int,
    predicted: Optional[torch.Tensor] = None,
    rearrange: bool = False,
    stats: Optional[EntropyStats] = None,
    changed: Optional[torch.Tensor] = None,
    run_symbol: Optional[int] = None,
    small_stream: int = _SMALL_STREAM,
) -> bytes:
    """Code ``ids`` (integers in ``[0, levels)``) against optional ``predicted`` ids of the same size.

    ``changed`` (optional) lists, ascending, the positions where ids and predictions differ,
    and ``run_symbol`` the most frequent id (without a prediction), when the caller knows them.
    Streams of up to ``small_stream`` symbols are also ANS-coded and the smaller kept
    (a caller coding many parts of one tensor may lower it: the ANS pass is the slower).
    """
    if not 2 <= levels <= MAX_LEVELS:
        raise ValueError(f"levels must be in [2, {MAX_LEVELS}], got {levels}")
    ids = ids.reshape(-1)
    count = ids.numel()
    changed_count = None if changed is None else changed.numel()
    histogram = None
    if predicted is None:
        mode = PLAIN
        if run_symbol is not None and not 0 <= run_symbol < levels:
            raise ValueError(f"run symbol {run_symbol} is not an id in [0, {levels})")
        if run_symbol is None or changed is None:
            histogram = torch.bincount(ids, minlength=levels) if count else torch.zeros(levels, dtype=torch.long)
            run_symbol = int(histogram.argmax()) if run_symbol is None else run_symbol
            # The positions themselves are found only if run tokens are tried.
            changed_count = count - int(histogram[run_symbol])
        positions = changed
    else:
        predicted = predicted.reshape(-1)
        if predicted.numel() != count:
            raise ValueError("predicted ids must match the ids in size")
        run_symbol = 0
        mode = REARRANGED if rearrange else PREDICTED
        positions = changed if changed is not None else positions_differing(ids, predicted)
        changed_count = positions.numel()
    with reusing_scratch():  # the candidates' large temporaries share buffers
        return _encode_bucket_ids(
            ids, levels, predicted, stats, positions, changed_count, mode, run_symbol, count, small_stream, histogram
        )


def _encode_bucket_ids(
    ids: torch.Tensor,
    levels: int,
    predicted: Optional[torch.Tensor],
    stats: Optional[EntropyStats],
    positions: Optional[torch.Tensor],
    changed_count: int,
    mode: int,
    run_symbol: int,
    count: int,
    small_stream: int,
    histogram: Optional[torch.Tensor] = None,
) -> bytes:
    # positions: where ids differ from the prediction (or the run symbol); None: not yet found.
    # histogram: the plain ids' counts, when known (the direct candidate's symbols).
    zeros = 1.0 - changed_count / count if count else 1.0
    candidates: list[tuple[int, torch.Tensor, bytes, int]] = []  # (layout flag, symbols, extra bits, extra count)
    order = dense = None
    if mode == REARRANGED:
        order, rank = _rank(predicted, levels)
    if zeros < _DIRECT_UP_TO:
        if mode == PLAIN:
            dense = ids  # coded as they are: the order-0 entropy is the same
        else:
            dense = _cyclic_difference(ids, predicted, levels)
            if order is not None:
                dense = dense.index_select(0, order)
        candidates.append((_DIRECT, dense, b"", 0))
    if zeros >= _RUNS_FROM:
        if positions is None:
            positions = positions_differing(ids, run_symbol)
        base = run_symbol if predicted is None else predicted.index_select(0, positions.reshape(-1).long())
        values = _cyclic_difference(ids.index_select(0, positions.reshape(-1).long()), base if torch.is_tensor(base) else torch.tensor(base), levels)
        if order is not None:
            positions, permutation = torch.sort(rank.index_select(0, positions.reshape(-1).long()))
            values = values.index_select(0, permutation)
        runs = to_run_tokens(positions, values, count, levels)
        candidates.append((0, runs.tokens, runs.extra_bits, runs.extra_bit_count))
    best: Optional[tuple[int, torch.Tensor, bytes, int, int, bytes, Optional[float]]] = None
    for layout, symbols, extra, extra_count in candidates:
        alphabet = levels if layout == _DIRECT else token_alphabet(levels)
        known = histogram if layout == _DIRECT and mode == PLAIN else None
        coder, coded, bits = encode_id_symbols(symbols, alphabet, small_stream, known)
        if best is None or len(coded) + len(extra) < len(best[5]) + len(best[2]):
            best = (layout, symbols, extra, extra_count, coder, coded, bits)
    assert best is not None  # one of the two ranges always applies
    centre = run_symbol if mode == PLAIN else 0
    if dense is not None and 0 < count <= min(small_stream, _SYMMETRIC_UP_TO):
        symmetric = _symmetric_candidate(dense, levels, centre, len(best[5]) + len(best[2]))
        if symmetric is not None:
            best = (_DIRECT, dense, b"", 0, SYMMETRIC, symmetric, None)
    layout, symbols, extra, extra_count, coder, coded, bits = best
    if stats is not None:
        alphabet = levels if layout == _DIRECT else token_alphabet(levels)
        stats.add(symbols, alphabet, coded, coded_table_bytes(coder, coded), bits)
    flags = mode | layout | _CODER_FLAGS[coder]
    field = centre if coder == SYMMETRIC else run_symbol if layout != _DIRECT else 0
    head = _HEAD.pack(flags, levels, field) + b"".join(
        encode_varint(n) for n in (symbols.numel(), len(coded), extra_count)
    )
    return b"".join([head, coded, extra])


def _signed_distances(symbols: torch.Tensor, centre: int, levels: int) -> np.ndarray:
    """Each of ``symbols`` (in ``[0, levels)``) as its cyclic distance from ``centre``, in
    ``(-levels / 2, levels / 2]`` (int64; numpy, whose calls cost less than torch's on a
    stream of a few hundred ids)."""
    distances = (symbols.reshape(-1).cpu().numpy().astype(np.int64) - centre) % levels
    return np.where(distances > levels // 2, distances - levels, distances)


def _symmetric_candidate(symbols: torch.Tensor, levels: int, centre: int, to_beat: int) -> Optional[bytes]:
    """The direct ``symbols`` as a symmetric stream around ``centre``, if that fits the
    family and takes fewer than ``to_beat`` bytes; else None."""
    values = _signed_distances(symbols, centre, levels)
    limit = max(1, int(np.abs(values).max()))
    if limit > min(MAX_STREAM_LIMIT, levels // 2):
        return None
    counts = torch.from_numpy(np.bincount(values + limit, minlength=2 * limit + 1))
    code, bits = best_model(counts, limit)
    if bits / 8 + 2 >= to_beat:  # its limit and code, and the words cannot hold less
        return None
    coded = encode_symmetric(torch.from_numpy(values), limit, code)
    return coded if len(coded) < to_beat else None


def _small_direct_ids(symbols: torch.Tensor, predicted: torch.Tensor, levels: int, mode: int) -> torch.Tensor:
    """The ids of a short direct stream coded against ``predicted`` ids (CPU), in NumPy:
    the same regrouping and cyclic sums as the torch path of :func:`decode_bucket_ids`."""
    dtype = np.uint8 if id_dtype(levels) == torch.uint8 else np.int16
    base = predicted.reshape(-1).numpy().astype(dtype, copy=False)
    values = symbols.numpy()
    if mode == REARRANGED:  # the k-th symbol belongs to the k-th element of _order
        placed = np.empty_like(values)
        placed[np.argsort(base, kind="stable")] = values
        values = placed
    return torch.from_numpy(((base.astype(np.int32) + values) % levels).astype(dtype))


def decode_bucket_ids(
    data: Any, levels: int, count: int, predicted: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Inverse of :func:`encode_bucket_ids`: the ids, in :func:`id_dtype` of ``levels``.

    Raises:
        FormatError / CorruptCheckpointError: the stream does not describe ``count`` ids
        over ``levels`` levels, or needs a prediction that was not given.
    """
    view = memoryview(data).cast("B")
    if len(view) < _HEAD.size:
        raise CorruptCheckpointError("bucket-id stream is shorter than its header")
    flags, stored_levels, run_symbol = _HEAD.unpack_from(view)
    mode, direct = flags & _MODE_MASK, bool(flags & _DIRECT)
    coder = SYMMETRIC if flags & _SYMMETRIC else TUPLES if flags & _TUPLES else HUFFMAN if flags & _HUFFMAN else ANS
    symbol_count, cursor = decode_varint(view, _HEAD.size)
    coded_bytes, cursor = decode_varint(view, cursor)
    extra_bits, cursor = decode_varint(view, cursor)
    if (
        stored_levels != levels
        or run_symbol >= levels
        or mode not in (PLAIN, PREDICTED, REARRANGED)
        or flags & ~(_MODE_MASK | _DIRECT | _HUFFMAN | _TUPLES | _SYMMETRIC)
        or bin(flags & (_HUFFMAN | _TUPLES | _SYMMETRIC)).count("1") > 1
        or flags & _SYMMETRIC and not direct
    ):
        raise FormatError(
            f"bucket-id stream (mode {flags:#x}, {stored_levels} levels) does not fit {levels} levels"
        )
    if mode != PLAIN:
        if predicted is None:
            raise FormatError("bucket-id stream was coded against predicted ids that were not given")
        if predicted.numel() != count:
            raise FormatError("predicted ids do not match the tensor's size")
    extra_bytes = -(-extra_bits // 8)
    if cursor + coded_bytes + extra_bytes != len(view) or symbol_count > count:
        raise CorruptCheckpointError("bucket-id stream size does not match its header")
    if direct and (symbol_count != count or extra_bits):
        raise CorruptCheckpointError("bucket-id stream: a direct layout holds one symbol per id")
    alphabet = levels if direct else token_alphabet(levels)
    small = 0 < count < _SMALL_DECODE and (predicted is None or predicted.device.type == "cpu")
    if coder == SYMMETRIC:
        # In NumPy (int64, remainders of the divisor's sign, as torch's): a symmetric stream
        # is short (the coder takes up to _SYMMETRIC_UP_TO ids) and always on the CPU.
        distances = decode_symmetric(view[cursor : cursor + coded_bytes], symbol_count).numpy()
        if distances.size and int(np.abs(distances).max()) > levels // 2:
            raise CorruptCheckpointError(f"bucket-id stream: a symmetric value lies beyond half of {levels} levels")
        symbols = torch.from_numpy((distances + run_symbol) % levels)
    else:
        symbols = decode_id_symbols(view[cursor : cursor + coded_bytes], coder, symbol_count, alphabet)
    dtype = id_dtype(levels)
    if direct:
        if mode == PLAIN:
            return symbols.to(dtype)
        if small:
            return _small_direct_ids(symbols, predicted, levels, mode)
        if mode == REARRANGED:
            order = _order(predicted, levels)
            symbols = torch.empty_like(symbols).index_copy_(0, order, symbols)
        return _cyclic_sum(predicted.reshape(-1).cpu(), symbols, levels).to(dtype)
    extra = bytes(view[cursor + coded_bytes :])
    positions, values = from_run_tokens(symbols, extra, extra_bits, levels, count)
    if mode == PLAIN:
        ids = torch.full((count,), run_symbol, dtype=dtype)
        ids.index_put_((positions,), _cyclic_sum(torch.tensor(run_symbol), values, levels).to(dtype))
        return ids
    ids = predicted.reshape(-1).to(dtype=dtype, device="cpu", copy=True)
    if mode == REARRANGED:
        order = _order(ids, levels)
        positions = order.index_select(0, positions)
    ids.index_put_((positions,), _cyclic_sum(ids.index_select(0, positions), values, levels).to(dtype))
    return ids
