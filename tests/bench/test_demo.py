"""``inshrink demo`` prints its story and returns the numbers it printed."""

from __future__ import annotations

import io

from rich.console import Console

from inshrinkerator.bench import run_demo
from inshrinkerator.store import default_policy_name


def test_demo_reports_ratio_and_both_accuracies() -> None:
    buffer = io.StringIO()
    result = run_demo(console=Console(file=buffer, width=120), quick=True)
    text = buffer.getvalue()
    assert result["policy"] == default_policy_name()
    assert result["failures"] == 10 and result["checkpoints"] == 12
    assert result["ratio"] == result["raw_bytes"] / result["stored_bytes"]
    assert f"{result['accuracy']:.4f}" in text and f"{result['reference_accuracy']:.4f}" in text
    assert f"{result['ratio']:.1f}x" in text
