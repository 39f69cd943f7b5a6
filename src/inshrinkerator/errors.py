"""The error types of inshrinkerator.

Each is also a subclass of the builtin that ordinary code already catches, so
``except ValueError`` or ``except FileNotFoundError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "InkError",
    "FormatError",
    "CorruptCheckpointError",
    "CheckpointNotFoundError",
    "BrokenChainError",
    "UnsupportedStateError",
    "AsyncSaveError",
]


class InkError(Exception):
    """Base class of every error raised on purpose by inshrinkerator."""


class FormatError(InkError, ValueError):
    """The bytes are not a valid inshrinkerator file (wrong magic, bad header, bad layout)."""


class CorruptCheckpointError(FormatError):
    """A checksum does not match or the file is truncated: the bytes were damaged."""


class CheckpointNotFoundError(InkError, FileNotFoundError):
    """The file, run or step asked for does not exist."""


class BrokenChainError(InkError):
    """A delta checkpoint's base (a previous checkpoint or a reference state) is missing or wrong."""


class UnsupportedStateError(InkError, TypeError):
    """The state holds a value that cannot be stored; the message names its key path."""


class AsyncSaveError(InkError, RuntimeError):
    """A background save failed; ``__cause__`` is the original exception.

    Every step committed before it is intact. The step it was saving is in the run only
    if the failure came after its commit (in retention): check ``CheckpointManager.steps()``.
    """
