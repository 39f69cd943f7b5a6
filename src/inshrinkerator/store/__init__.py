"""Runs of checkpoints: full and delta steps, retention, atomic commit, async saves, fsspec.

``CheckpointManager`` writes and reads a run; ``describe_run``, ``run_class_bytes``,
``verify_run`` and ``is_run`` inspect one without writing (they back ``inshrink info`` /
``verify``).
"""

from .async_worker import AsyncSaveError
from .inspection import RunEntry, describe_run, is_run, run_class_bytes, verify_run
from .manager import CheckpointManager, default_policy_name, policy_or_default, watch_with

__all__ = [
    "CheckpointManager",
    "AsyncSaveError",
    "RunEntry",
    "describe_run",
    "run_class_bytes",
    "verify_run",
    "is_run",
    "default_policy_name",
    "policy_or_default",
    "watch_with",
]
