"""Entropy stages: order-0 coding of integer symbols (ANS) and of byte planes (zstd).

Symbols. :func:`encode_symbols` codes a 1-D tensor of symbols in ``[0, alphabet)``
within a fraction of a percent of their empirical order-0 entropy with an ANS
coder (the constriction library); the symbol counts travel with the data
(zstd-packed), so decoding needs nothing else. This is the shared entropy stage of
the lossy codecs. Stream layout: ``u32 alphabet, u64 count, u32 table_bytes`` +
zstd(u64 counts) + ANS words.

Byte planes. The lossless codec needs ~1 GB/s, which an ANS coder driven from
Python does not reach (constriction: ~125 MB/s encoding, ~30 MB/s decoding, GIL
held), so its planes are coded as standard zstd frames, by one of two coders:

- :func:`huffman_frame`: zstd's Huffman literal coder with the match finder
  turned down to almost nothing (fast strategy at maximum acceleration, literal
  compression forced on). On exponent planes, where LZ matches cost more than
  the literals they replace, this is both the smallest and the fastest zstd
  output (MiniLM exponents: within 2% of their order-0 entropy at ~0.8-1 GB/s).
- :func:`lz_frame`: light LZ matching on top of the same forced Huffman literals
  (or a stock zstd level), for planes with repeats (runs of zeros, Adam's second
  moment, integers).

Both decode with :func:`expand_frame`, which bounds the output size.
"""

from __future__ import annotations

import struct
import sys
import threading
from typing import Any, Callable, Optional

import constriction
import numpy as np
import torch
import zstandard

from ..errors import CorruptCheckpointError, FormatError

if sys.version_info >= (3, 14):
    from compression import zstd as _std_zstd
else:  # the same module, packaged for older Pythons
    from backports import zstd as _std_zstd

__all__ = [
    "encode_symbols",
    "encoded_size_floor",
    "decode_symbols",
    "order0_entropy_bits",
    "histogram_bits",
    "MAX_ALPHABET",
    "byte_entropy_bits",
    "huffman_frame",
    "lz_frame",
    "expand_frame",
]

MAX_ALPHABET = 1 << 20
_HEADER = struct.Struct("<IQI")


def order0_entropy_bits(symbols: torch.Tensor, alphabet: int) -> float:
    """Total order-0 entropy of ``symbols`` in bits (the bound a coder is measured against)."""
    if symbols.numel() == 0:
        return 0.0
    return histogram_bits(torch.bincount(symbols.reshape(-1).long(), minlength=alphabet))


def histogram_bits(counts: torch.Tensor) -> float:
    """Total order-0 entropy, in bits, of symbols with these ``counts`` (a histogram of any
    shape; zero counts are skipped).

    On the CPU through NumPy: a table of a few hundred entries costs a fifth of torch's
    time there, and NumPy keeps the GIL for arrays that small, where each torch call
    hands it to the other codec thread and back (two threads running such calls side by
    side were slower than one thread alone)."""
    if counts.device.type != "cpu":
        kept = counts.reshape(-1).double()
        kept = kept[kept > 0]
        return float(-(kept * torch.log2(kept / kept.sum())).sum())
    kept = counts.numpy().reshape(-1).astype(np.float64)
    kept = kept[kept > 0]
    return float(-(kept * np.log2(kept / kept.sum())).sum())


def _model(counts: np.ndarray) -> Any:
    probabilities = (counts / counts.sum()).astype(np.float32)
    return constriction.stream.model.Categorical(probabilities, perfect=False)


def _count_table(counts: np.ndarray) -> bytes:
    # The symbol counts as a stream stores them (its model).
    compressor = _thread_coder("count-table", lambda: zstandard.ZstdCompressor(level=3))
    return compressor.compress(counts.astype(np.uint64).tobytes())


def encoded_size_floor(counts: np.ndarray, bits: float) -> float:
    """No :func:`encode_symbols` output of symbols with these ``counts`` (per symbol of the
    alphabet, at least one non-zero) and order-0 entropy ``bits`` is shorter than this many
    bytes: its header, its count table, and the entropy, which no coder of a model of
    those counts goes below (the coder adds a few bits of state on top)."""
    return _HEADER.size + len(_count_table(counts)) + bits / 8


def encode_symbols(symbols: torch.Tensor, alphabet: int) -> bytes:
    """Entropy-code ``symbols`` (integers in ``[0, alphabet)``, any shape; flattened)."""
    if not 1 <= alphabet <= MAX_ALPHABET:
        raise ValueError(f"alphabet must be in [1, {MAX_ALPHABET}], got {alphabet}")
    flat = symbols.detach().reshape(-1).cpu()
    count = flat.numel()
    if count == 0:
        return _HEADER.pack(alphabet, 0, 0)
    low, high = int(flat.min()), int(flat.max())
    if low < 0 or high >= alphabet:
        raise ValueError(f"symbols lie in [{low}, {high}], outside [0, {alphabet})")
    counts = torch.bincount(flat.long(), minlength=alphabet).numpy().astype(np.uint64)
    table = _count_table(counts)
    present = int((counts > 0).sum())
    if present == 1:
        words = b""  # one symbol only: the counts say everything
    else:
        coder = constriction.stream.stack.AnsCoder()
        coder.encode_reverse(flat.numpy().astype(np.int32, copy=False), _model(counts))
        words = coder.get_compressed().tobytes()
    return _HEADER.pack(alphabet, count, len(table)) + table + words


def decode_symbols(data: Any, expected_count: int | None = None) -> torch.Tensor:
    """Inverse of :func:`encode_symbols`: an int64 tensor of the symbols.

    Pass ``expected_count`` (the caller knows it from the tensor spec): the stream must
    then hold exactly that many symbols.

    Raises:
        FormatError / CorruptCheckpointError: the stream is malformed or does not decode.
    """
    view = memoryview(data).cast("B")
    if len(view) < _HEADER.size:
        raise CorruptCheckpointError("entropy stream is shorter than its header")
    alphabet, count, table_bytes = _HEADER.unpack(view[: _HEADER.size])
    if not 1 <= alphabet <= MAX_ALPHABET or (expected_count is not None and count != expected_count):
        raise FormatError(f"entropy stream claims {count} symbols over {alphabet}, expected {expected_count}")
    if expected_count is None and count > max(1 << 20, 512 * len(view)):
        # Unchecked counts get a generous bound (1/64 bit per symbol), so a forged header
        # cannot make the decoder allocate without limit.
        raise FormatError(f"entropy stream claims {count} symbols in {len(view)} bytes")
    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    table_end = _HEADER.size + table_bytes
    if table_end > len(view):
        raise CorruptCheckpointError("entropy stream is truncated inside its count table")
    try:  # the frame's claimed size is checked before anything is allocated for it
        raw = expand_frame(view[_HEADER.size : table_end], 8 * alphabet)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(f"entropy stream count table is damaged ({exc})") from None
    counts = np.frombuffer(raw, dtype=np.uint64)
    if int(counts.sum()) != count:
        raise CorruptCheckpointError("entropy stream counts do not add up to its symbol count")
    present = np.flatnonzero(counts)
    if len(present) == 1:
        return torch.full((count,), int(present[0]), dtype=torch.int64)
    words = view[table_end:]
    if len(words) % 4 or not len(words):
        raise CorruptCheckpointError("entropy stream payload is not a whole number of 32-bit words")
    try:
        coder = constriction.stream.stack.AnsCoder(np.frombuffer(words, dtype=np.uint32).copy())
        symbols = coder.decode(_model(counts), count)
    except (ValueError, RuntimeError, AssertionError) as exc:
        raise CorruptCheckpointError(f"entropy stream does not decode ({exc})") from None
    if not coder.is_empty():
        # An intact stream ends exactly where encoding began: leftover state means damage.
        raise CorruptCheckpointError("entropy stream does not end where its symbols do; it is damaged")
    result = torch.from_numpy(np.asarray(symbols, dtype=np.int64))
    if result.numel() and int(result.max()) >= alphabet:
        raise CorruptCheckpointError("entropy stream decoded to out-of-range symbols")
    return result


# --- byte planes --------------------------------------------------------------

# zstd's ZSTD_c_literalCompressionMode (experimental parameter 5; 1 = always Huffman-code
# literals). Without it, the maximum-acceleration fast strategy stores literals raw.
_LITERAL_COMPRESSION_MODE = 1002
_HUFFMAN_OPTIONS = {
    _std_zstd.CompressionParameter.strategy: 1,  # fast
    _std_zstd.CompressionParameter.window_log: 17,  # 128 KiB blocks: one Huffman table each
    _std_zstd.CompressionParameter.hash_log: 6,
    _std_zstd.CompressionParameter.chain_log: 6,
    _std_zstd.CompressionParameter.search_log: 1,
    _std_zstd.CompressionParameter.min_match: 7,
    _std_zstd.CompressionParameter.target_length: 1 << 17,  # fast strategy: acceleration
    _LITERAL_COMPRESSION_MODE: 1,
}
# Light LZ on top of forced Huffman literals: finds runs and repeats (zeros of dead
# units, the rows of Adam's second moment) ~15% faster than stock level 1 and as small.
_LZ_OPTIONS = {
    **_HUFFMAN_OPTIONS,
    _std_zstd.CompressionParameter.hash_log: 14,
    _std_zstd.CompressionParameter.chain_log: 14,
    _std_zstd.CompressionParameter.target_length: 0,
}
# Used when the zstd build refuses the literal mode: the closest stock parameters.
_FALLBACK_PARAMETERS = zstandard.ZstdCompressionParameters(
    window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
    strategy=zstandard.STRATEGY_FAST,
)

_local = threading.local()
_huffman_checked: Optional[bool] = None
_check_lock = threading.Lock()


def byte_entropy_bits(sample: np.ndarray) -> float:
    """Order-0 entropy, in bits per byte, of a 1-D uint8 ``sample`` (0.0 when empty).

    The plug-in estimate reads about ``255 / (2 n ln 2)`` bits low on uniform bytes.
    """
    count = sample.size
    if count == 0:
        return 0.0
    counts = np.bincount(sample, minlength=256)
    counts = counts[counts > 0]
    return float(np.log2(count) - np.dot(counts, np.log2(counts)) / count)


def _huffman_works() -> bool:
    """Whether this zstd build honours the literal mode: checked once, on skewed bytes."""
    global _huffman_checked
    with _check_lock:
        if _huffman_checked is None:
            sample = (np.arange(4096) % 7 == 0).astype(np.uint8) * np.uint8(3)
            sample[::5] = 1
            try:
                compressor = _std_zstd.ZstdCompressor(options=_HUFFMAN_OPTIONS)
                frame = compressor.compress(sample, mode=compressor.FLUSH_FRAME)
                _huffman_checked = len(frame) < sample.size // 2 and (
                    zstandard.ZstdDecompressor().decompress(frame) == sample.tobytes()
                )
            except (ValueError, _std_zstd.ZstdError, zstandard.ZstdError):
                _huffman_checked = False
        return _huffman_checked


def _thread_coder(key: Any, build: Callable[[], Any]) -> Any:
    # zstd contexts are not thread-safe and cost a little to build: one per thread and kind.
    cache = getattr(_local, "coders", None)
    if cache is None:
        cache = _local.coders = {}
    coder = cache.get(key)
    if coder is None:
        coder = cache[key] = build()
    return coder


def huffman_frame(data: Any) -> bytes:
    """One zstd frame of ``data`` (a contiguous buffer), order-0 Huffman-coded in 128 KiB blocks."""
    if _huffman_checked is None:
        _huffman_works()
    if _huffman_checked:
        compressor = _thread_coder("huffman", lambda: _std_zstd.ZstdCompressor(options=_HUFFMAN_OPTIONS))
        return compressor.compress(data, mode=compressor.FLUSH_FRAME)
    fallback = _thread_coder(
        "huffman-fallback", lambda: zstandard.ZstdCompressor(compression_params=_FALLBACK_PARAMETERS)
    )
    return fallback.compress(data)


def lz_frame(data: Any, level: Optional[int] = None) -> bytes:
    """One zstd frame of ``data``: light LZ + Huffman literals, or a stock zstd ``level``."""
    if level is None:
        if _huffman_checked is None:
            _huffman_works()
        if _huffman_checked:
            compressor = _thread_coder("lz", lambda: _std_zstd.ZstdCompressor(options=_LZ_OPTIONS))
            return compressor.compress(data, mode=compressor.FLUSH_FRAME)
        level = 1
    return _thread_coder(("lz", level), lambda: zstandard.ZstdCompressor(level=level)).compress(data)


def expand_frame(frame: Any, size: int) -> bytes:
    """The ``size`` bytes one zstd ``frame`` holds.

    Raises:
        CorruptCheckpointError: the frame is damaged or does not hold exactly ``size`` bytes
            (checked before anything is allocated for it).
    """
    try:
        claimed = zstandard.frame_content_size(frame) if len(frame) >= 6 else -2
    except zstandard.ZstdError:  # not a frame header at all
        claimed = -2
    if claimed != size:
        raise CorruptCheckpointError(f"a zstd frame claims {claimed} bytes where {size} belong")
    decompressor = _thread_coder("expand", zstandard.ZstdDecompressor)
    try:
        data = decompressor.decompress(frame, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(f"a zstd frame does not decode ({exc})") from None
    if len(data) != size:
        raise CorruptCheckpointError(f"a zstd frame holds {len(data)} bytes where {size} belong")
    return data
