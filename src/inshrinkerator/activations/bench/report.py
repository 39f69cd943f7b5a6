"""Writes the activation benchmark's results: JSON, a markdown report and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_report", "markdown_report"]

_MB = 1 << 20


def _fmt(value: Any, digits: int = 1, signed: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:+.{digits}f}" if signed else f"{value:.{digits}f}"


def markdown_report(results: dict[str, Any]) -> str:
    """The tables of ``results`` as markdown."""
    meta = results["meta"]
    lines = [
        "# Activation compression benchmark",
        "",
        f"Commit `{meta['commit']}`, torch {meta['torch']}, {meta['threads']} thread(s), "
        f"{'quick' if meta['quick'] else 'full'} run, {meta['date']}. "
        f"Reproduce: `{meta['command']}`.",
        "",
        "*Saved activations*: bytes held between forward and backward by what the saved-tensor "
        "hooks returned (distinct buffers, found by walking the packed objects; parameters and "
        "the input batch left out; for checkpoint, the segment inputs it keeps). *Forward RSS*: "
        "growth of a fresh process's resident memory over one forward pass; *peak RSS*: that "
        "process's high-water mark over a few training steps (both at the memory batch size). "
        "*Step*: best-of-N training step time at the training batch size, methods interleaved.",
        "",
    ]
    for name, workload in results["workloads"].items():
        metric = workload["primary_metric"]
        lines += [
            f"## {name}",
            "",
            f"{workload['description']}. Training: {workload['steps']} steps at batch "
            f"{workload['batch_size']}, seeds {workload['seeds']}; "
            f"memory batch {workload['memory_batch_size']}.",
            "",
            f"| method | saved activations (MB) | reduction | codec's own count (MB) | forward RSS (MB) "
            f"| peak RSS (MB) | peak RSS vs none | step (ms) | step overhead | {metric} | {metric} vs none |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        digits = 3 if metric == "val_loss" else 2
        for method, row in workload["methods"].items():
            reported = row.get("codec_reported_bytes")
            lines.append(
                f"| {method} | {_fmt(row['saved_bytes'] / _MB, 2)} | {_fmt(row['reduction'], 1)}x "
                f"| {_fmt(reported / _MB, 2) if reported is not None else '—'} "
                f"| {_fmt(row['forward_rss_growth'] / _MB)} | {_fmt(row['peak_rss'] / _MB, 0)} "
                f"| {_fmt(row['peak_rss_change'] / _MB, 0, signed=True)} MB "
                f"| {_fmt(row['step_seconds'] * 1e3, 0)} "
                f"| {_fmt(row['step_overhead_percent'], 0, signed=True)}% "
                f"| {_fmt(row['metric_mean'], digits)} ± {_fmt(row['metric_spread'], digits)} "
                f"| {_fmt(row['metric_change'], digits, signed=True)} |"
            )
        extra = [m for m, row in workload["methods"].items() if row.get("bounds")]
        for method in extra:
            row = workload["methods"][method]
            bounds = ", ".join(f"{slot}: {value:.3f}" for slot, value in row["bounds"].items())
            lines += ["", f"{method}: error bound per saved tensor (fraction of its range) — {bounds}; "
                          f"codecs used: {row['codecs']}."]
        lines.append("")
    acceptance = results.get("acceptance")
    if acceptance:
        lines += ["## Acceptance (digits-cnn, ink-auto vs none)", ""]
        for key, value in acceptance.items():
            lines.append(f"- {key}: {value}")
        lines.append("")
    return "\n".join(lines)


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = results["workloads"]
    figure, axes = plt.subplots(len(workloads), 2, figsize=(12, 4 * len(workloads)), squeeze=False)
    for row_axes, (name, workload) in zip(axes, workloads.items()):
        methods = list(workload["methods"])
        saved = [workload["methods"][m]["saved_bytes"] / _MB for m in methods]
        steps = [workload["methods"][m]["step_seconds"] * 1e3 for m in methods]
        metric = workload["primary_metric"]
        values = [workload["methods"][m]["metric_mean"] for m in methods]
        bars = row_axes[0].bar(methods, saved, color="tab:blue")
        row_axes[0].set_yscale("log")
        row_axes[0].set_ylabel("saved activations (MB, log)")
        row_axes[0].set_title(f"{name}: activation memory ({metric} on bars)")
        for bar, value in zip(bars, values):
            row_axes[0].annotate(f"{value:.3g}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                 ha="center", va="bottom", fontsize=8)
        row_axes[1].bar(methods, steps, color="tab:orange")
        row_axes[1].set_ylabel("step time (ms)")
        row_axes[1].set_title(f"{name}: training step time")
        for axis in row_axes:
            axis.tick_params(axis="x", rotation=30)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write ``activations.json``, ``report.md`` and ``activations.png`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "activations.json", "markdown": out_dir / "report.md",
             "plot": out_dir / "activations.png"}
    paths["json"].write_text(json.dumps(results, indent=2, sort_keys=False) + "\n")
    paths["markdown"].write_text(markdown_report(results))
    _plot(results, paths["plot"])
    return paths
