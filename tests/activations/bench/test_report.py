from pathlib import Path

from inshrinkerator.activations.bench.report import markdown_report, write_report


def _results() -> dict:
    row = {
        "saved_bytes": 8 << 20, "reduction": 1.0, "codec_reported_bytes": None, "forward_rss_growth": 8 << 20,
        "peak_rss": 400 << 20, "peak_rss_change": 0, "step_seconds": 0.03, "step_overhead_percent": 0.0,
        "metric_mean": 98.5, "metric_spread": 0.2, "metric_change": 0.0,
    }
    ink = dict(row, saved_bytes=1 << 19, reduction=16.0, codec_reported_bytes=1 << 19, metric_change=-0.1,
               bounds={"conv#0": 0.02}, codecs={"sz3-nopred": 3})
    return {
        "meta": {"commit": "abc1234", "torch": "2.x", "threads": 1, "quick": True, "date": "today",
                 "command": "python -m inshrinkerator.activations.bench --quick"},
        "workloads": {"digits-cnn": {"description": "a CNN", "primary_metric": "accuracy", "steps": 10,
                                     "batch_size": 64, "memory_batch_size": 512, "seeds": [0],
                                     "methods": {"none": row, "ink-auto": ink}}},
        "acceptance": {"passed": True},
    }


def test_markdown_has_a_row_per_method() -> None:
    text = markdown_report(_results())
    assert "| none | 8.00 | 1.0x |" in text
    assert "| ink-auto | 0.50 | 16.0x | 0.50 |" in text
    assert "conv#0: 0.020" in text and "passed: True" in text


def test_write_report_writes_three_files(tmp_path: Path) -> None:
    paths = write_report(_results(), tmp_path / "out")
    assert all(path.exists() and path.stat().st_size > 0 for path in paths.values())
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"
