"""The yardstick's arithmetic (DESIGN.md §5): ratios, degradation, spread, and the stored
bytes of a run split by tensor class, read back from the files the store wrote."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from ..container import ContainerReader
from ..errors import FormatError
from ..tensor_classes import TENSOR_CLASSES, ClassBytes, container_class_bytes, tensor_class

__all__ = [
    "TENSOR_CLASSES",
    "ClassBytes",
    "degradation_percent",
    "ratio",
    "spread",
    "tensor_class",
    "run_class_bytes",
    "directory_bytes",
]


def degradation_percent(base: float, got: float, higher_is_better: bool) -> float:
    """Relative change of the final metric against the uninterrupted run, in percent.

    Accuracy-like (higher is better): ``(base - got) / base``; loss-like: ``(got - base) / base``.
    Positive means worse. ``ValueError`` when ``base`` is 0 (no relative change exists).
    """
    if base == 0:
        raise ValueError("the uninterrupted run's metric is 0: relative degradation is undefined")
    change = (base - got) if higher_is_better else (got - base)
    return 100.0 * change / abs(base)


def ratio(raw_bytes: float, stored_bytes: float) -> float:
    """``raw / stored``; ``inf`` when nothing was stored for a non-empty raw size."""
    if stored_bytes <= 0:
        return math.inf if raw_bytes > 0 else 1.0
    return raw_bytes / stored_bytes


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value), min and max of ``values``."""
    if not values:
        raise ValueError("spread of no values")
    count = len(values)
    mean = sum(values) / count
    variance = sum((v - mean) ** 2 for v in values) / (count - 1) if count > 1 else 0.0
    return {"mean": mean, "std": math.sqrt(variance), "min": min(values), "max": max(values), "n": count}


def run_class_bytes(files: Iterable[Path]) -> ClassBytes:
    """:func:`container_class_bytes` summed over every ``.ink`` container among ``files``;
    other files (manifests, markers) are skipped."""
    total = ClassBytes()
    for path in files:
        with open(path, "rb") as handle:
            try:
                reader = ContainerReader(handle, str(path))
            except FormatError:
                continue
            total.add(container_class_bytes(reader))
    return total


def directory_bytes(root: Path) -> tuple[int, list[Path]]:
    """Total size of every file under ``root`` and the list of those files."""
    files = [Path(d) / name for d, _, names in os.walk(root) for name in names]
    return sum(p.stat().st_size for p in files), files
