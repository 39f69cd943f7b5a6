"""A chain written on one CPU restores to the same bits on another.

Deltas are closed loop: each is coded against the writer's reconstruction of the
checkpoint before it, and the reader checks that its own decode of that checkpoint is the
same (a checksum of the reference). So decoding must not depend on the machine. The
encoders may (their QR, SVD and k-means run on whatever kernels the CPU offers); the
decoders use exact integer sums, table lookups and elementwise float operations, which
give the same bits on every instruction set. Here the chain is written with the kernels
this CPU picks, then read back in processes that run PyTorch's scalar kernels and its
AVX2 kernels, with MKL held to the matching instruction sets.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sklearn.datasets import load_digits

import inshrinkerator as ink
from inshrinkerator.tree import flatten

from ..policies.dynaquant_states import codecs_and_bytes
from . import portable_reader
from .portable_reader import digest


def _write_chain(folder: Path) -> None:
    """A digits MLP trained with Adam: a full checkpoint after 60 steps, then 5 deltas 6 steps apart."""
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.Adam(model.parameters(), 2e-3)
    policy = ink.policies.DynaQuant()
    policy.watch(model)
    step = 0
    with ink.CheckpointManager(folder, policy=policy) as manager:
        for save in range(6):
            for _ in range(60 if save == 0 else 6):
                batch = torch.arange(step * 64, step * 64 + 64) % len(x)
                loss = torch.nn.functional.cross_entropy(model(x[batch]), y[batch])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                step += 1
            manager.save(save, copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()}))


@pytest.mark.parametrize("kernels", [("default", "SSE4_2"), ("avx2", "AVX2")], ids=["scalar", "avx2"])
def test_a_chain_restores_to_the_same_bits_with_other_cpu_kernels(tmp_path, kernels) -> None:
    aten, mkl = kernels
    if aten == "avx2" and torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2"):
        pytest.skip("this CPU runs no wider kernels than AVX2 already")
    folder = tmp_path / "run"
    _write_chain(folder)
    codecs = {codec for path in folder.glob("step-*.ink") for codec, _ in codecs_and_bytes(path).values()}
    # The chain exercises the decoders that do arithmetic: levels, id deltas, changes and
    # first moments as low-rank products, first moments per octave of the second.
    assert {"dynaquant", "dynaquant_delta", "residual_low_rank", "dynaquant_grouped_low_rank"} <= codecs, codecs
    manager = ink.CheckpointManager(folder)
    here = {step: digest(flatten(manager.load(step)).tensors) for step in manager.steps()}
    assert len(here) == 6
    env = {**os.environ, "ATEN_CPU_CAPABILITY": aten, "MKL_ENABLE_INSTRUCTIONS": mkl}
    result = subprocess.run(
        [sys.executable, portable_reader.__file__, str(folder)], env=env, capture_output=True, text=True, timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"kernels {aten.upper()}"
    there = {int(step): hashed for step, hashed in (line.split() for line in lines[1:])}
    assert there == here
