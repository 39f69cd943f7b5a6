"""``inshrink demo``: the main job in about a minute.

Trains the digits CNN twice: once uninterrupted, once checkpointing through a
``CheckpointManager`` with its default policy while the run is crashed 10 times and
resumed each time from the latest compressed checkpoint. Prints what was stored, the
ratio, and the final accuracy of both runs.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Optional

from rich.console import Console
from rich.table import Table

from ..store import default_policy_name
from .aggregate import run_metrics
from .recovery import run_reference, run_with_failures, torch_threads

__all__ = ["run_demo"]

_WORKLOAD = "digits-cnn"


def _mb(count: float) -> str:
    return f"{count / 1e6:.2f} MB"


def run_demo(console: Optional[Console] = None, quick: bool = False) -> dict[str, Any]:
    """Run the demo and print its story; returns the numbers it printed.

    ``quick`` uses the seconds-long sizes (for tests).
    """
    console = console or Console()
    policy = default_policy_name()
    with torch_threads(1):
        console.print(f"[bold]inshrink demo[/]: a CNN on scikit-learn's digits, policy [cyan]{policy}[/]")
        with console.status("training the uninterrupted reference run..."):
            reference = run_reference(_WORKLOAD, 0, quick)
        with tempfile.TemporaryDirectory(prefix="ink-demo-") as folder:
            with console.status("training again with compressed checkpoints and 10 crashes..."):
                run = run_with_failures(_WORKLOAD, 0, quick, policy, Path(folder) / "run")
    metrics = run_metrics(run.to_dict(), reference.to_dict())

    table = Table(title=f"checkpoints written ({len(run.checkpoints)})")
    for column in ("step", "kind", "raw", "stored", "ratio"):
        table.add_column(column, justify="right")
    for record in run.checkpoints:
        table.add_row(
            str(record.step), record.kind, _mb(record.raw_bytes), _mb(record.stored_bytes),
            f"{record.raw_bytes / max(record.stored_bytes, 1):.1f}x",
        )
    console.print(table)
    restored = [r for r in run.restores if r.restored_step is not None]
    console.print(
        f"crashes: {len(run.restores)}, each resumed from the latest checkpoint "
        f"(steps {', '.join(str(r.restored_step) for r in restored)})"
    )
    classes = run.class_bytes
    console.print(
        f"stored: {_mb(run.stored_bytes_on_disk)} on disk for {_mb(run.raw_bytes)} of raw state: "
        f"[bold green]{metrics['cr_full']:.1f}x[/] smaller (weights alone "
        f"{metrics['cr_weights']:.1f}x; Adam moments {_mb(classes.stored['first_moment'] + classes.stored['second_moment'])} "
        f"for {_mb(classes.raw['first_moment'] + classes.raw['second_moment'])})"
    )
    console.print(
        f"final test accuracy: [bold]{run.evaluation.value:.4f}[/] with crashes and compressed "
        f"restores vs [bold]{reference.evaluation.value:.4f}[/] uninterrupted "
        f"(degradation {metrics['deg_pct']:+.2f} %)"
    )
    return {
        "workload": _WORKLOAD,
        "policy": run.policy,
        "checkpoints": len(run.checkpoints),
        "failures": len(run.restores),
        "raw_bytes": run.raw_bytes,
        "stored_bytes": run.stored_bytes_on_disk,
        "ratio": metrics["cr_full"],
        "ratio_weights": metrics["cr_weights"],
        "accuracy": run.evaluation.value,
        "reference_accuracy": reference.evaluation.value,
        "degradation_pct": metrics["deg_pct"],
    }
