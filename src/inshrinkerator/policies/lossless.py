"""The lossless policy: every tensor comes back bit for bit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch

from ..codecs import ByteGroupingCodec, Codec, RawCodec, XorDeltaCodec
from ..tree import TensorLeaf
from .base import Policy

__all__ = ["Lossless"]


@dataclass(frozen=True)
class Lossless(Policy):
    """Byte grouping + zstd; XOR delta against a reference when one of the same kind exists.

    Args:
        level: ``None`` (default) lets the byte-grouping codec choose its zstd coder per
            byte plane (the fastest and, on weights, the smallest); an int forces that
            stock zstd level.
        small_bytes: tensors smaller than this are stored raw (coding them costs more
            than it saves).

    Raises:
        ValueError: an option is out of range.
    """

    level: Optional[int] = None
    small_bytes: int = 256
    name: str = "lossless"

    def __post_init__(self) -> None:
        ByteGroupingCodec(level=self.level)  # validates the level
        if not isinstance(self.small_bytes, int) or isinstance(self.small_bytes, bool) or self.small_bytes < 0:
            raise ValueError(f"small_bytes must be a non-negative int, got {self.small_bytes!r}")

    def plan(
        self,
        leaves: Sequence[TensorLeaf],
        references: Sequence[Optional[torch.Tensor]],
    ) -> list[Codec]:
        grouping = ByteGroupingCodec(level=self.level)
        delta = XorDeltaCodec(inner=grouping.get_config())
        raw = RawCodec()
        codecs: list[Codec] = []
        for leaf, reference in zip(leaves, references):
            tensor = leaf.tensor
            if tensor.numel() * tensor.element_size() < self.small_bytes:
                codecs.append(raw)
            elif (
                reference is not None
                and reference.dtype == tensor.dtype
                and reference.shape == tensor.shape
            ):
                codecs.append(delta)
            else:
                codecs.append(grouping)
        return codecs
