"""The benchmark's PNG plots (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .measures import TENSOR_CLASSES  # noqa: E402
from .recovery import failure_steps  # noqa: E402

__all__ = ["write_plots", "PLOT_FILES"]

PLOT_FILES = {
    "ratio_vs_degradation": "ratio_vs_degradation.png",
    "per_checkpoint_ratio": "per_checkpoint_ratio.png",
    "stored_by_class": "stored_by_class.png",
}

_CLASS_COLORS = {"weights": "#4c72b0", "first_moment": "#dd8452", "second_moment": "#55a868", "other": "#8c8c8c"}


def _grid(count: int) -> tuple[Any, list[Any]]:
    columns = min(count, 2)
    rows = math.ceil(count / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6.5 * columns, 4.2 * rows), squeeze=False)
    flat = [a for row in axes for a in row]
    for extra in flat[count:]:
        extra.set_visible(False)
    return figure, flat[:count]


def _workloads(results: dict[str, Any]) -> list[str]:
    return list(results["workloads"])


def _policy_colors(rows: list[dict[str, Any]]) -> dict[str, Any]:
    names = sorted({r["policy"] for r in rows})
    cmap = plt.get_cmap("tab20")
    return {name: cmap(i % 20) for i, name in enumerate(names)}


def _ratio_vs_degradation(results: dict[str, Any], path: Path) -> None:
    rows = results["rows"]
    colors = _policy_colors(rows)
    figure, axes = _grid(len(_workloads(results)))
    for axis, workload in zip(axes, _workloads(results)):
        for row in (r for r in rows if r["workload"] == workload):
            x, y = row["cr_full"], row["deg_pct"]
            if not (math.isfinite(x["mean"]) and math.isfinite(y["mean"])):
                continue
            marker = "s" if row["kind"] == "lossless-reference" else "o"
            axis.errorbar(
                x["mean"], y["mean"], xerr=x["std"], yerr=y["std"], fmt=marker, capsize=3,
                color=colors[row["policy"]], label=row["policy"],
            )
        axis.axhline(0.0, color="black", linewidth=0.6)
        axis.set_xscale("log")
        axis.set_xlabel("compression ratio, full state (raw / stored)")
        axis.set_ylabel("degradation of final metric (%)")
        axis.set_title(workload)
        axis.legend(fontsize=7, ncol=2)
    figure.suptitle("Ratio against degradation (mean ± std over seeds; squares: lossless rows)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _per_checkpoint_ratio(results: dict[str, Any], path: Path) -> None:
    rows = results["rows"]
    colors = _policy_colors(rows)
    figure, axes = _grid(len(_workloads(results)))
    failures = results["meta"].get("failures", 10)
    for axis, workload in zip(axes, _workloads(results)):
        total = results["workloads"][workload]["total_steps"]
        for step in failure_steps(total, failures):
            axis.axvline(step, color="#cccccc", linewidth=0.8, zorder=0)
        for row in (r for r in rows if r["workload"] == workload):
            points = row["per_checkpoint_ratio"]
            if not points:
                continue
            style = "--" if row["kind"] == "lossless-reference" else "-"
            axis.plot([p[0] for p in points], [p[1] for p in points], style, marker=".",
                      color=colors[row["policy"]], label=row["policy"])
        axis.set_yscale("log")
        axis.set_xlabel("training step of the checkpoint")
        axis.set_ylabel("checkpoint ratio (raw / stored)")
        axis.set_title(f"{workload} (grey: failures)")
        axis.legend(fontsize=7, ncol=2)
    figure.suptitle("Per-checkpoint ratio over training (seed 0)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _stored_by_class(results: dict[str, Any], path: Path) -> None:
    rows = results["rows"]
    figure, axes = _grid(len(_workloads(results)))
    for axis, workload in zip(axes, _workloads(results)):
        shown = [r for r in rows if r["workload"] == workload and sum(r["class_stored"].values()) > 0]
        labels = [r["policy"] for r in shown]
        bottom = [0.0] * len(shown)
        for name in TENSOR_CLASSES:
            heights = [r["class_stored"].get(name, 0) / 1e6 for r in shown]
            axis.bar(labels, heights, bottom=bottom, color=_CLASS_COLORS[name], label=name.replace("_", " "))
            bottom = [b + h for b, h in zip(bottom, heights)]
        axis.set_ylabel("stored MB over the run")
        axis.set_title(workload)
        axis.tick_params(axis="x", rotation=40, labelsize=7)
        axis.legend(fontsize=7)
    figure.suptitle("Stored bytes by tensor class (mean over seeds; tensor data only)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_plots(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write the three plots into ``out_dir``; returns their paths by plot name."""
    paths = {name: Path(out_dir) / file for name, file in PLOT_FILES.items()}
    _ratio_vs_degradation(results, paths["ratio_vs_degradation"])
    _per_checkpoint_ratio(results, paths["per_checkpoint_ratio"])
    _stored_by_class(results, paths["stored_by_class"])
    return paths
