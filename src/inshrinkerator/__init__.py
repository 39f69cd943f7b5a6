"""inshrinkerator: training checkpoints one to two orders of magnitude smaller.

The public API::

    import inshrinkerator as ink
    info = ink.save(state, "ckpt.ink")          # -> ink.SaveInfo
    state = ink.load("ckpt.ink")
"""

from . import policies
from .activations import compress_activations
from .errors import (
    AsyncSaveError,
    BrokenChainError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatError,
    InkError,
    UnsupportedStateError,
)
from .info import SaveInfo
from .single_file import load, save
from .store import CheckpointManager

__version__ = "0.1.0"

__all__ = [
    "save",
    "load",
    "SaveInfo",
    "compress_activations",
    "CheckpointManager",
    "policies",
    "InkError",
    "FormatError",
    "CorruptCheckpointError",
    "CheckpointNotFoundError",
    "BrokenChainError",
    "UnsupportedStateError",
    "AsyncSaveError",
    "__version__",
]
