"""Shared fixtures of the baseline policy tests: a short training chain and exactness checks."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

import inshrinkerator as ink
from inshrinkerator.codecs import Codec
from inshrinkerator.policies import Policy, resolve_policy
from inshrinkerator.serialize import reference_map
from inshrinkerator.tree import flatten, format_key_path

from ..helpers import assert_same

#: Quantizable (>= 1024 values) under the default ``min_numel``.
LARGE_WEIGHTS = ("model/0.weight", "model/3.weight")


def training_chain(optimizer: str = "adam", checkpoints: int = 4, steps_between: int = 2, seed: int = 0) -> list[dict[str, Any]]:
    """States of a small MLP with BatchNorm after successive training steps (deep copies)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(48, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
        torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10),
    )
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(seed)
    states = []
    step = 0
    for _ in range(checkpoints):
        for _ in range(steps_between):
            x = torch.randn(32, 48, generator=generator)
            y = torch.randint(0, 10, (32,), generator=generator)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        states.append(copy.deepcopy({
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "step": step,
            "labels": torch.arange(7, dtype=torch.int16),
            "config": {"lr": 0.01, "name": "mlp"},
        }))
    return states


def planned_codecs(policy: Policy, state: Any, base: Any = None) -> dict[str, Codec]:
    """Key path -> the codec ``policy`` picks for each tensor of ``state``."""
    leaves = flatten(state).tensors
    references = reference_map(base) if base is not None else {}
    keys = [format_key_path(leaf.path) for leaf in leaves]
    return dict(zip(keys, policy.plan(leaves, [references.get(k) for k in keys])))


def assert_exact_where_lossless(policy: Policy, state: Any, loaded: Any, base: Any = None) -> list[str]:
    """Everything but the tensors given to a lossy codec comes back bit for bit; returns the lossy keys."""
    codecs = planned_codecs(policy, state, base)
    lossy = [key for key, codec in codecs.items() if not codec.lossless]
    loaded_tensors = reference_map(loaded)
    masked_state, masked_loaded = _without(state, lossy), _without(loaded, lossy)
    assert_same(masked_state, masked_loaded)
    for key in lossy:
        original = reference_map(state)[key]
        assert loaded_tensors[key].dtype == original.dtype and loaded_tensors[key].shape == original.shape
    return lossy


def _without(state: Any, keys: list[str], prefix: str = "") -> Any:
    if isinstance(state, dict):
        return type(state)(
            (k, _without(v, keys, f"{prefix}/{k}" if prefix else str(k))) for k, v in state.items()
        )
    if isinstance(state, torch.Tensor) and prefix in keys:
        return "lossy"
    return state


def save_chain(policy: str | Policy, states: list[Any], folder: Path) -> list[tuple[ink.SaveInfo, Any]]:
    """Save each state against the previous *loaded* one (closed loop); return (info, loaded) pairs."""
    results = []
    previous = None
    for index, state in enumerate(states):
        path = folder / f"{index}.ink"
        info = ink.save(state, path, policy=policy, base=previous)
        loaded = ink.load(path, base=previous)
        results.append((info, loaded))
        previous = loaded
    return results


def max_error(state: Any, loaded: Any, key: str) -> float:
    return float((reference_map(state)[key].double() - reference_map(loaded)[key].double()).abs().max())


def resolve(name: str) -> Policy:
    return resolve_policy(name)
