"""Run as a script: print the CPU kernels PyTorch runs, then each step of a checkpoint folder
and a digest of its restored tensors."""

from __future__ import annotations

import hashlib
import sys

import torch


def digest(leaves) -> str:
    """SHA-256 of the leaves' key paths and bytes, in order."""
    hashed = hashlib.sha256()
    for leaf in leaves:
        hashed.update(str(leaf.path).encode())
        hashed.update(leaf.tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return hashed.hexdigest()


def main(folder: str) -> None:
    import inshrinkerator as ink
    from inshrinkerator.tree import flatten

    print("kernels", torch.backends.cpu.get_cpu_capability())
    manager = ink.CheckpointManager(folder)
    for step in manager.steps():
        print(step, digest(flatten(manager.load(step)).tensors))


if __name__ == "__main__":
    main(sys.argv[1])
