"""Shared by the integration tests: which policies to run, how close a resume must land."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from inshrinkerator.policies import POLICY_NAMES

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

#: Relative change of the final loss allowed between a resumed and an uninterrupted run:
#: lossless restores bit for bit; a lossy policy may cost what DynaQuant's default
#: per-checkpoint tolerance allows (5%).
TOLERANCE = {"lossless": 1e-6}
LOSSY_TOLERANCE = 0.05

#: The lossy policy the integration tests run, first registered wins: the default policy
#: (DynaQuant; ~3 s on the Trainer workload, under 1 s on the Lightning one), then the
#: others.
LOSSY_PREFERENCE = ("dynaquant", "lc-checkpoint", "qd", "cnr", "excp")


def policies_under_test() -> list[str]:
    """Lossless, plus one lossy policy when one is registered."""
    lossy = [name for name in (*LOSSY_PREFERENCE, *POLICY_NAMES) if name in POLICY_NAMES and name != "lossless"]
    return ["lossless", *lossy[:1]]


def tolerance(policy: str) -> float:
    return TOLERANCE.get(policy, LOSSY_TOLERANCE)


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as a module (the tests drive the examples)."""
    path = EXAMPLES / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"examples_{name}", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def run_torchrun(script: str, *arguments: str, ranks: int = 2, timeout: int = 240) -> "subprocess.CompletedProcess[str]":
    """``examples/<script>`` on ``ranks`` processes (``torchrun --standalone``, gloo on the CPU),
    one thread each; the finished launch (its return code is the caller's to check).

    Launched once more for failures of the launcher, not of the checkpoint code: a port taken
    between rendezvous probes, or a rank aborting in C++ teardown at exit ("terminate called
    without an active exception", seen rarely on a loaded machine; its cause is still open).
    """
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               str(EXAMPLES / script), *arguments]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    retryable = ("address already in use", "terminate called without an active exception")
    for _attempt in range(2):
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
        if done.returncode == 0 or not any(marker in done.stderr.lower() for marker in retryable):
            break
    return done
