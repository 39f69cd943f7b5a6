"""Peak extra memory while saving a large state, relative to the state's size.

Each case runs in a fresh subprocess that builds the state (tensors filled in place, no
temporaries), settles, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), then
saves and reads the new peak (``VmHWM``). *Extra* = peak RSS during the save minus RSS just
before it; the ratio is extra / state bytes. A sampling thread (every 20 ms) cross-checks
the kernel's figure. Cases:

- ``ink.save`` (lossless) of a model + Adam state (many tensors of 32 MiB);
- ``ink.save`` (lossless) of one single tensor as large as that whole state (the codec
  encodes it slice by slice and the writer spools each slice's stream as it comes), then
  ``ink.load`` of that file with the state freed (its extra includes the 1.0x of the
  loaded tensor itself);
- ``CheckpointManager`` (sync, lossless and the default policy), two saves: a full step,
  then a delta against it;
- ``CheckpointManager(async_save=True)`` (lossless), two saves.

Run: ``python benchmarks/save_memory.py`` (state of 2.06 GiB; ``--gib`` changes it;
``--cases`` picks some). Results: ``benchmarks/results/save_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "save_memory.json"
LAYER_SHAPE = (4096, 2048)  # 32 MiB of float32
CASES = ("save_lossless", "save_one_tensor", "manager_lossless", "manager_default", "manager_async")


# ----------------------------------------------------------------------------- the child


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    # "5" resets the peak resident set size (VmHWM) to the current one (Linux >= 4.0).
    Path("/proc/self/clear_refs").write_text("5")


class _Sampler(threading.Thread):
    """Samples VmRSS; an independent check of the kernel's high-water mark."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_kib = 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak_kib = max(self.peak_kib, _status_kib("VmRSS"))
            time.sleep(0.02)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        return max(self.peak_kib, _status_kib("VmRSS"))


def _model_state(total_bytes: int) -> dict[str, Any]:
    """A model + Adam state: weights, exp_avg and exp_avg_sq of ``layers`` 32 MiB matrices."""
    import torch

    layer_bytes = LAYER_SHAPE[0] * LAYER_SHAPE[1] * 4
    layers = max(1, round(total_bytes / (3 * layer_bytes)))
    generator = torch.Generator().manual_seed(0)
    model, state = {}, {}
    for index in range(layers):
        weight = torch.empty(LAYER_SHAPE).normal_(0, 0.02, generator=generator)
        model[f"layers.{index}.weight"] = weight
        state[index] = {
            "step": torch.tensor(100.0),
            "exp_avg": torch.empty(LAYER_SHAPE).normal_(0, 1e-4, generator=generator),
            "exp_avg_sq": torch.empty(LAYER_SHAPE).uniform_(0, 1e-7, generator=generator),
        }
    groups = [{"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "params": list(range(layers))}]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}, "step": 100}


def _drift(state: dict[str, Any]) -> None:
    """One "training step" in place: small changes, as between two checkpoints."""
    import torch

    generator = torch.Generator().manual_seed(1)
    for weight in state["model"].values():
        weight.add_(torch.empty_like(weight).normal_(0, 1e-4, generator=generator))


def _state_bytes(state: Any) -> int:
    from inshrinkerator.tree import flatten

    return sum(leaf.tensor.numel() * leaf.tensor.element_size() for leaf in flatten(state).tensors)


def _measure(label: str, action: Any) -> dict[str, Any]:
    import gc

    gc.collect()
    time.sleep(0.2)
    before_kib = _status_kib("VmRSS")
    _reset_peak()
    sampler = _Sampler()
    sampler.start()
    started = time.perf_counter()
    info = action()
    seconds = time.perf_counter() - started
    sampled_kib = sampler.stop()
    peak_kib = max(_status_kib("VmHWM"), sampled_kib)
    return {
        "save": label,
        "seconds": round(seconds, 2),
        "rss_before_mib": round(before_kib / 1024, 1),
        "peak_rss_mib": round(peak_kib / 1024, 1),
        "extra_mib": round((peak_kib - before_kib) / 1024, 1),
        "sampled_peak_mib": round(sampled_kib / 1024, 1),
        "stored_bytes": getattr(info, "stored_bytes", None),
        "kind": getattr(info, "kind", None),
    }


def run_case(case: str, total_bytes: int, folder: Path) -> dict[str, Any]:
    import torch

    import inshrinkerator as ink

    torch.set_num_threads(2)
    if case == "save_one_tensor":
        state: dict[str, Any] = {"weight": torch.empty(total_bytes // 4).normal_(0, 0.02)}
    else:
        state = _model_state(total_bytes)
    state_bytes = _state_bytes(state)
    tensor_count = len(_tensors(state))
    saves = []
    if case in ("save_lossless", "save_one_tensor"):
        saves.append(_measure("ink.save", lambda: ink.save(state, folder / "state.ink", policy="lossless")))
        if case == "save_one_tensor":
            del state
            loaded: dict[str, Any] = {}
            saves.append(_measure("ink.load", lambda: loaded.update(ink.load(folder / "state.ink"))))
            del loaded
    else:
        options: dict[str, Any] = {"policy": "lossless"} if case != "manager_default" else {}
        options["async_save"] = case == "manager_async"
        manager = ink.CheckpointManager(folder / "run", **options)

        def save(step: int) -> Any:
            info = manager.save(step, state)
            final = manager.wait()
            return final or info

        saves.append(_measure("step 0 (full)", lambda: save(0)))
        _drift(state)
        saves.append(_measure("step 1 (delta)", lambda: save(1)))
        manager.close()
    for entry in saves:
        entry["extra_over_state"] = round(entry["extra_mib"] * 2**20 / state_bytes, 3)
    return {"case": case, "state_bytes": state_bytes, "tensors": tensor_count, "saves": saves}


def _tensors(state: Any) -> list[Any]:
    from inshrinkerator.tree import flatten

    return flatten(state).tensors


# ---------------------------------------------------------------------------- the parent


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=2.0625, help="state size in GiB (default: 66 x 32 MiB)")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=CASES)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    total_bytes = int(args.gib * 2**30)
    if args.child:
        with tempfile.TemporaryDirectory(prefix="ink-save-memory-") as scratch:
            print(json.dumps(run_case(args.child, total_bytes, Path(scratch))))
        return
    previous: dict[str, Any] = {}
    if args.out.exists():  # measuring some cases again keeps the others
        previous = {r["case"]: r for r in json.loads(args.out.read_text()).get("results", [])}
    results = []
    commit = _commit()
    for case in args.cases:
        started = time.perf_counter()
        child = subprocess.run(
            [sys.executable, __file__, "--child", case, "--gib", str(args.gib)],
            capture_output=True, text=True,
        )
        if child.returncode != 0:
            raise SystemExit(f"{case} failed:\n{child.stderr[-3000:]}")
        result = json.loads(child.stdout.strip().splitlines()[-1])
        result["wall_seconds"] = round(time.perf_counter() - started, 1)
        result["commit"] = commit
        results.append(result)
        for entry in result["saves"]:
            print(f"{case:18s} {entry['save']:15s} state {result['state_bytes'] / 2**30:.2f} GiB  "
                  f"extra {entry['extra_mib']:8.1f} MiB = {entry['extra_over_state']:.3f} x state  "
                  f"({entry['seconds']:.1f} s)", flush=True)
    measured = {r["case"] for r in results}
    results += [r for case, r in previous.items() if case not in measured]
    results.sort(key=lambda r: CASES.index(r["case"]) if r["case"] in CASES else len(CASES))
    report = {
        "benchmark": "peak extra RSS during a save, relative to the state size",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "state_gib": args.gib,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
