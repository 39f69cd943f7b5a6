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


def _classes(lengths: torch.Tensor, count: int) -> torch.Tensor:
    # floor(log2 r) exactly: frexp gives r = m * 2**e with m in [0.5, 1); float32 holds
    # every run length exactly below 2**24.
    exact = lengths.float() if count < 1 << 24 else lengths.double()
    return torch.frexp(exact)[1].long() - 1


def to_run_tokens(positions: torch.Tensor, values: torch.Tensor, count: int, levels: int) -> RunTokens:
    """Tokenize a stream of ``count`` values given by its non-zero entries.

    Args:
        positions: strictly increasing int positions of the non-zero values.
        values: their values, in ``[1, levels)``.
        count: the stream's length.
        levels: the value alphabet size.
    """
    positions = positions.reshape(-1).long().cpu()
    values = values.reshape(-1).long().cpu()
    previous = torch.cat([torch.tensor([-1]), positions])
    gaps = torch.cat([positions, torch.tensor([count])]) - previous - 1
    # Interleave: gap_0, value_0, gap_1, value_1, ..., gap_last (the trailing run).
    slots = torch.empty(2 * positions.numel() + 1, dtype=torch.int64)
    long_run = gaps > SHORT_RUNS
    classes = torch.where(long_run, _classes(gaps.clamp_min(1), count), 0)
    slots[0::2] = levels - 1 + torch.where(long_run, SHORT_RUNS + classes - _SHORT_CLASS, gaps - 1)
    slots[1::2] = values - 1
    keep = torch.ones(slots.numel(), dtype=torch.bool)
    keep[0::2] = gaps > 0
    tokens = slots[keep]
    runs = gaps[long_run]
    run_classes = classes[long_run]
    total_bits = int(run_classes.sum())
    if total_bits:
        extras = runs - (torch.ones_like(runs) << run_classes)
        owner = torch.repeat_interleave(torch.arange(runs.numel()), run_classes)
        starts = torch.cumsum(run_classes, 0) - run_classes
        shift = run_classes[owner] - 1 - (torch.arange(total_bits) - starts[owner])
        bits = (extras[owner] >> shift) & 1
    else:
        bits = torch.empty(0, dtype=torch.int64)
    return RunTokens(tokens, _pack_bits(bits), total_bits)


def from_run_tokens(
    tokens: torch.Tensor, extra_bits: bytes, extra_bit_count: int, levels: int, count: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`to_run_tokens`: ``(positions, values)`` of the non-zero entries (int64).

    Raises:
        CorruptCheckpointError: the tokens and bits do not describe exactly ``count`` values.
    """
    tokens = tokens.reshape(-1).long()
    if tokens.numel() > count:
        raise CorruptCheckpointError(f"{tokens.numel()} run-length tokens for only {count} values")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= token_alphabet(levels)):
        raise CorruptCheckpointError("run-length tokens lie outside their alphabet")
    is_run = tokens >= levels - 1
    is_long = tokens >= levels - 1 + SHORT_RUNS
    run_classes = tokens[is_long] - (levels - 1 + SHORT_RUNS) + _SHORT_CLASS
    if run_classes.numel() and int(run_classes.max()) >= max(count.bit_length(), 1):
        raise CorruptCheckpointError("a run-length token claims a run longer than the tensor")
    total_bits = int(run_classes.sum())
    if total_bits != extra_bit_count:
        raise CorruptCheckpointError(
            f"run-length tokens need {total_bits} extra bits, the stream holds {extra_bit_count}"
        )
    bits = _unpack_bits(extra_bits, extra_bit_count)
    long_runs = torch.ones(run_classes.numel(), dtype=torch.int64) << run_classes
    if total_bits:
        owner = torch.repeat_interleave(torch.arange(run_classes.numel()), run_classes)
        starts = torch.cumsum(run_classes, 0) - run_classes
        shift = run_classes[owner] - 1 - (torch.arange(total_bits) - starts[owner])
        long_runs.index_add_(0, owner, bits << shift)
    runs = tokens - (levels - 2)
    runs[is_long] = long_runs
    lengths = torch.where(is_run, runs, 1)
    if int(lengths.sum()) != count:
        raise CorruptCheckpointError(
            f"run-length tokens describe {int(lengths.sum())} values, expected {count}"
        )
    starts = torch.cumsum(lengths, 0) - lengths
    value_tokens = ~is_run
    return starts[value_tokens], tokens[value_tokens] + 1
