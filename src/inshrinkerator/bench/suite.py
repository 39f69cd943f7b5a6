"""``inshrink bench``: every workload x seed x policy through the failure-recovery protocol,
then the JSON results, ``report.md`` and the plots."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from .. import __version__
from .aggregate import aggregate_rows
from .lossless_rows import LOSSLESS_ROWS
from .policy_specs import SWEEP_WORKLOADS, build_policy, registered_policies, sweep_specs
from .recovery import run_reference, run_with_failures, torch_threads
from .report import write_report
from .workloads import WORKLOADS, Workload, make_workload
from .workloads.minilm import MiniLMDocstrings

__all__ = ["run_bench", "source_commit", "RESULTS_FILE"]

RESULTS_FILE = "results.json"
_PROGRESS_FILE = "runs.jsonl"


def source_commit() -> dict[str, Any]:
    """The git commit of the source tree this package runs from, and whether ``src/`` has
    uncommitted changes; ``{"commit": None}`` outside a git checkout unless the environment
    variable ``INSHRINKERATOR_SOURCE_COMMIT`` names it."""
    pinned = os.environ.get("INSHRINKERATOR_SOURCE_COMMIT")
    if pinned:  # a source export without .git (e.g. `git archive HEAD`) names its commit here
        return {"commit": pinned, "dirty_src": False}
    root = Path(__file__).resolve().parents[3]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "src"],
            capture_output=True, text=True, check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty_src": None}
    return {"commit": commit, "dirty_src": bool(status.strip())}


@dataclass(frozen=True)
class _Task:
    workload: str
    seed: int
    policy: Optional[str]  # None: the uninterrupted reference

    @property
    def key(self) -> str:
        return f"{self.workload}|{self.seed}|{self.policy or '<reference>'}"


def _workload_info(name: str, quick: bool) -> dict[str, Any]:
    workload = make_workload(name, 0, quick)
    state = {"step": 0, **workload.state()}
    size = workload.size
    return {
        "description": workload.description,
        "optimizer": workload.optimizer_kind,
        "parameters": sum(p.numel() for p in workload.model.parameters()),
        "total_steps": size.total_steps,
        "checkpoint_every": size.checkpoint_every,
        "model_bytes": sum(t.numel() * t.element_size() for t in state["model"].values()),
        "metric": workload.evaluate().metric,
    }


def _plan(names: list[str], specs: list[str], seeds: Optional[int], quick: bool, sweeps: bool) -> list[_Task]:
    tasks = []
    for name in names:
        extra = sweep_specs(specs) if sweeps and name in SWEEP_WORKLOADS else []
        count = seeds if seeds is not None else (1 if quick else WORKLOADS[name].default_seeds)
        for seed in range(count):
            tasks.append(_Task(name, seed, None))
            tasks.extend(_Task(name, seed, spec) for spec in [*specs, *extra])
    return tasks


def _load_progress(path: Path, config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    done: dict[str, dict[str, Any]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if record.get("config") != config:
            continue
        earlier = done.get(record["key"])
        if earlier is not None:
            # A reference run recorded twice (runs of different policy sets merged into one
            # folder): keep the newer result, and the transfer measurements of both.
            record["transfer"] = _merge_transfer(earlier.get("transfer", {}), record.get("transfer", {}))
        done[record["key"]] = record
    return done


def _merge_transfer(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    merged = {name: dict(data) for name, data in first.items()}
    for name, data in second.items():
        target = merged.setdefault(name, dict(data))
        for part in ("pretrained", "fine_tuned"):
            target[part] = {**first.get(name, {}).get(part, {}), **data.get(part, {})}
    return merged


def run_bench(
    out_dir: Path,
    quick: bool = False,
    workloads: Optional[list[str]] = None,
    policies: Optional[list[str]] = None,
    seeds: Optional[int] = None,
    *,
    failures: int = 10,
    full_every: int = 10,
    threads: int = 1,
    resume: bool = False,
    recorded_only: bool = False,
    console: Optional[Console] = None,
) -> dict[str, Any]:
    """Run the benchmark and write ``results.json``, ``report.md`` and PNG plots to ``out_dir``.

    Args:
        quick: seconds-long workloads, one seed, no option sweeps (a smoke run).
        workloads: names from :data:`~.workloads.WORKLOADS` (default: all).
        policies: policy specs (names, or ``"name:key=value"``); default: every registered
            policy plus LC-Checkpoint's bit sweep on the digits workloads.
        seeds: seeds per workload (default: 1 quick; full: each workload's ``default_seeds``).
        threads: torch threads for training (1 keeps timings stable on a shared machine).
        resume: reuse runs already recorded in ``out_dir/runs.jsonl`` with the same settings.
        recorded_only: train nothing; report the recorded runs of the plan (implies ``resume``).

    Returns:
        The results document that ``results.json`` holds.

    Raises:
        ValueError: an unknown workload or policy.
    """
    console = console or Console()
    out_dir = Path(out_dir)
    names = list(workloads) if workloads else list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise ValueError(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    specs = list(policies) if policies else registered_policies()
    for spec in specs:
        build_policy(spec)  # fail before any training on a bad name
    if seeds is not None and seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    tasks = _plan(names, specs, seeds, quick, sweeps=policies is None and not quick)
    config = {"quick": quick, "failures": failures, "full_every": full_every, "threads": threads}
    out_dir.mkdir(parents=True, exist_ok=True)
    progress_file = out_dir / _PROGRESS_FILE
    resume = resume or recorded_only
    done = _load_progress(progress_file, config) if resume else {}
    if recorded_only:
        tasks = [t for t in tasks if t.key in done]
    if not resume and progress_file.exists():
        progress_file.unlink()
    started = time.time()
    transfer: dict[str, Any] = {}
    with torch_threads(threads):
        info = {name: _workload_info(name, quick) for name in names}
        steps_of = {name: info[name]["total_steps"] for name in names}
        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=console, transient=False,
        ) as progress:
            overall = progress.add_task("benchmark (runs)", total=len(tasks))
            for task in tasks:
                if task.key in done:
                    progress.advance(overall)
                    continue
                label = f"{task.workload} seed {task.seed}: {task.policy or 'uninterrupted'}"
                current = progress.add_task(label, total=steps_of[task.workload])
                advance = lambda n, _id=current: progress.advance(_id, n)  # noqa: E731
                record = _run_task(task, quick, failures, full_every, advance, specs, transfer)
                record.update(key=task.key, config=config, commit=source_commit()["commit"])
                with progress_file.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps(record, default=float) + "\n")
                done[task.key] = record
                progress.remove_task(current)
                progress.advance(overall)
    references = [done[t.key]["result"] for t in tasks if t.policy is None]
    runs = [done[t.key]["result"] for t in tasks if t.policy is not None]
    for record in done.values():
        transfer.update(record.get("transfer", {}))
    run_commits = sorted({str(done[t.key].get("commit")) for t in tasks})
    results = {
        "meta": {
            **source_commit(),
            "run_commits": run_commits,
            "version": __version__,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads available",
            "seeds": {name: sum(1 for t in tasks if t.workload == name and t.policy is None) for name in names},
            "policies": specs,
            "seconds": time.time() - started,
            **config,
        },
        "workloads": info,
        "references": references,
        "runs": runs,
        "rows": aggregate_rows(references, runs),
        "transfer": transfer,
    }
    (out_dir / RESULTS_FILE).write_text(json.dumps(results, indent=1, default=float), encoding="utf-8")
    write_report(results, out_dir)
    return results


def _run_task(
    task: _Task,
    quick: bool,
    failures: int,
    full_every: int,
    advance: Any,
    specs: list[str],
    transfer: dict[str, Any],
) -> dict[str, Any]:
    if task.policy is None:
        collected: dict[str, Any] = {}

        def on_finish(workload: Workload) -> None:
            if isinstance(workload, MiniLMDocstrings) and task.seed == 0:
                from .transfer import measure_transfer

                collected[task.workload] = measure_transfer(workload, specs)

        result = run_reference(task.workload, task.seed, quick, LOSSLESS_ROWS, advance, on_finish)
        return {"result": result.to_dict(), "transfer": collected}
    with tempfile.TemporaryDirectory(prefix="ink-bench-") as folder:
        result = run_with_failures(
            task.workload, task.seed, quick, build_policy(task.policy), Path(folder) / "run",
            failures=failures, full_every=full_every, advance=advance,
        )
    record = result.to_dict()
    record["label"] = task.policy
    return {"result": record}
