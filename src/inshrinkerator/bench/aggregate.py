"""From raw run records (JSON-ready dicts) to the report's rows: one per workload x policy,
each metric as a spread over seeds (DESIGN.md §5 definitions)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .measures import TENSOR_CLASSES, degradation_percent, ratio, spread

__all__ = ["run_metrics", "lossless_metrics", "aggregate_rows", "METRICS"]

#: Metric keys of a row, in table order.
METRICS = ("deg_pct", "cr_full", "cr_weights", "ovh_pct", "compress_mbps", "restore_mbps", "restore_ratio")

_MB = 1e6


def _degradation(reference: dict[str, Any], evaluation: dict[str, Any]) -> float:
    base = reference["evaluation"]
    return degradation_percent(base["value"], evaluation["value"], base["higher_is_better"])


def run_metrics(run: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    """The metrics of one failure-recovery run against the uninterrupted run of its seed."""
    checkpoints, restores = run["checkpoints"], run["restores"]
    raw = sum(c["raw_bytes"] for c in checkpoints)
    save_seconds = sum(c["seconds"] for c in checkpoints)
    loaded = [r for r in restores if r["restored_step"] is not None]
    restore_seconds = sum(r["seconds"] for r in loaded)
    torch_load_seconds = sum(r["torch_load_seconds"] for r in loaded)
    classes = run["class_bytes"]
    return {
        "deg_pct": _degradation(reference, run["evaluation"]),
        "cr_full": ratio(raw, run["stored_bytes_on_disk"]),
        "cr_weights": ratio(classes["raw"]["weights"], classes["stored"]["weights"]),
        "ovh_pct": 100.0 * run["blocked_seconds"] / max(run["train_seconds"], 1e-9),
        "compress_mbps": raw / _MB / max(save_seconds, 1e-9),
        "restore_mbps": sum(r["raw_bytes"] for r in loaded) / _MB / max(restore_seconds, 1e-9),
        "restore_ratio": restore_seconds / torch_load_seconds if torch_load_seconds else float("nan"),
    }


def lossless_metrics(totals: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    """The metrics of a lossless reference row measured on the uninterrupted run's states."""
    return {
        "deg_pct": 0.0 if totals["exact"] else float("nan"),
        "cr_full": ratio(totals["raw_bytes"], totals["stored_bytes"]),
        "cr_weights": ratio(totals["weights_raw_bytes"], totals["weights_stored_bytes"]),
        "ovh_pct": 100.0 * totals["pack_seconds"] / max(reference["train_seconds"], 1e-9),
        "compress_mbps": totals["raw_bytes"] / _MB / max(totals["pack_seconds"], 1e-9),
        "restore_mbps": totals["raw_bytes"] / _MB / max(totals["unpack_seconds"], 1e-9),
        "restore_ratio": totals["unpack_seconds"] / max(totals["torch_load_seconds"], 1e-9),
    }


def _mean_classes(records: list[dict[str, int]]) -> dict[str, float]:
    return {name: sum(r.get(name, 0) for r in records) / max(len(records), 1) for name in TENSOR_CLASSES}


def aggregate_rows(references: list[dict[str, Any]], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows ``{workload, policy, kind, seeds, <metric>: spread, ...}``: lossless reference rows
    first, then policies, in the order they were run."""
    by_seed = {(r["workload"], r["seed"]): r for r in references}
    grouped: dict[tuple[str, str, str], list[tuple[dict[str, float], dict[str, Any]]]] = defaultdict(list)
    for reference in references:
        for name, totals in reference["lossless"].items():
            extra = {
                "class_stored": totals["class_stored"],
                "per_checkpoint_ratio": [
                    [reference["checkpoint_every"] * (i + 1), value]
                    for i, value in enumerate(totals["per_checkpoint_ratio"])
                ],
                "exact": totals["exact"],
            }
            grouped[(reference["workload"], name, "lossless-reference")].append(
                (lossless_metrics(totals, reference), extra)
            )
    for run in runs:
        reference = by_seed.get((run["workload"], run["seed"]))
        if reference is None:
            continue
        extra = {
            "class_stored": run["class_bytes"]["stored"],
            "class_raw": run["class_bytes"]["raw"],
            "per_checkpoint_ratio": [
                [c["step"], ratio(c["raw_bytes"], c["stored_bytes"])] for c in run["checkpoints"]
            ],
            "final_metric": run["evaluation"]["value"],
        }
        label = run.get("label", run["policy"])
        grouped[(run["workload"], label, "policy")].append((run_metrics(run, reference), extra))
    rows = []
    for (workload, policy, kind), items in grouped.items():
        row: dict[str, Any] = {"workload": workload, "policy": policy, "kind": kind, "seeds": len(items)}
        for metric in METRICS:
            row[metric] = spread([m[metric] for m, _ in items])
        row["class_stored"] = _mean_classes([e["class_stored"] for _, e in items])
        if "class_raw" in items[0][1]:
            row["class_raw"] = _mean_classes([e["class_raw"] for _, e in items])
        row["per_checkpoint_ratio"] = items[0][1]["per_checkpoint_ratio"]
        if "final_metric" in items[0][1]:
            row["final_metric"] = spread([e["final_metric"] for _, e in items])
        rows.append(row)
    return rows
