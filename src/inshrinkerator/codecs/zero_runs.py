"""Run-length tokens for integer streams dominated by one symbol (zero).

A stream of ``count`` values in ``[0, levels)`` becomes *tokens*: every
non-zero value ``v`` is the token ``v - 1``; every maximal run of ``r >= 1``
zeros is one *run token*: ``levels - 1 + (r - 1)`` for a short run
(``r <= SHORT_RUNS``, its length modelled exactly by the entropy coder), else
``levels - 1 + SHORT_RUNS + (c - SHORT_CLASS)`` with class ``c = floor(log2 r)``
plus ``c`` extra bits (``r - 2**c``, most significant first) in a separate
packed bit string. Dense streams keep about one token per value; a stream of
deltas that are mostly zero shrinks to about two tokens per non-zero value,
which makes the entropy stage both smaller and fast.

The stream is given and returned *sparse* — the positions and values of its
non-zero entries — so that a mostly-zero stream is never materialised.
"""

from __future__ import annotations

import torch

from ..errors import CorruptCheckpointError
from ._numpy_paths import nonzero_positions, select

__all__ = ["MAX_RUN_CLASSES", "SHORT_RUNS", "RunTokens", "to_run_tokens", "from_run_tokens", "token_alphabet"]

#: Runs up to 2**MAX_RUN_CLASSES - 1 zeros fit one token (longer than any tensor).
MAX_RUN_CLASSES = 48
#: Runs of at most this many zeros have a token of their own.
SHORT_RUNS = 16
_SHORT_CLASS = SHORT_RUNS.bit_length() - 1  # the class of SHORT_RUNS; longer runs start at it
_LONG_CLASSES = MAX_RUN_CLASSES - _SHORT_CLASS


def token_alphabet(levels: int) -> int:
    """Size of the token alphabet for values in ``[0, levels)``."""
    return levels - 1 + SHORT_RUNS + _LONG_CLASSES


class RunTokens:
    """Tokens (int64) and the packed extra bits of their runs."""

    __slots__ = ("tokens", "extra_bits", "extra_bit_count")

    def __init__(self, tokens: torch.Tensor, extra_bits: bytes, extra_bit_count: int) -> None:
        self.tokens = tokens
        self.extra_bits = extra_bits
        self.extra_bit_count = extra_bit_count


_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int64)


def _pack_bits(bits: torch.Tensor) -> bytes:
    if bits.numel() == 0:
        return b""
    padded = torch.nn.functional.pad(bits, (0, (-bits.numel()) % 8))
    packed = (padded.reshape(-1, 8) * _BIT_WEIGHTS.to(bits.device)).sum(1)
    return packed.to(torch.uint8).cpu().numpy().tobytes()


def _unpack_bits(data: bytes, count: int) -> torch.Tensor:
    if len(data) != -(-count // 8):
        raise CorruptCheckpointError(
            f"run-length extra bits: {len(data)} bytes cannot hold exactly {count} bits"
        )
    if count == 0:
        return torch.empty(0, dtype=torch.int64)
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    bits = (raw.reshape(-1, 1) >> torch.arange(7, -1, -1)) & 1
    return bits.reshape(-1)[:count]


def _classes(lengths: torch.Tensor) -> torch.Tensor:
    # floor(log2 r) exactly, for r >= 1: the exponent field of r as a float64 (exact for
    # every run length a tensor can have), read with integer operations.
    return ((lengths.double().view(torch.int64) >> 52) - 1023).to(lengths.dtype)


def _index_dtype(count: int) -> torch.dtype:
    # Positions and run lengths in int32 when they fit: half the memory traffic of int64.
    return torch.int32 if count < (1 << 31) - 1 else torch.int64


def _extra_bits(runs: torch.Tensor, run_classes: torch.Tensor) -> tuple[bytes, int]:
    """The low ``class`` bits of every long run, most significant first, packed."""
    total_bits = int(run_classes.sum())
    if not total_bits:
        return b"", 0
    runs, run_classes = runs.long(), run_classes.long()
    extras = runs - (torch.ones_like(runs) << run_classes)
    owner = torch.repeat_interleave(torch.arange(runs.numel(), device=runs.device), run_classes)
    starts = torch.cumsum(run_classes, 0) - run_classes
    shift = run_classes[owner] - 1 - (torch.arange(total_bits, device=runs.device) - starts[owner])
    return _pack_bits((extras[owner] >> shift) & 1), total_bits


def to_run_tokens(positions: torch.Tensor, values: torch.Tensor, count: int, levels: int) -> RunTokens:
    """Tokenize a stream of ``count`` values given by its non-zero entries.

    Args:
        positions: strictly increasing int positions of the non-zero values.
        values: their values, in ``[1, levels)``.
        count: the stream's length.
        levels: the value alphabet size.

    The tokens come back in the smallest integer dtype that holds the alphabet.
    """
    dtype = _index_dtype(count)
    device = positions.device
    positions = positions.reshape(-1).to(dtype)
    values = values.reshape(-1)
    nonzero = positions.numel()
    # gaps[k]: the zeros before the k-th non-zero value (the last one: the trailing run).
    gaps = torch.empty(nonzero + 1, dtype=dtype, device=device)
    gaps[0] = positions[0] if nonzero else count
    if nonzero:
        torch.sub(positions[1:], positions[:-1], out=gaps[1:nonzero])
        gaps[1:nonzero] -= 1
        gaps[nonzero] = count - 1 - positions[-1]
    token_dtype = torch.uint8 if token_alphabet(levels) <= 256 else torch.int16 if token_alphabet(levels) < 1 << 15 else torch.int32
    # Interleave: gap_0, value_0, gap_1, value_1, ..., gap_last (the trailing run), the
    # empty runs then dropped. In place where it can be: every large temporary costs
    # more to allocate than to fill.
    slots = torch.empty(2 * nonzero + 1, dtype=dtype, device=device)
    run_slots = slots[0::2]
    torch.add(gaps, levels - 2, out=run_slots)  # short runs: levels - 1 + (r - 1)
    long_positions = nonzero_positions(gaps > SHORT_RUNS)
    runs = gaps.index_select(0, long_positions)
    run_classes = _classes(runs) if runs.numel() else runs
    run_slots.index_copy_(0, long_positions, run_classes + (levels - 1 + SHORT_RUNS - _SHORT_CLASS))
    value_slots = slots[1::2]
    value_slots.copy_(values)
    value_slots -= 1
    tokens = slots.to(token_dtype)
    runs_present = gaps != 0
    if not bool(runs_present.all()):
        keep = torch.ones(slots.numel(), dtype=torch.bool, device=device)
        keep[0::2] = runs_present
        tokens = select(tokens, keep)
    extra_bits, total_bits = _extra_bits(runs, run_classes)
    return RunTokens(tokens, extra_bits, total_bits)


def _token_lengths(levels: int, device: torch.device) -> torch.Tensor:
    # Per token: how many values it stands for (long runs: 2**class, their extra bits added later).
    alphabet = token_alphabet(levels)
    lengths = torch.ones(alphabet, dtype=torch.int64, device=device)
    lengths[levels - 1 : levels - 1 + SHORT_RUNS] = torch.arange(1, SHORT_RUNS + 1, device=device)
    lengths[levels - 1 + SHORT_RUNS :] = torch.ones(_LONG_CLASSES, dtype=torch.int64, device=device) << torch.arange(
        _SHORT_CLASS, MAX_RUN_CLASSES, device=device
    )
    return lengths


def from_run_tokens(
    tokens: torch.Tensor, extra_bits: bytes, extra_bit_count: int, levels: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`to_run_tokens`: ``(positions, values)`` of the non-zero entries.

    ``tokens`` may be of any integer dtype. Positions come back as int32 (int64 for
    streams of 2**31 values or more), values as int64.

    Raises:
        CorruptCheckpointError: the tokens and bits do not describe exactly ``count`` values.
    """
    tokens = tokens.reshape(-1)
    device = tokens.device
    if tokens.numel() > count:
        raise CorruptCheckpointError(f"{tokens.numel()} run-length tokens for only {count} values")
    alphabet = token_alphabet(levels)
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= alphabet):
        raise CorruptCheckpointError("run-length tokens lie outside their alphabet")
    dtype = _index_dtype(count)
    index = tokens if tokens.dtype in (torch.int32, torch.int64) else tokens.int()
    # Run classes too long for this tensor are refused below; capping them first lets the
    # lengths be int32, and the int64 sum check comes before any (then monotone) prefix sum.
    lengths = _token_lengths(levels, device).clamp(max=max(count, 1)).to(dtype).index_select(0, index)
    long_positions = torch.nonzero(index >= levels - 1 + SHORT_RUNS).reshape(-1)
    run_classes = index.index_select(0, long_positions).long() - (levels - 1 + SHORT_RUNS) + _SHORT_CLASS
    if run_classes.numel() and int(run_classes.max()) >= max(count.bit_length(), 1):
        raise CorruptCheckpointError("a run-length token claims a run longer than the tensor")
    total_bits = int(run_classes.sum())
    if total_bits != extra_bit_count:
        raise CorruptCheckpointError(
            f"run-length tokens need {total_bits} extra bits, the stream holds {extra_bit_count}"
        )
    if total_bits:
        bits = _unpack_bits(extra_bits, extra_bit_count).to(device)
        owner = torch.repeat_interleave(torch.arange(run_classes.numel(), device=device), run_classes)
        starts = torch.cumsum(run_classes, 0) - run_classes
        shift = run_classes[owner] - 1 - (torch.arange(total_bits, device=device) - starts[owner])
        extras = torch.zeros(run_classes.numel(), dtype=torch.int64, device=device).index_add_(0, owner, bits << shift)
        lengths.index_add_(0, long_positions, extras.to(lengths.dtype))
    elif len(extra_bits):
        raise CorruptCheckpointError("run-length extra bits are present where no long run needs them")
    total = int(lengths.sum(dtype=torch.int64))
    if total != count:
        raise CorruptCheckpointError(f"run-length tokens describe {total} values, expected {count}")
    ends = torch.cumsum(lengths, 0, dtype=lengths.dtype)
    value_tokens = index < levels - 1
    positions = ends.masked_select(value_tokens)
    positions -= 1
    return positions, index.masked_select(value_tokens).long() + 1
