"""``report.md``: the results as tables in the shape of Inshrinkerator's (Deg% / CR / Ovh%),
the paper-behaviour checks with their numbers, the transfer-learning table and the plots.

``python -m inshrinkerator.bench.report DIR`` rewrites the report and plots of a results
directory from its ``results.json``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from .paper_checks import paper_checks
from .plots import write_plots

__all__ = ["write_report", "render_report", "REPORT_FILE"]

REPORT_FILE = "report.md"


def _cell(spread: dict[str, float], digits: int = 2) -> str:
    mean = spread["mean"]
    if not math.isfinite(mean):
        return "n/a"
    if spread["n"] > 1:
        return f"{mean:.{digits}f} ± {spread['std']:.{digits}f}"
    return f"{mean:.{digits}f}"


def _main_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| Workload | Policy | Deg % | CR full state | CR weights only | Ovh % | compress MB/s "
        "| restore / torch.load | restore MB/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results["rows"]:
        name = row["policy"] + (" †" if row["kind"] == "lossless-reference" else "")
        lines.append(
            f"| {row['workload']} | {name} | {_cell(row['deg_pct'])} | {_cell(row['cr_full'])} | "
            f"{_cell(row['cr_weights'])} | {_cell(row['ovh_pct'], 1)} | {_cell(row['compress_mbps'], 1)} | "
            f"{_cell(row['restore_ratio'])} | {_cell(row['restore_mbps'], 1)} |"
        )
    return lines


def _workload_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| Workload | What | Parameters | Steps / checkpoint every | Metric (uninterrupted, mean ± std) |",
        "|---|---|---:|---:|---|",
    ]
    for name, info in results["workloads"].items():
        values = [r["evaluation"]["value"] for r in results["references"] if r["workload"] == name]
        if values:
            mean = sum(values) / len(values)
            std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
            metric = f"{info['metric']} {mean:.4f} ± {std:.4f} ({len(values)} seeds)"
        else:
            metric = info["metric"]
        lines.append(
            f"| {name} | {info['description']} | {info['parameters']:,} | "
            f"{info['total_steps']} / {info['checkpoint_every']} | {metric} |"
        )
    return lines


def _checks(results: dict[str, Any]) -> list[str]:
    checks = paper_checks(results["rows"])
    if not checks:
        return ["No baseline rows to check in this run."]
    verdict = {True: "holds", False: "does not hold", None: "undecided"}
    return [
        f"- **{c['baseline']}** — {c['claim']}: **{verdict[c['holds']]}**. {c['evidence']}." for c in checks
    ]


def _transfer(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for workload, data in results.get("transfer", {}).items():
        lines += [
            f"### {workload}",
            "",
            f"Pretrained model compressed one-shot ({data['pretrained_tensors']}); quality = ridge-probe "
            f"accuracy on the task with the restored encoder (exact weights: "
            f"{data['pretrained_exact_probe_accuracy']:.4f}). Fine-tuned model (end of the seed-0 "
            f"uninterrupted run, exact accuracy {data['fine_tuned_exact_accuracy']:.4f}) compressed "
            "against the pretrained base (`base=`) and alone.",
            "",
            "| Policy | pretrained: CR | probe acc | Deg % | fine-tuned vs base: CR | CR without base | acc | Deg % |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for spec, pre in data["pretrained"].items():
            fine = data["fine_tuned"][spec]
            lines.append(
                f"| {spec} | {pre['ratio']:.2f} | {pre['probe_accuracy']:.4f} | {pre['deg_pct']:.2f} | "
                f"{fine['ratio']:.2f} | {fine['ratio_without_base']:.2f} | {fine['accuracy']:.4f} | "
                f"{fine['deg_pct']:.2f} |"
            )
        lines.append("")
    return lines


def _compute_minutes(results: dict[str, Any]) -> float:
    seconds = sum(r["train_seconds"] for r in results["references"])
    for run in results["runs"]:
        seconds += run["train_seconds"] + run["blocked_seconds"]
        seconds += sum(r["seconds"] for r in run["restores"])
    return seconds / 60


def _seeds(seeds: Any) -> str:
    if isinstance(seeds, dict):
        return ", ".join(f"{name} {count}" for name, count in seeds.items())
    return str(seeds)


def render_report(results: dict[str, Any]) -> str:
    """The markdown text of the report."""
    meta = results["meta"]
    commit = meta.get("commit") or "unknown (not a git checkout)"
    dirty = " (with uncommitted changes under src/)" if meta.get("dirty_src") else ""
    others = [c for c in meta.get("run_commits", []) if c != meta.get("commit")]
    if others:
        dirty += f"; some runs were measured at commit(s) {', '.join(f'`{c}`' for c in others)}"
    lines = [
        "# inshrinkerator benchmark: failure recovery on real workloads",
        "",
        f"Measured commit: `{commit}`{dirty}; inshrinkerator {meta['version']}, {meta['date']}, "
        f"Python {meta['python']}, torch {meta['torch']}, {meta['machine']}; training on "
        f"{meta['threads']} torch thread(s). Mode: {'quick (smoke sizes)' if meta['quick'] else 'full'}; "
        f"seeds per workload: {_seeds(meta['seeds'])}; {meta['failures']} failures per run; a full checkpoint every "
        f"{meta['full_every']} saves; training, saving and restoring summed over all runs "
        f"{_compute_minutes(results):.0f} min.",
        "",
        *[line for note in meta.get("notes", []) for line in (f"Note: {note}", "")],
        "## Protocol",
        "",
        "Each workload trains T steps and checkpoints every C steps through `CheckpointManager` with "
        "the policy under test (synchronous saves). At each of the evenly spaced failures the "
        "process state is dropped: a fresh model, optimizer and scheduler are built, a new manager "
        "opens the run and loads the latest checkpoint into them, and the steps since it are "
        "trained again on the same batches (a batch is a function of the step). The final metric "
        "is compared with the uninterrupted run of the same seed.",
        "",
        "- **Deg %**: relative change of the final metric vs the uninterrupted run, positive = worse "
        "(accuracy: (base − got)/base; loss: (got − base)/base).",
        "- **CR full state**: Σ raw bytes of every state handed to `save` / Σ bytes of every file "
        "the run left on disk (data, manifests, markers). **CR weights only**: the model's tensors "
        "and the bytes stored for them (per-tensor sizes in the container headers).",
        "- **Ovh %**: time the training loop was blocked in `save` / training time. **compress MB/s**: "
        "raw MB per second of `save`. **restore / torch.load**: time to load the latest checkpoint "
        "vs `torch.load(weights_only=True)` of the same state from a file (lossless rows: from memory); "
        "**restore MB/s**: raw MB restored per second.",
        "- † Lossless reference rows are measured on the uninterrupted run's checkpoint states "
        "(a lossless restore reproduces that run exactly): `torch.save`; `zstd` (level 3) of the "
        "`torch.save` bytes; `zipnn` on each tensor's raw bytes. Each is checked to restore bit for bit.",
        "- Timings come from a shared 2-core machine where other jobs ran at the same time: treat "
        "Ovh % and MB/s as indications, ratios and degradations as exact.",
        "",
        "## Workloads",
        "",
        *_workload_table(results),
        "",
        "## Results (mean ± std over seeds)",
        "",
        *_main_table(results),
        "",
        "![ratio vs degradation](ratio_vs_degradation.png)",
        "",
        "![per-checkpoint ratio](per_checkpoint_ratio.png)",
        "",
        "![stored bytes by tensor class](stored_by_class.png)",
        "",
        "## Do the baselines behave as their papers describe?",
        "",
        *_checks(results),
        "",
    ]
    transfer = _transfer(results)
    if transfer:
        lines += ["## Transfer learning (pretrained MiniLM)", "", *transfer]
    return "\n".join(lines) + "\n"


def write_report(results: dict[str, Any], out_dir: Path) -> Path:
    """Write ``report.md`` and the plots into ``out_dir``; returns the report's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_plots(results, out_dir)
    path = out_dir / REPORT_FILE
    path.write_text(render_report(results), encoding="utf-8")
    return path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m inshrinkerator.bench.report RESULTS_DIR", file=sys.stderr)
        return 2
    folder = Path(argv[0])
    results = json.loads((folder / "results.json").read_text(encoding="utf-8"))
    print(write_report(results, folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
