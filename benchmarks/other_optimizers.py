"""The digits CNN trained with other ``torch.optim`` optimizers, on the failure-recovery protocol.

The yardstick's digits workloads use Adam and SGD. This script adds the same network
and data with RMSprop (plain, and centered with momentum), Adagrad, AdamW with AMSGrad,
Adamax, Adadelta and NAdam as workloads of this process only, then runs
``dynaquant_probe.py`` on them with the policies given (default: dynaquant and ExCP), so
the full-state ratio shows what compressing each optimizer's statistics is worth.

Run: ``python benchmarks/other_optimizers.py --seeds 2`` (any ``dynaquant_probe.py``
option passes through; ``--workload digits-adagrad`` picks one optimizer).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from inshrinkerator.bench import workloads
from inshrinkerator.bench.workloads.digits import DigitsCNN

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dynaquant_probe  # noqa: E402  (the script beside this one)

Make = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

#: workload name -> how its optimizer is built (the learning rates train the CNN to ~98 %)
OPTIMIZERS: dict[str, Make] = {
    "digits-rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "digits-rmsprop-centered-mom": lambda p: torch.optim.RMSprop(p, lr=5e-4, centered=True, momentum=0.9),
    "digits-adagrad": lambda p: torch.optim.Adagrad(p, lr=0.02),
    "digits-amsgrad": lambda p: torch.optim.AdamW(p, lr=2e-3, amsgrad=True),
    "digits-adamax": lambda p: torch.optim.Adamax(p, lr=4e-3),
    "digits-adadelta": lambda p: torch.optim.Adadelta(p, lr=1.0),
    "digits-nadam": lambda p: torch.optim.NAdam(p, lr=2e-3),
}


def _register(name: str, make: Make) -> None:
    def make_optimizer(self: DigitsCNN) -> torch.optim.Optimizer:
        return make(self.model.parameters())

    workload = type(name, (DigitsCNN,), {
        "name": name, "optimizer_kind": name, "description": f"the digits CNN, {name}",
        "_make_optimizer": make_optimizer,
    })
    workloads.WORKLOADS[name] = workload


def main(argv: list[str]) -> int:
    for name, make in OPTIMIZERS.items():
        _register(name, make)
    if "--workload" not in argv:
        argv = [arg for name in OPTIMIZERS for arg in ("--workload", name)] + argv
    if "--policy" not in argv:
        argv = argv + ["--policy", "dynaquant", "--policy", "excp"]
    return dynaquant_probe.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
