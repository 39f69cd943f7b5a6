"""The activation benchmark: memory, step time and final quality of every method on each workload."""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .memory import probe_in_subprocess, saved_activation_bytes
from .methods import method_names
from .report import write_report
from .training import Trainer
from .workloads import WORKLOADS, ActivationWorkload

__all__ = ["run_activation_bench"]

_COMPARED = "ink-auto"  # the method the acceptance criteria are checked on


def _commit() -> str:
    try:
        here = str(Path(__file__).resolve().parent)
        done = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10)
    except OSError:
        return "unknown"
    return done.stdout.strip() or "unknown"


class _Progress:
    """A rich progress bar over all work units, or nothing when disabled."""

    def __init__(self, enabled: bool, total: int) -> None:
        self._bar: Any = None
        if enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                                 transient=False)
            self._bar.start()
            self._task = self._bar.add_task("activation bench", total=total)

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text)

    def advance(self, amount: int = 1) -> None:
        if self._bar is not None:
            self._bar.advance(self._task, amount)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _step_times(workload: ActivationWorkload, methods: list[str], rounds: int, steps_per_round: int,
                tick: Callable[[], None]) -> dict[str, dict[str, float]]:
    """Best and median training-step seconds per method, the methods interleaved round by round."""
    trainers = {method: Trainer.create(workload, method, seed=0) for method in methods}
    for method, trainer in trainers.items():
        trainer.step(0)  # warm-up: first allocations, codec probing
    times: dict[str, list[float]] = {method: [] for method in methods}
    step = 1
    for _ in range(rounds):
        for method, trainer in trainers.items():
            times[method].extend(trainer.timed_step(step + i) for i in range(steps_per_round))
            tick()
        step += steps_per_round
    return {method: {"best": min(values), "median": statistics.median(values)}
            for method, values in times.items()}


def _summarize(workload: ActivationWorkload, methods: list[str], memory: dict[str, dict[str, Any]],
               probes: dict[str, dict[str, float]], times: dict[str, dict[str, float]],
               quality: dict[str, list[dict[str, float]]], compressors: dict[str, Any]) -> dict[str, Any]:
    metric = workload.primary_metric
    base_saved = memory["none"]["held_bytes"]
    base_peak = probes["none"]["peak_rss"]
    base_time = times["none"]["best"]
    base_metric = statistics.mean(run[metric] for run in quality["none"])
    rows = {}
    for method in methods:
        values = [run[metric] for run in quality[method]]
        mean = statistics.mean(values)
        row = {
            "saved_bytes": memory[method]["held_bytes"],
            "reduction": base_saved / max(1, memory[method]["held_bytes"]),
            "codec_reported_bytes": memory[method].get("codec_reported"),
            "forward_rss_growth": probes[method]["forward_rss_growth"],
            "peak_rss": probes[method]["peak_rss"],
            "peak_rss_change": probes[method]["peak_rss"] - base_peak,
            "step_seconds": times[method]["best"],
            "step_seconds_median": times[method]["median"],
            "step_overhead_percent": 100.0 * (times[method]["best"] / base_time - 1.0),
            "metric_mean": mean,
            "metric_spread": (max(values) - min(values)) / 2 if len(values) > 1 else 0.0,
            "metric_runs": quality[method],
            "metric_change": mean - base_metric,
        }
        compressor = compressors.get(method)
        if compressor is not None:
            row["bounds"] = {slot: record.relative_bound for slot, record in compressor.slots.items()
                             if record.relative_bound > 0}
            row["codecs"] = dict(compressor.statistics.by_codec)
            row["codec_ratio"] = compressor.statistics.ratio
        rows[method] = row
    return rows


def _run_workload(name: str, quick: bool, chosen: list[str], threads: int,
                  progress: _Progress) -> dict[str, Any]:
    workload = WORKLOADS[name]
    steps = workload.quick_steps if quick else workload.steps
    memory_batch = workload.memory_batch_size // (2 if quick else 1)
    rounds, per_round = _timing(quick)
    seeds = _seeds(name, quick)
    memory, probes, quality, compressors = {}, {}, {}, {}
    for method in chosen:
        progress.describe(f"{name}: memory of {method}")
        memory[method] = saved_activation_bytes(workload, method, seed=0, batch_size=memory_batch)
        progress.advance()
        probes[method] = probe_in_subprocess(name, method, 0, memory_batch, steps=4, threads=threads)
        progress.advance()
    progress.describe(f"{name}: step times")
    times = _step_times(workload, chosen, rounds, per_round, progress.advance)
    for method in chosen:
        quality[method] = []
        for seed in seeds:
            progress.describe(f"{name}: training with {method}, seed {seed}")
            trainer = Trainer.create(workload, method, seed)
            for step in range(steps):
                trainer.step(step)
            run = workload.evaluate(trainer.model)
            if trainer.run.compressor is not None:
                run["codec_ratio"] = trainer.run.compressor.statistics.ratio
                compressors[method] = trainer.run.compressor
            quality[method].append(run)
            progress.advance()
    return {
        "description": workload.description, "primary_metric": workload.primary_metric,
        "steps": steps, "batch_size": workload.batch_size, "memory_batch_size": memory_batch,
        "seeds": seeds, "methods": _summarize(workload, chosen, memory, probes, times, quality, compressors),
    }


def _timing(quick: bool) -> tuple[int, int]:
    return (3, 3) if quick else (5, 5)


def _seeds(name: str, quick: bool) -> list[int]:
    return [0] if quick or name != "digits-cnn" else [0, 1, 2]


def _acceptance(results: dict[str, Any]) -> Optional[dict[str, Any]]:
    row = results["workloads"].get("digits-cnn", {}).get("methods", {}).get(_COMPARED)
    if row is None:
        return None
    return {
        "saved-activation reduction": f"{row['reduction']:.1f}x (need >= 5x, target >= 10x)",
        "accuracy change": f"{row['metric_change']:+.2f} points (need within 0.5)",
        "peak RSS change": f"{row['peak_rss_change'] / (1 << 20):+.0f} MB",
        "step-time overhead": f"{row['step_overhead_percent']:+.0f}%",
        "passed": bool(row["reduction"] >= 5 and abs(row["metric_change"]) <= 0.5),
    }


def _run_in_subprocesses(names: list[str], quick: bool, methods: list[str], threads: int,
                         scratch: Path, show_progress: bool) -> dict[str, Any]:
    """Each workload in its own process (one core each), then their workload sections."""
    running = []
    for name in names:
        command = [sys.executable, "-m", "inshrinkerator.activations.bench", "--workload", name,
                   "--out", str(scratch / name), "--threads", str(threads), "--no-progress"]
        command += ["--quick"] if quick else []
        for method in methods:
            command += ["--method", method]
        running.append((name, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                               text=True)))
    sections = {}
    for name, process in running:
        _, errors = process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"activation bench of {name} failed:\n{errors[-3000:]}")
        if show_progress:
            print(f"activation bench: {name} done", file=sys.stderr)
        sections[name] = json.loads((scratch / name / "activations.json").read_text())["workloads"][name]
    return sections


def run_activation_bench(out_dir: Path, quick: bool = False, *, workloads: Optional[list[str]] = None,
                         methods: Optional[list[str]] = None, show_progress: bool = True,
                         threads: int = 1, parallel: bool = False) -> dict[str, Any]:
    """Measure every method on every workload; write JSON, markdown and a PNG plot to ``out_dir``.

    ``quick`` shortens training and timing. ``parallel`` runs each workload in its own
    process (one thread each: on two cores the two workloads then take one core each).
    Returns the results dictionary that was written to ``out_dir / "activations.json"``.
    """
    out_dir = Path(out_dir)
    names = workloads or list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown activation workload(s) {unknown}; choose from {list(WORKLOADS)}")
    chosen = methods or method_names()
    if "none" not in chosen:
        chosen = ["none", *chosen]
    command = "python -m inshrinkerator.activations.bench" + (" --quick" if quick else "")
    command += " --parallel" if parallel else ""
    results: dict[str, Any] = {
        "meta": {
            "commit": _commit(), "torch": torch.__version__, "threads": threads, "quick": quick,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": command,
        },
        "workloads": {},
    }
    if parallel and len(names) > 1:
        with tempfile.TemporaryDirectory() as scratch:
            results["workloads"] = _run_in_subprocesses(names, quick, chosen, threads, Path(scratch),
                                                        show_progress)
    else:
        rounds, _ = _timing(quick)
        total = sum(len(chosen) * (2 + rounds + len(_seeds(name, quick))) for name in names)
        progress = _Progress(show_progress, total)
        previous_threads = torch.get_num_threads()
        torch.set_num_threads(threads)  # one thread: stable timings on a shared machine
        try:
            for name in names:
                results["workloads"][name] = _run_workload(name, quick, chosen, threads, progress)
        finally:
            progress.stop()
            torch.set_num_threads(previous_threads)
    acceptance = _acceptance(results)
    if acceptance is not None:
        results["acceptance"] = acceptance
    write_report(results, out_dir)
    return results
