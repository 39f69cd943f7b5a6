"""What a save reports."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, Optional

__all__ = ["SaveInfo"]


@dataclass(frozen=True)
class SaveInfo:
    """The result of one save.

    Attributes:
        step: the training step (``None`` for a one-shot :func:`inshrinkerator.save`).
        kind: ``"full"``, or ``"delta"`` when stored against a previous checkpoint or a base.
        raw_bytes: bytes of every distinct tensor of the state, in its own dtype.
        stored_bytes: bytes written for it (data and metadata).
        ratio: ``raw_bytes / stored_bytes``.
        seconds: wall time of the save (for an async save: the time the caller was blocked).
        policy: the policy's name.
    """

    step: Optional[int]
    kind: Literal["full", "delta"]
    raw_bytes: int
    stored_bytes: int
    ratio: float
    seconds: float
    policy: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
