"""Bad or unusual state: NaN and infinities, denormals, meta and sparse tensors, parameters
that require grad, key paths that collide. Each is stored exactly, stored within the
policy's contract, or refused with ``UnsupportedStateError`` naming the key path, with
nothing written.

NaN and infinities (docs/guarantees.md): every registered policy stores a tensor holding any
of them exactly, bit for bit (``write_state`` swaps a lossy codec for the lossless one on such
a tensor), in full checkpoints and along a chain of deltas.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import inshrinkerator as ink
from inshrinkerator.errors import UnsupportedStateError
from inshrinkerator.policies import POLICY_NAMES
from inshrinkerator.store import CheckpointManager

from ..helpers import assert_same

LOSSY = [name for name in POLICY_NAMES if name != "lossless"]
#: float32 bit patterns: a quiet NaN with a payload, a negative NaN, the canonical NaN
ODD_NANS = [0x7FC00123, 0xFFC00000, 0x7FC00000]


def _float_bits(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(torch.int32).view(torch.float32)


def training_state(step: int = 0, poison: bool = True) -> dict[str, Any]:
    """A small MLP with Adam after ``step + 1`` steps; with ``poison``, NaN/±inf/-0.0 and
    NaNs with payloads in a weight, both Adam moments and a bf16 copy of a weight."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(step + 1):
        loss = model(torch.randn(8, 64)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
             "loss": float("nan"), "best": -math.inf}
    state["model"]["2.weight.bf16"] = state["model"]["2.weight"].to(torch.bfloat16)
    if poison:
        weight = state["model"]["0.weight"]
        weight.view(-1)[:6] = torch.cat([torch.tensor([math.nan, math.inf, -math.inf]), _float_bits(ODD_NANS)])
        weight[7, 7] = -0.0
        moments = state["optimizer"]["state"][0]
        moments["exp_avg"][3, 3], moments["exp_avg"][6, 6] = math.nan, -math.inf
        moments["exp_avg_sq"][4, 4], moments["exp_avg_sq"][5, 5] = math.inf, math.nan
        state["model"]["2.weight.bf16"][0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    return state


def _tensors(state: Any, path: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return {path: state}
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return {}
    found: dict[str, torch.Tensor] = {}
    for key, value in items:
        found.update(_tensors(value, f"{path}/{key}"))
    return found


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8).reshape(tensor.numel(), -1)


def non_finite_violations(saved: Any, loaded: Any, nan_bits_exact: bool) -> dict[str, str]:
    """Tensor key -> what broke: non-finite values must stay at their positions with their
    values (infinities exactly; NaN as NaN, bit for bit if ``nan_bits_exact``), non-float
    tensors and plain values exactly."""
    problems: dict[str, str] = {}
    originals, restored = _tensors(saved), _tensors(loaded)
    assert originals.keys() == restored.keys()
    for key, original in originals.items():
        back = restored[key]
        assert back.dtype == original.dtype and back.shape == original.shape, key
        if not original.is_floating_point():
            if not torch.equal(back, original):
                problems[key] = "a non-float tensor changed"
            continue
        nan, inf = torch.isnan(original), torch.isinf(original)
        if not torch.equal(~torch.isfinite(back), nan | inf):
            problems[key] = f"{int((nan | inf).sum())} non-finite values saved, {int((~torch.isfinite(back)).sum())} restored"
        elif not torch.equal(back[inf], original[inf]):
            problems[key] = "an infinity changed"
        elif nan_bits_exact and not torch.equal(_bits(back)[nan.reshape(-1)], _bits(original)[nan.reshape(-1)]):
            problems[key] = "a NaN came back with other bits"
    for key in ("step", "loss", "best"):
        assert_same(loaded[key], saved[key])
    return problems


def lossy_tensors(saved: Any, loaded: Any) -> list[str]:
    originals, restored = _tensors(saved), _tensors(loaded)
    return [key for key in originals if not torch.equal(_bits(originals[key]), _bits(restored[key]))]


@pytest.mark.parametrize("policy", list(POLICY_NAMES))
def test_non_finite_values_survive_every_policy_in_a_file(policy: str, tmp_path: Path) -> None:
    state = training_state()
    ink.save(state, tmp_path / "s.ink", policy=policy)
    loaded = ink.load(tmp_path / "s.ink")
    if policy == "lossless":
        assert_same(loaded, state)
    assert non_finite_violations(state, loaded, nan_bits_exact=False) == {}


def test_dynaquant_keeps_non_finite_values_outside_first_moments(tmp_path: Path) -> None:
    """The part of the contract dynaquant meets today: weights (fp32, bf16) and second moments."""
    state = training_state()
    ink.save(state, tmp_path / "s.ink", policy="dynaquant")
    problems = non_finite_violations(state, ink.load(tmp_path / "s.ink"), nan_bits_exact=False)
    assert set(problems) <= {"/optimizer/state/0/exp_avg"}, problems


@pytest.mark.parametrize("policy", LOSSY)
def test_nan_bits_survive_lossy_policies(policy: str, tmp_path: Path) -> None:
    state = training_state()
    ink.save(state, tmp_path / "s.ink", policy=policy)
    problems = non_finite_violations(state, ink.load(tmp_path / "s.ink"), nan_bits_exact=True)
    assert problems == {}


CHAIN = {0: False, 1: True, 2: True, 3: False}  # NaN appears, stays, and goes


def _saved_chain(policy: str, folder: Path) -> dict[int, Any]:
    with CheckpointManager(folder, policy=policy, full_every=10) as manager:
        for step, poison in CHAIN.items():
            manager.save(step, training_state(step, poison))
        return {step: manager.load(step) for step in CHAIN}


@pytest.mark.parametrize("policy", list(POLICY_NAMES))
def test_non_finite_values_through_a_chain_of_deltas(policy: str, tmp_path: Path) -> None:
    """Deltas against a reconstruction holding NaN, and from one, stay sound."""
    for step, loaded in _saved_chain(policy, tmp_path / "run").items():
        saved = training_state(step, CHAIN[step])
        if policy == "lossless":
            assert_same(loaded, saved)
        assert non_finite_violations(saved, loaded, nan_bits_exact=policy != "dynaquant") == {}, step


def test_the_lossy_policies_really_are_lossy_here(tmp_path: Path) -> None:
    """Control: in this chain every lossy policy changes some float tensor (LC-Checkpoint
    only once it has a previous step), so the checks above exercise their quantizers."""
    for policy in LOSSY:
        loaded = _saved_chain(policy, tmp_path / policy)
        changed = {key for step in CHAIN for key in lossy_tensors(training_state(step, CHAIN[step]), loaded[step])}
        assert changed, policy


def _denormal_state() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(3)
    tiny = torch.finfo(torch.float32).tiny  # smallest normal float32
    weight = torch.randn(64, 64, generator=generator) * 0.05
    weight.view(-1)[::97] = torch.rand(43, generator=generator) * tiny  # denormals among normal values
    return {
        "model": {
            "mixed.weight": weight,
            "all_denormal.weight": (torch.rand(64, 64, generator=generator) - 0.5) * tiny,
            "fp16_denormal.weight": torch.full((64, 64), 3e-6, dtype=torch.float16),
            "bf16_denormal.weight": (torch.rand(64, 64, generator=generator) * tiny).to(torch.bfloat16),
        }
    }


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_denormals(policy: str, tmp_path: Path) -> None:
    """Exact under lossless; under lossy policies finite and within the tensor's own range."""
    state = _denormal_state()
    assert all(bool((t != 0).any() & (t.abs() < torch.finfo(t.dtype).tiny).any()) for t in state["model"].values())
    ink.save(state, tmp_path / "d.ink", policy=policy)
    loaded = ink.load(tmp_path / "d.ink")
    if policy == "lossless":
        assert_same(loaded, state)
        return
    for key, original in state["model"].items():
        back = loaded["model"][key].float()
        assert bool(torch.isfinite(back).all()), f"{policy} {key}: a denormal became non-finite"
        bound = original.float().abs().max()
        assert float((back - original.float()).abs().max()) <= 2 * float(bound), f"{policy} {key}"


# --------------------------------------------------------------------------- refused state


REFUSED = ["meta", "sparse_coo", "sparse_csr", "quantized", "nested", "int_and_str_keys", "slash_in_key",
           "bool_and_str_keys"]


def _refused_states() -> dict[str, tuple[Any, str]]:
    dense = torch.eye(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # beta / deprecated tensor kinds say so when made
        return _refused_states_quietly(dense)


def _refused_states_quietly(dense: torch.Tensor) -> dict[str, tuple[Any, str]]:
    return {
        "meta": ({"model": {"w": torch.empty(4, 4, device="meta")}}, "model/w.*meta device"),
        "sparse_coo": ({"model": {"w": dense.to_sparse()}}, "model/w.*layout torch.sparse_coo"),
        "sparse_csr": ({"model": {"w": dense.to_sparse_csr()}}, "model/w.*layout torch.sparse_csr"),
        "quantized": (
            {"q": torch.quantize_per_tensor(dense, 0.1, 0, torch.quint8)}, "q.*quantized"),
        "nested": ({"n": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}, "n.*(nested|layout)"),
        "int_and_str_keys": ({"layers": {1: torch.ones(2), "1": torch.zeros(2)}}, "both named 'layers/1'"),
        "slash_in_key": ({"a/b": torch.ones(2), "a": {"b": torch.zeros(2)}}, "both named 'a/b'"),
        "bool_and_str_keys": ({True: torch.ones(2), "True": torch.zeros(2)}, "both named 'True'"),
    }


@pytest.mark.parametrize("case", REFUSED)
def test_refused_state_names_its_key_and_writes_nothing(case: str, tmp_path: Path) -> None:
    assert set(REFUSED) == set(_refused_states())
    state, message = _refused_states()[case]
    path = tmp_path / "model.ink"
    ink.save({"previous": torch.arange(3)}, path)
    with pytest.raises(UnsupportedStateError, match=message):
        ink.save(state, path)
    assert_same(ink.load(path), {"previous": torch.arange(3)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ink"]


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", ["meta", "sparse_coo", "int_and_str_keys"])
def test_refused_state_in_a_run_is_refused_at_save_and_the_run_goes_on(case: str, async_save: bool, tmp_path: Path) -> None:
    state, message = _refused_states()[case]
    with CheckpointManager(tmp_path / "run", policy="lossless", async_save=async_save) as manager:
        manager.save(1, {"w": torch.ones(3)})
        with pytest.raises(UnsupportedStateError, match=message):
            manager.save(2, state)  # async: refused on the caller's thread, not later in the worker
        assert manager.steps() == [1]
        manager.save(2, {"w": torch.zeros(3)})
        assert manager.steps() == [1, 2]
        assert_same(manager.load(2), {"w": torch.zeros(3)})


def test_colliding_names_of_one_tied_tensor_are_fine(tmp_path: Path) -> None:
    tied = torch.arange(4.0)
    ink.save({1: tied, "1": tied}, tmp_path / "t.ink")
    loaded = ink.load(tmp_path / "t.ink")
    assert list(loaded) == [1, "1"] and loaded[1] is loaded["1"]
    assert torch.equal(loaded[1], tied)


# --------------------------------------------------------------------------- requires_grad


def _parameter_state() -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(1)
    model = torch.nn.Linear(64, 48)
    model(torch.randn(2, 64)).sum().backward()  # .grad is set: saving must not touch it
    state = {
        "params": dict(model.named_parameters()),  # nn.Parameter, requires_grad
        "kept": model.state_dict(keep_vars=True),
        "non_leaf": model.weight * 2,  # part of an autograd graph
    }
    return model, state


def _plain(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    return type(state)((key, _plain(value)) for key, value in state.items())


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_parameters_that_require_grad_are_saved_detached(policy: str, tmp_path: Path) -> None:
    model, state = _parameter_state()
    grad_before = model.weight.grad.clone()
    ink.save(state, tmp_path / "p.ink", policy=policy)
    loaded = ink.load(tmp_path / "p.ink")
    for key, tensor in _tensors(loaded).items():
        assert type(tensor) is torch.Tensor and not tensor.requires_grad and tensor.grad_fn is None, key
    assert isinstance(state["params"]["weight"], torch.nn.Parameter) and state["params"]["weight"].requires_grad
    assert torch.equal(model.weight.grad, grad_before)
    if policy == "lossless":
        assert_same(loaded, _plain(state))
    model.load_state_dict(loaded["kept"])  # loads straight back into the module


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_parameters_that_require_grad_in_a_run(async_save: bool, tmp_path: Path) -> None:
    model, state = _parameter_state()
    before = _plain(state)
    with CheckpointManager(tmp_path / "run", policy="lossless", async_save=async_save) as manager:
        manager.save(0, state)
        with torch.no_grad():
            model.weight.add_(1.0)  # training goes on right after save returns
        manager.save(1, {**state, "non_leaf": model.weight * 2})
        first = manager.load(0)
        second = manager.load(1)
    assert_same(first, before)
    assert torch.equal(second["params"]["weight"], model.weight.detach())
    for tensor in [*_tensors(first).values(), *_tensors(second).values()]:
        assert type(tensor) is torch.Tensor and not tensor.requires_grad
