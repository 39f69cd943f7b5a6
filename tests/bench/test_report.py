"""``run_bench`` writes results.json, report.md and the plots; the checks read the rows."""

from __future__ import annotations

import json

import pytest

from inshrinkerator.bench import run_bench
from inshrinkerator.bench.paper_checks import paper_checks
from inshrinkerator.bench.plots import PLOT_FILES

# zipnn (a lossless reference row) triggers torch's own deprecation of torch.jit.script.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")



def test_bench_writes_json_report_and_plots(tiny: str, tmp_path) -> None:
    results = run_bench(tmp_path, quick=True, workloads=[tiny], policies=["lossless"], seeds=2)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["meta"]["seeds"] == {"tiny": 2} and "commit" in saved["meta"]
    assert {r["policy"] for r in saved["rows"]} == {"torch.save", "zstd", "zipnn", "lossless"}
    report = (tmp_path / "report.md").read_text()
    assert "| tiny | lossless |" in report and "| tiny | zipnn † |" in report
    assert str(saved["meta"]["commit"]) in report
    for name in PLOT_FILES.values():
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results["rows"] == saved["rows"]
    # Notes added to the results' meta (where runs were merged from elsewhere) are rendered.
    from inshrinkerator.bench.report import render_report

    assert "Note:" not in report
    saved["meta"]["notes"] = ["the lossless rows ran on another machine"]
    assert "\nNote: the lossless rows ran on another machine\n" in render_report(saved)


def _row(workload: str, policy: str, weights: float, deg: float = 0.0) -> dict:
    cell = lambda v: {"mean": v, "std": 0.1, "min": v, "max": v, "n": 3}  # noqa: E731
    return {
        "workload": workload, "policy": policy, "kind": "policy", "seeds": 3,
        "cr_weights": cell(weights), "cr_full": cell(weights / 2), "deg_pct": cell(deg),
        "class_stored": {}, "per_checkpoint_ratio": [],
    }


def test_lc_bits_check_reads_the_sweep() -> None:
    rising = [_row("digits-cnn", "lc-checkpoint:bits=2", 30), _row("digits-cnn", "lc-checkpoint", 20),
              _row("digits-cnn", "lc-checkpoint:bits=4", 10)]
    flat = [_row("digits-cnn", "lc-checkpoint:bits=2", 10), _row("digits-cnn", "lc-checkpoint", 20)]
    (check,) = [c for c in paper_checks(rising) if "bits fall" in c["claim"]]
    assert check["holds"] is True and "30.00" in check["evidence"]
    (check,) = [c for c in paper_checks(flat) if "bits fall" in c["claim"]]
    assert check["holds"] is False


def test_sgd_vs_adam_check_compares_the_two_digits_runs() -> None:
    rows = [_row("digits-cnn", "lc-checkpoint", 20, deg=0.2), _row("digits-cnn-sgd", "lc-checkpoint", 20, deg=3.0)]
    (check,) = [c for c in paper_checks(rows) if "SGD" in c["claim"]]
    assert check["holds"] is True and "+2.80" in check["evidence"]


def test_dynaquant_check_holds_only_inside_the_papers_range() -> None:
    rows = [_row("digits-cnn", "dynaquant", 21.2, deg=0.3), _row("stdlib-char-gpt", "dynaquant", 27.0, deg=0.3),
            _row("minilm-docstrings", "dynaquant", 30.0, deg=1.5)]
    checks = {c["claim"].rsplit("(", 1)[1].rstrip(")"): c for c in paper_checks(rows) if c["baseline"] == "dynaquant"}
    assert "(26-39x)" in checks["digits-cnn"]["claim"]
    assert [checks[w]["holds"] for w in ("digits-cnn", "stdlib-char-gpt", "minilm-docstrings")] == [False, True, False]
