"""The small model, its training and the states the DynaQuant tests plan and store."""

from __future__ import annotations

import copy

import pytest
import torch

from inshrinkerator.tree import flatten, format_key_path


@pytest.fixture(autouse=True)
def one_thread():
    # Many small tensor ops: a second OpenMP thread only adds contention on a busy machine.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(8 * 8 * 8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10),
    )


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    for step in range(start, start + steps):
        generator = torch.Generator().manual_seed(step)
        x = torch.randn(16, 1, 8, 8, generator=generator)
        y = torch.randint(0, 10, (16,), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def trained_states(count: int, optimizer: str = "adam") -> tuple[torch.nn.Module, list[dict]]:
    model = small_model()
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    else:  # "adam", or "adam95": beta2 = 0.95, as large language models are trained
        opt = torch.optim.Adam(model.parameters(), 1e-3, betas=(0.9, 0.95 if optimizer == "adam95" else 0.999))
    states = []
    for index in range(count):
        train_steps(model, opt, 5, start=5 * index)
        states.append(copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 5 * index}))
    return model, states


def by_key(state) -> dict[str, torch.Tensor]:
    return {format_key_path(leaf.path): leaf.tensor for leaf in flatten(state).tensors}


def codecs_and_bytes(path) -> dict[str, tuple[str, int]]:
    from inshrinkerator.container import ContainerReader
    from inshrinkerator.tree import tensor_paths

    with ContainerReader(open(path, "rb"), str(path)) as reader:
        paths = tensor_paths(reader.header.skeleton)
        return {
            format_key_path(paths[i]): (record.codec["id"], record.stored_bytes)
            for i, record in enumerate(reader.header.tensors)
        }


def level_count(codec) -> int:
    """The levels a planned DynaQuant codec quantizes to (a low-rank codec's: its inner
    codec's, which rounds what the product leaves)."""
    from inshrinkerator.codecs import get_codec

    inner = getattr(codec, "inner", None)
    return get_codec(inner).bins if isinstance(inner, dict) else codec.bins
