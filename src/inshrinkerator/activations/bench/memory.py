"""Activation memory, measured without trusting any codec's own accounting.

Two independent measures:

1. :func:`held_bytes`: walk every object the saved-tensor pack hook returned (through
   attributes, slots, containers, numpy bases) and add up the distinct buffers they keep
   alive (torch storages, numpy arrays' owning buffers, bytes), leaving out the model's
   parameters and buffers and the input batch, which exist with or without the hooks.
   A codec that keeps a view into a larger buffer is charged for the whole buffer.
2. :func:`probe_in_subprocess`: a fresh Python process trains a few steps and reports the
   growth of its resident set size across one forward pass (the memory held between
   forward and backward) and its peak RSS. glibc's mmap threshold is pinned at 64 KiB
   there, so every large block goes back to the OS when freed and RSS follows the live
   allocations.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
from typing import Any, Iterable

import numpy as np
import torch

from .training import Trainer
from .workloads import ActivationWorkload

__all__ = ["held_bytes", "saved_activation_bytes", "probe_in_subprocess", "rss_bytes"]


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return (str(tensor.device), tensor.untyped_storage().data_ptr())


def _children(obj: Any) -> Iterable[Any]:
    if isinstance(obj, dict):
        return obj.values()
    if isinstance(obj, (list, tuple, set, frozenset)):
        return obj
    found = []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        found.extend(getattr(obj, f.name) for f in dataclasses.fields(obj))
    if hasattr(obj, "__dict__"):
        found.extend(vars(obj).values())
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if slot != "__weakref__" and hasattr(obj, slot):
                found.append(getattr(obj, slot))
    return found


def held_bytes(objects: Iterable[Any], excluded: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct buffers reachable from ``objects``, minus those of ``excluded``."""
    skip = {_storage_key(t) for t in excluded}
    seen_objects: set[int] = set()
    seen_buffers: set[Any] = set()
    total = 0
    stack = list(objects)
    while stack:
        obj = stack.pop()
        if id(obj) in seen_objects or obj is None or isinstance(obj, (int, float, str, bool, torch.dtype,
                                                                      torch.device, type)):
            continue
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            key = _storage_key(obj)
            if key not in skip and key not in seen_buffers:
                seen_buffers.add(key)
                total += obj.untyped_storage().nbytes()
        elif isinstance(obj, np.ndarray):
            owner: Any = obj
            while isinstance(owner, np.ndarray) and owner.base is not None:
                owner = owner.base
            if isinstance(owner, np.ndarray):
                key = ("numpy", owner.__array_interface__["data"][0])
                if key not in seen_buffers:
                    seen_buffers.add(key)
                    total += owner.nbytes
            else:
                stack.append(owner)
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            total += obj.nbytes if isinstance(obj, memoryview) else len(obj)
        else:
            stack.extend(_children(obj))
    return total


def saved_activation_bytes(workload: ActivationWorkload, method: str, seed: int, batch_size: int,
                           warmup_steps: int = 3) -> dict[str, int]:
    """Bytes kept between forward and backward for one batch, by :func:`held_bytes`.

    Also returns what the compressor itself reports (``codec_reported``), for comparison.
    """
    trainer = Trainer.create(workload, method, seed)
    for step in range(warmup_steps):  # lets the adaptive bounds and codec choices settle
        trainer.step(step, batch_size)
    inputs, targets = workload.batch(seed, 10_000, batch_size)
    returned: list[Any] = []
    run = trainer.run

    def record(tensor: torch.Tensor) -> Any:
        packed = run.pack(tensor)
        returned.append(packed)
        return packed

    compressor = run.compressor
    before = dataclasses.replace(compressor.statistics) if compressor is not None else None
    with run.context():
        with torch.autograd.graph.saved_tensors_hooks(record, run.unpack):
            loss = workload.loss(trainer.model(inputs), targets)
        excluded = [*trainer.model.parameters(), *trainer.model.buffers(), inputs, targets]
        held = held_bytes(returned + list(trainer.model.checkpoint_inputs), excluded)
        loss.backward()
    result = {"held_bytes": held}
    if compressor is not None and before is not None:
        after = compressor.statistics
        result["codec_reported"] = after.compressed_stored_bytes - before.compressed_stored_bytes
    return result


def rss_bytes() -> int:
    """This process's resident set size, from /proc (Linux)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def probe_in_subprocess(workload: str, method: str, seed: int, batch_size: int, steps: int = 4,
                        threads: int = 1) -> dict[str, float]:
    """RSS growth over a forward pass and peak RSS of a fresh process training ``steps`` steps."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    command = [sys.executable, "-m", "inshrinkerator.activations.bench.probe", workload, method,
               str(seed), str(batch_size), str(steps), str(threads)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"memory probe {workload}/{method} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_forward_rss(trainer: Trainer, step: int, batch_size: int) -> int:
    """RSS growth from before a forward pass to just after it (the loss exists, no backward yet)."""
    inputs, targets = trainer.workload.batch(trainer.seed, step, batch_size)
    trainer.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    with trainer.run.context():
        start = rss_bytes()
        loss = trainer.workload.loss(trainer.model(inputs), targets)
        gc.collect()
        grown = rss_bytes() - start
        loss.backward()
    trainer.optimizer.step()
    return grown
