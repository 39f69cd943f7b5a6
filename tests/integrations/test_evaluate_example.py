"""examples/evaluate_digits.py: plain PyTorch, DynaQuant searching by the user's validation loss."""

from __future__ import annotations

from tests.integrations.conftest import load_example


def test_the_search_keeps_each_checkpoint_within_the_users_tolerance(tmp_path) -> None:
    summary = load_example("evaluate_digits").main(
        ["--out", str(tmp_path / "run"), "--steps", "120", "--every", "30", "--tolerance", "0.02"]
    )
    records = summary["search"]
    assert len(records) == 4 and all(r["evaluations"] >= 1 for r in records)
    # evaluate decided: every stored point's validation-loss rise is within the tolerance.
    assert all(r["quality"] is not None and r["quality"] <= 0.02 for r in records)
    assert summary["ratio"] > 5  # weights quantized and Adam's moments too (lossless: ~1.5x)
    assert summary["accuracy_restored"] >= summary["accuracy_trained"] - 0.02
