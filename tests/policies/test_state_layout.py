"""state_layout: roles of a state's tensors and optimizer-entry -> parameter pairing."""

from __future__ import annotations

import pytest
import torch

from inshrinkerator.policies.state_layout import (
    TensorRole,
    layout_of,
    param_group_ids,
    param_group_option,
)
from inshrinkerator.tree import flatten, format_key_path

from ..helpers import training_state

R = TensorRole


def describe(state, by_group: bool = False, frozen_keys: tuple[str, ...] = ()) -> tuple[dict[str, TensorRole], dict[str, str | None], object, list]:
    leaves = flatten(state).tensors
    frozen = [i for i, leaf in enumerate(leaves) if format_key_path(leaf.path) in frozen_keys]
    layout = layout_of(leaves, param_group_ids(state, leaves) if by_group else None, frozen)
    keys = [format_key_path(leaf.path) for leaf in leaves]
    roles = dict(zip(keys, layout.roles))
    paired = {
        key: (keys[p] if p is not None else None)
        for key, p in zip(keys, layout.parameter_of)
    }
    return roles, paired, layout, keys


def adam_state(model: torch.nn.Module, **optimizer_options) -> dict:
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3, **optimizer_options)
    loss = sum(p.sum() for p in model.parameters() if p.requires_grad)
    loss.backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}


def test_training_state_roles_and_pairs() -> None:
    roles, paired, layout, keys = describe(training_state(steps=2))
    assert roles["model/0.weight"] is R.WEIGHT and roles["model/4.bias"] is R.WEIGHT
    assert roles["model/1.running_mean"] is R.OTHER and roles["model/1.num_batches_tracked"] is R.OTHER
    assert roles["optimizer/state/0/exp_avg"] is R.FIRST_MOMENT
    assert roles["optimizer/state/0/exp_avg_sq"] is R.SECOND_MOMENT
    assert roles["optimizer/state/0/step"] is R.OTHER and roles["rng"] is R.OTHER
    # Parameter order: conv weight, conv bias, bn weight, bn bias, linear weight, linear bias.
    expected = ["model/0.weight", "model/0.bias", "model/1.weight", "model/1.bias", "model/4.weight", "model/4.bias"]
    for identifier, weight in enumerate(expected):
        assert paired[f"optimizer/state/{identifier}/exp_avg"] == weight
        assert paired[f"optimizer/state/{identifier}/exp_avg_sq"] == weight
        assert paired[f"optimizer/state/{identifier}/step"] is None
    linear = keys.index("model/4.weight")
    by_role = layout.optimizer_state_of(linear)
    assert {keys[i] for i in by_role.values()} == {"optimizer/state/4/exp_avg", "optimizer/state/4/exp_avg_sq"}
    assert layout.indices(R.SECOND_MOMENT) == [keys.index(f"optimizer/state/{i}/exp_avg_sq") for i in range(6)]


def test_sgd_momentum_buffers() -> None:
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    roles, paired, _, _ = describe({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    assert roles["optimizer/state/0/momentum_buffer"] is R.MOMENTUM_BUFFER
    assert paired["optimizer/state/1/momentum_buffer"] == "model/bias"


class _WithMaskBuffer(torch.nn.Module):
    """Float buffers between parameters, as nanoGPT's causal mask sits in its state dict."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.register_buffer("mask", torch.ones(1, 1, 4, 4))
        self.second = torch.nn.Linear(4, 2)


def test_float_buffers_between_parameters_are_skipped() -> None:
    roles, paired, _, _ = describe(adam_state(_WithMaskBuffer()))
    assert roles["model/mask"] is R.WEIGHT  # a float tensor of the model; only its shape tells
    assert paired["optimizer/state/1/exp_avg"] == "model/first.bias"
    assert paired["optimizer/state/2/exp_avg"] == "model/second.weight"
    assert paired["optimizer/state/3/exp_avg_sq"] == "model/second.bias"


def test_parameters_without_state_leave_gaps() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model[1](torch.randn(2, 5)).sum().backward()  # only the second layer gets gradients
    optimizer.step()
    roles, paired, _, _ = describe({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    assert paired["optimizer/state/2/exp_avg"] == "model/1.weight"
    assert paired["optimizer/state/3/exp_avg"] == "model/1.bias"


def test_amsgrad_maximum_is_an_accumulator_step_stays_other_and_string_ids_work() -> None:
    state = adam_state(torch.nn.Linear(3, 2), amsgrad=True)
    state["optimizer"]["state"] = {str(k): v for k, v in state["optimizer"]["state"].items()}
    roles, paired, _, _ = describe(state)
    assert roles["optimizer/state/0/max_exp_avg_sq"] is R.ACCUMULATOR
    assert roles["optimizer/state/0/step"] is R.OTHER
    assert paired["optimizer/state/0/exp_avg"] == "model/weight"
    assert paired["optimizer/state/0/max_exp_avg_sq"] == "model/weight"


def optimizer_state(model: torch.nn.Module, make) -> dict:
    optimizer = make(model.parameters())
    model(torch.randn(2, model.in_features)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda p: torch.optim.RMSprop(p), {"square_avg": R.SECOND_MOMENT}),
        (lambda p: torch.optim.RMSprop(p, momentum=0.9), {"square_avg": R.SECOND_MOMENT, "momentum_buffer": R.MOMENTUM_BUFFER}),
        (lambda p: torch.optim.Adagrad(p), {"sum": R.SECOND_MOMENT}),
        (lambda p: torch.optim.Adamax(p), {"exp_avg": R.FIRST_MOMENT, "exp_inf": R.ACCUMULATOR}),
        (lambda p: torch.optim.Adadelta(p), {"square_avg": R.SECOND_MOMENT, "acc_delta": R.ACCUMULATOR}),
        (lambda p: torch.optim.NAdam(p), {"exp_avg": R.FIRST_MOMENT, "exp_avg_sq": R.SECOND_MOMENT, "mu_product": R.OTHER}),
        (lambda p: torch.optim.RAdam(p), {"exp_avg": R.FIRST_MOMENT, "exp_avg_sq": R.SECOND_MOMENT}),
        (lambda p: torch.optim.Rprop(p), {"prev": R.OTHER, "step_size": R.OTHER}),
        (lambda p: torch.optim.ASGD(p), {"ax": R.OTHER, "eta": R.OTHER}),
    ],
    ids=["rmsprop", "rmsprop-momentum", "adagrad", "adamax", "adadelta", "nadam", "radam", "rprop", "asgd"],
)
def test_torch_optimizers_statistics_get_their_roles_and_pair(make, expected) -> None:
    roles, paired, layout, keys = describe(optimizer_state(torch.nn.Linear(3, 2), make))
    for name, role in {**expected, "step": R.OTHER}.items():
        key = f"optimizer/state/0/{name}"
        assert roles[key] is role, key
        assert paired[key] == ("model/weight" if role is not R.OTHER else None), key
    roles_of_weight = set(layout.optimizer_state_of(keys.index("model/weight")))
    assert roles_of_weight == {role for role in expected.values() if role is not R.OTHER}


def test_centered_rmsprop_keeps_its_square_average_exact() -> None:
    """``sqrt(square_avg - grad_avg**2)``: rounded independently it could go negative."""
    state = optimizer_state(torch.nn.Linear(3, 2), lambda p: torch.optim.RMSprop(p, momentum=0.9, centered=True))
    roles, paired, _, _ = describe(state)
    assert roles["optimizer/state/0/square_avg"] is R.OTHER
    assert roles["optimizer/state/0/grad_avg"] is R.OTHER
    assert roles["optimizer/state/0/momentum_buffer"] is R.MOMENTUM_BUFFER  # a step: free to round
    assert paired["optimizer/state/0/momentum_buffer"] == "model/weight"
    # An uncentered RMSprop elsewhere in the same state keeps its own role.
    other = optimizer_state(torch.nn.Linear(5, 4), lambda p: torch.optim.RMSprop(p))
    roles, _, _, _ = describe({"a": state, "b": other})
    assert roles["a/optimizer/state/0/square_avg"] is R.OTHER
    assert roles["b/optimizer/state/0/square_avg"] is R.SECOND_MOMENT


def test_shape_mismatch_leaves_entries_unpaired() -> None:
    state = adam_state(torch.nn.Linear(3, 2))
    state["model"] = {"other.weight": torch.randn(7, 7)}
    roles, paired, layout, _ = describe(state)
    assert roles["optimizer/state/0/exp_avg"] is R.FIRST_MOMENT
    assert all(p is None for p in paired.values())
    assert layout.optimizer_state_of(0) == {}


def test_bare_optimizer_state_has_no_weights() -> None:
    state = adam_state(torch.nn.Linear(3, 2))["optimizer"]
    roles, paired, layout, keys = describe(state)
    assert R.WEIGHT not in roles.values()
    assert all(p is None for p in paired.values())
    first = keys.index("state/0/exp_avg")
    assert {keys[i] for i in layout.entry_moments(first).values()} == {"state/0/exp_avg", "state/0/exp_avg_sq"}


def test_two_optimizers_claiming_the_same_weights_are_unpaired() -> None:
    model = torch.nn.Linear(3, 3)
    first = adam_state(model)["optimizer"]
    copy = {"state": {i: {k: v.clone() for k, v in entry.items()} for i, entry in first["state"].items()}}
    roles, paired, _, _ = describe({"model": model.state_dict(), "opt_a": first, "opt_b": copy})
    assert roles["opt_b/state/0/exp_avg"] is R.FIRST_MOMENT
    assert all(p is None for p in paired.values())


def test_two_optimizers_over_different_parameters_pair() -> None:
    generator, discriminator = torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)
    state_g = adam_state(generator)["optimizer"]
    state_d = adam_state(discriminator)["optimizer"]
    roles, paired, _, _ = describe(
        {"g": generator.state_dict(), "d": discriminator.state_dict(), "opt_g": state_g, "opt_d": state_d}
    )
    assert paired["opt_g/state/0/exp_avg"] == "g/weight"
    # opt_d's ids also start at 0; in-order matching skips g's differently shaped tensors.
    assert paired["opt_d/state/0/exp_avg"] == "d/weight"


def test_model_only_state_and_non_float_tensors() -> None:
    state = {
        "weights": torch.nn.Linear(2, 2).state_dict(),
        "labels": torch.arange(5),
        "mask": torch.ones(3, dtype=torch.bool),
        "scale": torch.tensor(2.0),
    }
    roles, paired, _, _ = describe(state)
    assert roles == {
        "weights/weight": R.WEIGHT,
        "weights/bias": R.WEIGHT,
        "labels": R.OTHER,
        "mask": R.OTHER,
        "scale": R.WEIGHT,
    }
    assert all(p is None for p in paired.values())


def test_empty_state() -> None:
    layout = layout_of([])
    assert layout.roles == () and layout.parameter_of == ()


def _split_state(model: torch.nn.Module, trained: list[torch.nn.Parameter]) -> dict:
    """AdamW over ``trained``, matrices in one group and vectors in another (weight decay on the
    matrices only), as transformer recipes do: ids are not in the state dict's order."""
    decay = [p for p in trained if p.dim() >= 2]
    rest = [p for p in trained if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])
    sum(p.sum() for p in trained).backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def test_param_groups_pair_a_decay_split_that_in_order_matching_gives_up_on() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    state = _split_state(model, list(model.parameters()))
    _, unpaired, _, _ = describe(state)
    assert all(p is None for p in unpaired.values())
    _, paired, _, _ = describe(state, by_group=True)
    # Ids: the matrices 0.weight, 2.weight, 3.weight, then the vectors in model order.
    expected = ["0.weight", "2.weight", "3.weight", "0.bias", "1.weight", "1.bias", "2.bias", "3.bias"]
    for identifier, key in enumerate(expected):
        assert paired[f"optimizer/state/{identifier}/exp_avg"] == f"model/{key}"
        assert paired[f"optimizer/state/{identifier}/exp_avg_sq"] == f"model/{key}"


def test_param_groups_skip_frozen_weights_of_the_same_shape() -> None:
    # A fine-tune trains the second of two equal layers: matched in order, its moments would
    # land on the first, frozen one; told which are frozen, they land on their own.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    for parameter in model[0].parameters():
        parameter.requires_grad_(False)
    state = _split_state(model, list(model[1].parameters()))
    _, wrong, _, _ = describe(state, by_group=True)
    assert wrong["optimizer/state/0/exp_avg"] == "model/0.weight"
    _, paired, _, _ = describe(state, by_group=True, frozen_keys=("model/0.weight", "model/0.bias"))
    assert paired["optimizer/state/0/exp_avg"] == "model/1.weight"
    assert paired["optimizer/state/1/exp_avg"] == "model/1.bias"


def test_param_group_ids_reads_only_well_formed_groups() -> None:
    model = torch.nn.Linear(3, 3)
    state = adam_state(model)
    leaves = flatten(state).tensors
    assert param_group_ids(state, leaves) == {("optimizer",): [[0, 1]]}
    state["optimizer"]["param_groups"][0]["params"] = ["0", 1]
    assert param_group_ids(state, leaves) == {}
    del state["optimizer"]["param_groups"]
    assert param_group_ids(state, leaves) == {}
    assert param_group_ids({"model": model.state_dict()}, flatten({"model": model.state_dict()}).tensors) == {}


def test_param_group_option_is_read_per_optimizer_entry() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    optimizer = torch.optim.AdamW(
        [{"params": model[0].parameters(), "betas": (0.9, 0.95)}, {"params": model[1].parameters()}], lr=1e-3
    )
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    leaves = flatten(state).tensors
    paths = ["/".join(str(key) for key in leaf.path) for leaf in leaves]
    betas = {paths[index]: value for index, value in param_group_option(state, leaves, "betas").items()}
    assert betas["optimizer/state/0/exp_avg_sq"] == (0.9, 0.95)
    assert betas["optimizer/state/1/step"] == (0.9, 0.95)
    assert betas["optimizer/state/2/exp_avg"] == (0.9, 0.999)
    assert not any(path.startswith("model/") for path in betas)
    assert param_group_option(state, leaves, "no such option") == {}
    del state["optimizer"]["param_groups"]
    assert param_group_option(state, leaves, "betas") == {}


def _named_state() -> dict:
    """A model and its AdamW state as ``torch.distributed.checkpoint``'s ``get_state_dict``
    returns them: the optimizer state keyed by parameter names, not ids."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    optimizer = torch.optim.AdamW(
        [{"params": [model[0].weight, model[2].weight], "weight_decay": 0.1},
         {"params": [model[0].bias, model[2].bias], "weight_decay": 0.0, "betas": (0.8, 0.95)}], lr=1e-3)
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state}


def test_an_optimizer_state_keyed_by_parameter_names_has_its_roles_and_pairs() -> None:
    state = _named_state()
    assert set(state["optim"]["state"]) == {"0.weight", "2.weight", "0.bias", "2.bias"}  # names, not ids
    roles, paired, _, _ = describe(state)
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        assert roles[f"model/{name}"] is R.WEIGHT
        assert roles[f"optim/state/{name}/exp_avg"] is R.FIRST_MOMENT
        assert roles[f"optim/state/{name}/exp_avg_sq"] is R.SECOND_MOMENT
        assert roles[f"optim/state/{name}/step"] is R.OTHER
        # The two biases have the same shape (64):
        # the name decides, not the order.
        assert paired[f"optim/state/{name}/exp_avg"] == f"model/{name}"
        assert paired[f"optim/state/{name}/exp_avg_sq"] == f"model/{name}"
    leaves = flatten(state).tensors
    keys = [format_key_path(leaf.path) for leaf in leaves]
    betas = param_group_option(state, leaves, "betas")
    assert betas[keys.index("optim/state/2.bias/exp_avg_sq")] == (0.8, 0.95)
    assert betas[keys.index("optim/state/2.weight/exp_avg_sq")] == (0.9, 0.999)


def test_a_named_entry_needs_an_optimizer_entry_name_and_a_weight_of_its_name_and_shape() -> None:
    weight = torch.randn(4, 4)
    state = {"model": {"a": weight, "b": torch.randn(4, 4)},
             "optim": {"state": {"a": {"exp_avg": torch.randn(4, 4), "exp_avg_sq": torch.rand(4, 4)},
                                 "c": {"exp_avg": torch.randn(4, 4)},
                                 "b": {"exp_avg": torch.randn(3, 4)}}},
             "env": {"state": {"obs": {"mean": torch.randn(5)}}}}
    roles, paired, _, _ = describe(state)
    assert roles["optim/state/a/exp_avg"] is R.FIRST_MOMENT and paired["optim/state/a/exp_avg"] == "model/a"
    assert roles["optim/state/a/exp_avg_sq"] is R.SECOND_MOMENT
    assert paired["optim/state/c/exp_avg"] is None  # no weight of that name
    assert paired["optim/state/b/exp_avg"] is None  # a weight of that name, another shape
    assert roles["env/state/obs/mean"] is R.WEIGHT  # "mean" is no optimizer entry: a plain tensor


def test_a_named_optimizer_state_keeps_its_second_moments_positive_under_dynaquant(tmp_path) -> None:
    import inshrinkerator as ink

    state = _named_state()
    ink.save(state, tmp_path / "named.ink", policy="dynaquant")
    restored = ink.load(tmp_path / "named.ink")
    for name, entry in state["optim"]["state"].items():
        second, back = entry["exp_avg_sq"], restored["optim"]["state"][name]["exp_avg_sq"]
        assert bool(((back > 0) | (second == 0)).all()), name  # Adam divides by its root
        assert torch.equal(restored["optim"]["state"][name]["step"], entry["step"])
