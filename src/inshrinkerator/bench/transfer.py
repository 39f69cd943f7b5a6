"""Transfer learning with the pretrained MiniLM (Inshrinkerator's transfer-learning setting).

Two one-shot measurements per policy, with :func:`inshrinkerator.save`:

- **pretrained**: the shipped all-MiniLM-L6-v2 state (every tensor of its safetensors)
  compressed on its own; quality = accuracy of a ridge probe on the task with the
  restored encoder, against the probe on the exact weights.
- **fine-tuned vs base**: the fine-tuned model at the end of the uninterrupted run,
  compressed against the pretrained state as ``base=`` (tensors of the same key path
  become deltas) and without it; quality = test accuracy of the restored model.
"""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from ..single_file import load, save
from .measures import degradation_percent
from .policy_specs import build_policy
from .workloads.minilm import MiniLMDocstrings, cut_pretrained, pretrained_full_state

__all__ = ["measure_transfer"]


def _one_shot(state: Any, folder: Path, spec: str, base: Optional[Any] = None) -> tuple[dict[str, Any], Any]:
    path = folder / f"{spec.replace(':', '_').replace('=', '')}{'-base' if base is not None else ''}.ink"
    started = time.perf_counter()
    info = save(state, path, policy=build_policy(spec), base=base)
    seconds = time.perf_counter() - started
    started = time.perf_counter()
    restored = load(path, base=base)
    load_seconds = time.perf_counter() - started
    path.unlink()
    record = {
        "raw_bytes": info.raw_bytes,
        "stored_bytes": info.stored_bytes,
        "ratio": info.ratio,
        "save_seconds": seconds,
        "load_seconds": load_seconds,
    }
    return record, restored


def measure_transfer(workload: MiniLMDocstrings, specs: list[str]) -> dict[str, Any]:
    """Both transfer-learning measurements for every policy spec (see the module docstring).

    ``workload`` must be trained (the end of the uninterrupted run); its model is changed.
    """
    fine_tuned = {k: v.detach().clone() for k, v in workload.model.state_dict().items()}
    base = {f"encoder.{k}": v for k, v in workload.pretrained_state().items()}
    exact_accuracy = workload.evaluate().value
    pretrained = workload.pretrained_state() if workload.quick else pretrained_full_state()
    exact_probe = workload.probe_accuracy(workload.pretrained_state())
    result: dict[str, Any] = {
        "pretrained_exact_probe_accuracy": exact_probe,
        "fine_tuned_exact_accuracy": exact_accuracy,
        "pretrained_tensors": "whole shipped model" if not workload.quick else "cut model (quick mode)",
        "pretrained": {},
        "fine_tuned": {},
    }
    with tempfile.TemporaryDirectory() as folder_name:
        folder = Path(folder_name)
        for spec in specs:
            record, restored = _one_shot(pretrained, folder, spec)
            # quick mode compressed the already-cut model; the whole one needs cutting
            cut = restored if workload.quick else cut_pretrained(restored, workload.max_length, workload.layers)
            record["probe_accuracy"] = workload.probe_accuracy(cut)
            record["deg_pct"] = degradation_percent(exact_probe, record["probe_accuracy"], True)
            result["pretrained"][spec] = record

            alone, _ = _one_shot(fine_tuned, folder, spec)
            record, restored = _one_shot(fine_tuned, folder, spec, base=base)
            workload.model.load_state_dict(restored)
            record["accuracy"] = workload.evaluate().value
            record["deg_pct"] = degradation_percent(exact_accuracy, record["accuracy"], True)
            record["ratio_without_base"] = alone["ratio"]
            result["fine_tuned"][spec] = record
            workload.model.load_state_dict(copy.deepcopy(fine_tuned))
    return result
