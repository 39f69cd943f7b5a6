"""How long does ``CheckpointManager.save(..., async_save=True)`` block the training loop?

Target (issue 3): the time ``save`` blocks is at most 2x the time to copy the state.

The state is a small transformer's ``state_dict`` plus its Adam state after real steps.
Each round, interleaved (alternating which goes first) so both see the same machine load:

- **copy**: clone every tensor of the state (what any snapshot must at least do);
- **async save**: ``mgr.save(step, state)`` with the worker idle (the training step between
  checkpoints is longer than a background save), timing only the call;
- then a "training step" mutates the parameters in place (not timed) and the background
  save is waited for (not timed; on rounds where the save goes first, before the copy).

Also reported: back-to-back async saves (the worker is still busy, so ``save`` waits for
it; the training loop then checkpoints faster than the store can write) and a synchronous
save, for scale. Best-of-N and median over rounds; results go to a JSON file.

Run: ``python benchmarks/async_blocking.py [--layers 6 --width 512 --rounds 7]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import inshrinkerator as ink
from inshrinkerator.tree import flatten


def make_state(layers: int, width: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(width, nhead=8, dim_feedforward=4 * width, batch_first=True),
        num_layers=layers,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(2):
        loss = model(torch.randn(4, 16, width)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer, {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 0}


def copy_state(state: dict[str, Any]) -> float:
    tensors = [leaf.tensor for leaf in flatten(state).tensors]
    started = time.perf_counter()
    copies = [t.detach().clone() for t in tensors]
    elapsed = time.perf_counter() - started
    del copies
    return elapsed


def train_step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter), alpha=1e-4)


def summary(values: list[float]) -> dict[str, float]:
    return {"best": min(values), "median": statistics.median(values), "worst": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "async_blocking.json")
    args = parser.parse_args()

    model, _, state = make_state(args.layers, args.width)
    raw = sum(leaf.tensor.numel() * leaf.tensor.element_size() for leaf in flatten(state).tensors)
    print(f"state: {raw / 2**20:.1f} MiB in {len(flatten(state).tensors)} tensors; {torch.get_num_threads()} threads")

    copies, blocking, back_to_back, sync = [], [], [], []
    with tempfile.TemporaryDirectory() as folder:
        async_mgr = ink.CheckpointManager(f"{folder}/async", policy="lossless", async_save=True)
        sync_mgr = ink.CheckpointManager(f"{folder}/sync", policy="lossless")
        step = 0
        for round_index in range(args.rounds):
            # Alternate which goes first, so neither always gets the memory the other just freed.
            if round_index % 2 == 0:
                copies.append(copy_state(state))
                blocking.append(async_mgr.save(step, state).seconds)
            else:
                blocking.append(async_mgr.save(step, state).seconds)
                async_mgr.wait()  # copy on an idle machine, not against the background save
                copies.append(copy_state(state))
            train_step(model)
            async_mgr.wait()
            step += 1
            # Back to back: the next save finds the worker busy with this one.
            async_mgr.save(step, state)
            step += 1
            started = time.perf_counter()
            async_mgr.save(step, state)
            back_to_back.append(time.perf_counter() - started)
            async_mgr.wait()
            step += 1
            started = time.perf_counter()
            sync_mgr.save(round_index, state)
            sync.append(time.perf_counter() - started)
            train_step(model)
            print(
                f"round {round_index}: copy {copies[-1] * 1e3:.1f} ms, async save blocks "
                f"{blocking[-1] * 1e3:.1f} ms, back-to-back {back_to_back[-1] * 1e3:.0f} ms, "
                f"sync save {sync[-1] * 1e3:.0f} ms"
            )
        async_mgr.close()
        sync_mgr.close()

    ratios = [b / c for b, c in zip(blocking, copies)]
    result = {
        "benchmark": "async_blocking",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=Path(__file__).parent).stdout.strip(),
        "state_mib": raw / 2**20,
        "rounds": args.rounds,
        "copy_seconds": summary(copies),
        "async_save_blocking_seconds": summary(blocking),
        "blocking_over_copy": {"best_of_best": min(blocking) / min(copies), **summary(ratios)},
        "back_to_back_blocking_seconds": summary(back_to_back),
        "sync_save_seconds": summary(sync),
        "target": "async save blocks <= 2x the copy time",
        "met": min(blocking) / min(copies) <= 2.0 and statistics.median(ratios) <= 2.0,
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
