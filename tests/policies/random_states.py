"""Random training states for the random-state tests: small models, optimizers, damage
between saves, and the checks a restore must pass (see ``test_random_states.py``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from inshrinkerator import CheckpointManager
from inshrinkerator.policies import DynaQuant, Policy, resolve_policy
from inshrinkerator.store import describe_run, run_class_bytes, verify_run
from inshrinkerator.tree import flatten, format_key_path

#: ``INSHRINK_FUZZ_EXAMPLES=N``: a long campaign of N states instead of the CI budget.
LONG = int(os.environ.get("INSHRINK_FUZZ_EXAMPLES", "0"))


def variant_lists() -> st.SearchStrategy[tuple[str, ...]]:
    """Up to two of :data:`VARIANTS`' names."""
    return st.lists(st.sampled_from(sorted(VARIANTS)), max_size=2, unique=True).map(tuple)


def policy_named(name: str, variants: tuple[str, ...] = ()) -> Policy:
    """The policy ``name``; DynaQuant with the knobs of ``variants`` (:data:`VARIANTS`)."""
    if name != "dynaquant":
        return resolve_policy(name)
    knobs: dict[str, Any] = {}
    for variant in variants:
        knobs.update(VARIANTS[variant])
    return DynaQuant(**knobs)


def fuzz_settings(ci_examples: int, share: int = 1) -> Any:
    """Hypothesis settings for ``ci_examples`` states in CI, ``LONG // share`` in a campaign."""
    return settings(
        max_examples=LONG // share or ci_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
        database=None,
    )


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIMIZERS = ("adam", "adam-0.95", "adamw", "amsgrad", "nadam", "adamax", "sgd", "momentum",
              "nesterov", "rmsprop", "rmsprop-momentum", "rmsprop-centered", "adagrad")
DAMAGES = ("nan", "inf", "huge", "zero", "subnormal")
BASELINES = ("lc-checkpoint", "excp", "cnr", "qd")
#: The policies the entry-point tests draw from (DynaQuant twice: its variants are the most code).
POLICIES = ("lossless", "dynaquant", "dynaquant", *BASELINES)
#: Where a state keeps its weights: ours, and a Lightning checkpoint's.
WEIGHT_ROOTS = ("model", "state_dict")
#: Optimizer entries that hold second-order statistics (kept on log levels, or positive).
SECOND_ORDER = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum", "exp_inf")


def abs_sum(state: dict[str, torch.Tensor]) -> float:
    """A metric for ``evaluate``: the summed size of the finite floating weights."""
    return float(sum(
        v.float().abs().sum() for v in state.values() if v.is_floating_point() and torch.isfinite(v).all()
    ))


VARIANTS: dict[str, dict[str, Any]] = {
    "tight": {"tolerance": 1e-6},
    "loose": {"tolerance": 0.05},
    "sticky": {"stickiness": 1.0},
    "unpooled": {"pooled_error": False},
    "cell-means": {"cell_means": True},
    "no-residual": {"residual_error": None},
    "sign-grouped": {"sign_grouped_changes": True},
    "no-low-rank": {"low_rank_changes": False},
    "no-carry": {"carry_error": 0.0},
    "whole-first-moments": {"first_moment_keep": 1.0},
    "factored": {"second_moment": "factored"},
    "evaluate": {"evaluate": abs_sum},
    # Moments pruned at every save (by default only 30+ steps after the last checkpoint,
    # more than these runs train between saves): masks, joint masks, low-rank products.
    "prune-always": {"first_moment_keep_after": 0},
    "fine-budgets": {"small_weight_error": 1e-12, "first_moment_error": 1e-9, "first_moment_keep": 1.0},
    "coarse-levels": {"bins": (3,), "moment_bins": 1, "second_moment_bins": 2, "residual_bins": (1,)},
    "small-tensors-too": {"min_numel": 16, "moment_min_numel": 1, "small_min_numel": 1},
}


@dataclass(frozen=True)
class Damage:
    target: str  # "weight" or "moment"
    kind: str  # one of DAMAGES
    pick: int  # which parameter or optimizer entry (modulo their count)


@dataclass(frozen=True)
class Save:
    steps: int
    damage: Optional[Damage]
    reopen: bool = False  # saved by a new manager and policy, as after a restart


@dataclass(frozen=True)
class Scenario:
    seed: int
    width: int
    layers: tuple[tuple[str, int, bool], ...]  # (kind, width out, bias)
    dtype: str
    frozen: int
    optimizer: str
    lr: float
    variants: tuple[str, ...]
    full_every: int
    watch: bool
    saves: tuple[Save, ...]
    vocab: int = 0  # an embedding of this many rows added to the input (0: none)
    tied: bool = False  # an output layer sharing the embedding's weight
    conv: bool = False  # a Conv1d over the input added to it
    two_groups: bool = False  # the trained parameters in two param groups
    async_save: bool = False
    keep_last: Optional[int] = None  # retention: older steps deleted, chains rebased
    in_memory: bool = False  # the run in fsspec's memory:// store instead of a local folder
    named: bool = False  # the state as get_state_dict returns it: the optimizer's keyed by parameter names


def scenarios() -> st.SearchStrategy[Scenario]:
    widths = st.sampled_from([1, 2, 3, 16, 33, 40, 64, 130, 200])
    layer = st.tuples(st.sampled_from(["linear", "linear", "norm", "linear-relu"]), widths, st.booleans())
    damage = st.builds(Damage, st.sampled_from(["weight", "weight", "moment"]), st.sampled_from(DAMAGES),
                       st.integers(0, 20))
    save = st.builds(Save, st.integers(1, 12), st.one_of(st.none(), st.none(), damage), st.booleans())
    return st.builds(
        Scenario,
        seed=st.integers(0, 2**31 - 1),
        width=widths,
        layers=st.lists(layer, min_size=1, max_size=4).map(tuple),
        dtype=st.sampled_from(["float32", "float32", "bfloat16", "float16"]),
        frozen=st.sampled_from([0, 0, 0, 1, 2]),
        optimizer=st.sampled_from(OPTIMIZERS),
        lr=st.sampled_from([0.0, 1e-5, 1e-3, 1e-1, 1.0]),
        variants=st.lists(st.sampled_from(sorted(VARIANTS)), max_size=2, unique=True).map(tuple),
        full_every=st.sampled_from([1, 2, 10]),
        watch=st.booleans(),
        saves=st.lists(save, min_size=2, max_size=6).map(tuple),
        vocab=st.sampled_from([0, 0, 5, 40, 300]),
        tied=st.booleans(),
        conv=st.booleans(),
        two_groups=st.booleans(),
        async_save=st.booleans(),
        keep_last=st.sampled_from([None, None, 1, 2, 3]),
        in_memory=st.sampled_from([False, False, True]),
        named=st.sampled_from([False, False, True]),
    )


class RandomNet(torch.nn.Module):
    """The scenario's layers over its input, plus an embedding of token ids (perhaps tied
    to an output layer) and a convolution, each added to the input."""

    def __init__(self, scenario: Scenario) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        width = scenario.width
        for kind, out, bias in scenario.layers:
            if kind == "norm":
                layers.append(torch.nn.LayerNorm(width, elementwise_affine=True, bias=bias))
                continue
            layers.append(torch.nn.Linear(width, out, bias=bias))
            if kind == "linear-relu":
                layers.append(torch.nn.ReLU())
            width = out
        self.body = torch.nn.Sequential(*layers)
        self.embedding = torch.nn.Embedding(scenario.vocab, scenario.width) if scenario.vocab else None
        self.head = None
        if self.embedding is not None and scenario.tied:
            self.head = torch.nn.Linear(scenario.width, scenario.vocab, bias=False)
            self.head.weight = self.embedding.weight
        self.conv = torch.nn.Conv1d(1, 4, 3, padding=1) if scenario.conv else None

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = x + self.embedding(ids % self.embedding.num_embeddings)
        if self.conv is not None:
            x = x + self.conv(x.unsqueeze(1)).mean(dim=1)
        loss = self.body(x).float().pow(2).mean()
        if self.head is not None:
            loss = loss + self.head(x).float().pow(2).mean()
        return loss


def build_model(scenario: Scenario) -> torch.nn.Module:
    torch.manual_seed(scenario.seed)
    model = RandomNet(scenario).to(DTYPES[scenario.dtype])
    for parameter in list(model.parameters())[: scenario.frozen]:
        parameter.requires_grad_(False)
    return model


def build_optimizer(name: str, lr: float, trained: list[torch.nn.Parameter], two_groups: bool) -> torch.optim.Optimizer:
    optim = torch.optim
    parameters: Any = trained
    if two_groups and len(trained) > 1:
        half = len(trained) // 2
        parameters = [{"params": trained[:half]}, {"params": trained[half:], "lr": lr / 10}]
    makers = {
        "adam": lambda: optim.Adam(parameters, lr=lr),
        "adam-0.95": lambda: optim.Adam(parameters, lr=lr, betas=(0.9, 0.95)),
        "adamw": lambda: optim.AdamW(parameters, lr=lr),
        "amsgrad": lambda: optim.Adam(parameters, lr=lr, amsgrad=True),
        "nadam": lambda: optim.NAdam(parameters, lr=lr),
        "adamax": lambda: optim.Adamax(parameters, lr=lr),
        "sgd": lambda: optim.SGD(parameters, lr=lr),
        "momentum": lambda: optim.SGD(parameters, lr=lr, momentum=0.9),
        "nesterov": lambda: optim.SGD(parameters, lr=lr, momentum=0.9, nesterov=True),
        "rmsprop": lambda: optim.RMSprop(parameters, lr=lr),
        "rmsprop-momentum": lambda: optim.RMSprop(parameters, lr=lr, momentum=0.9),
        "rmsprop-centered": lambda: optim.RMSprop(parameters, lr=lr, centered=True),
        "adagrad": lambda: optim.Adagrad(parameters, lr=lr),
    }
    return makers[name]()


@torch.no_grad()
def apply_damage(damage: Damage, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    half = next(model.parameters()).dtype != torch.float32
    if damage.target == "weight":
        parameters = list(model.parameters())
        target = parameters[damage.pick % len(parameters)]
    else:
        entries = [
            value for per_parameter in optimizer.state.values() for value in per_parameter.values()
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 1
        ]
        if not entries:
            return
        target = entries[damage.pick % len(entries)]
    flat = target.view(-1)
    if damage.kind == "nan":
        flat[0] = float("nan")
    elif damage.kind == "inf":
        flat[-1] = float("inf")
    elif damage.kind == "huge":
        target.mul_(1e3 if half else 1e30 if damage.target == "weight" else 1e20)
    elif damage.kind == "zero":
        target.zero_()
    else:
        flat[0] = 1e-7 if half else 1e-42


def clone(value: Any, seen: Optional[dict[tuple[Any, ...], torch.Tensor]] = None) -> Any:
    """A deep copy in which views of the same memory (tied weights) stay one tensor."""
    seen = {} if seen is None else seen
    if isinstance(value, torch.Tensor):
        key = (value.data_ptr(), value.dtype, tuple(value.shape), value.stride())
        if key not in seen:
            seen[key] = value.clone()
        return seen[key]
    if isinstance(value, dict):  # an OrderedDict (a state_dict) stays one
        return type(value)((key, clone(item, seen)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(clone(item, seen) for item in value)
    return value


class Trainer:
    """A scenario's model and optimizer, trained on its random batches."""

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.model = build_model(scenario)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(
            scenario.optimizer, scenario.lr, trained or [torch.nn.Parameter(torch.zeros(2))], scenario.two_groups
        )
        self.generator = torch.Generator().manual_seed(scenario.seed)
        self.step = 0

    def train(self, plan: Save) -> dict[str, Any]:
        """Train ``plan.steps`` steps, apply its damage; a copy of the state to save."""
        dtype = DTYPES[self.scenario.dtype]
        for _ in range(plan.steps):
            rows = int(torch.randint(1, 9, (), generator=self.generator))
            x = torch.randn(rows, self.scenario.width, generator=self.generator).to(dtype)
            loss = self.model(torch.randint(0, 1000, (rows,), generator=self.generator), x)
            self.optimizer.zero_grad()
            if loss.requires_grad:
                loss.backward()
            self.optimizer.step()
            self.step += 1
        if plan.damage is not None:
            apply_damage(plan.damage, self.model, self.optimizer)
        optimizer_state = self.optimizer.state_dict()
        if self.scenario.named:
            optimizer_state = named_optimizer_state(self.model, self.optimizer, optimizer_state)
        return {"model": clone(self.model.state_dict()), "optimizer": clone(optimizer_state), "step": self.step}


def named_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (the optimizer's ``state_dict()``) keyed by parameter names, as
    ``torch.distributed.checkpoint``'s ``get_state_dict`` keys it (which refuses some of
    these models: frozen parameters, no state yet)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    order = [names.get(id(parameter), f"unnamed.{i}")
             for i, parameter in enumerate(p for group in optimizer.param_groups for p in group["params"])]
    return {
        "state": {order[int(identifier)]: entry for identifier, entry in state["state"].items()},
        "param_groups": [{**group, "params": [order[i] for i in group["params"]]} for group in state["param_groups"]],
    }


def run_through_manager(scenario: Scenario, folder: str, policy: Optional[str] = None) -> dict[int, tuple[Any, Any]]:
    """Train and save as ``scenario`` says into the run at ``folder`` (a path or URL) under
    the policy named ``policy`` (default: DynaQuant with the scenario's variants); the run
    must verify clean, and what ``inshrink info`` shows of it must hold together (every
    delta's base kept); step -> (state saved, state restored by a fresh manager)."""
    trainer = Trainer(scenario)

    def open_manager() -> CheckpointManager:
        fresh = CheckpointManager(
            folder, policy=policy_named(policy or "dynaquant", scenario.variants),
            full_every=scenario.full_every, async_save=scenario.async_save, keep_last=scenario.keep_last,
        )
        if scenario.watch:
            fresh.watch(trainer.model)
        return fresh

    saved: dict[int, Any] = {}
    manager = open_manager()
    try:
        for plan in scenario.saves:
            if plan.reopen:
                manager.close()
                manager = open_manager()
            state = trainer.train(plan)
            manager.save(trainer.step, state)
            saved[trainer.step] = state
    finally:
        manager.close()
    assert verify_run(folder) == []  # what `inshrink verify` reports
    entries = describe_run(folder)  # and `inshrink info --classes`
    steps = [entry.step for entry in entries]
    assert sorted(run_class_bytes(folder)) == steps
    for entry in entries:  # retention never leaves a delta without its base
        assert (entry.kind == "full") == (entry.base_step is None) and entry.base_step in (None, *steps), entry
    with CheckpointManager(folder) as manager:
        kept = manager.steps()
        assert kept == sorted(saved)[-scenario.keep_last:] if scenario.keep_last else sorted(saved), kept
        return {step: (saved[step], manager.load(step)) for step in kept}


def identical(a: Any, b: Any) -> bool:
    """The same structure, plain values and tensors bit for bit (NaN where NaN)."""
    left, right = flatten(a), flatten(b)
    if left.skeleton != right.skeleton:
        return False
    for x, y in zip(left.tensors, right.tensors):
        x, y = x.tensor, y.tensor
        if (x.dtype, x.shape) != (y.dtype, y.shape):
            return False
        if x.is_floating_point():
            if not torch.equal(x.isnan(), y.isnan()) or not torch.equal(x.nan_to_num(7.0), y.nan_to_num(7.0)):
                return False
        elif not torch.equal(x, y):
            return False
    return True


def problems(saved: Any, restored: Any, bounded: bool = True) -> list[str]:
    """What breaks the module's promises between one saved state and its restore
    (``bounded``: with the bounds on the finite values' errors)."""
    before, after = flatten(saved), flatten(restored)
    if before.skeleton != after.skeleton:
        return ["the structure or a plain value changed"]
    pairs = {format_key_path(leaf.path): (leaf.tensor, back.tensor) for leaf, back in zip(before.tensors, after.tensors)}
    found = []
    for name, (saved_tensor, restored_tensor) in pairs.items():
        second = pairs.get(name + "_sq") if name.endswith("/exp_avg") else None
        found.extend(
            f"{name}: {issue}" for issue in tensor_problems(name, saved_tensor, restored_tensor, bounded, second)
        )
    return found


def tensor_problems(
    name: str, saved: torch.Tensor, restored: torch.Tensor, bounded: bool = True,
    second: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> list[str]:
    """What breaks the promises for one tensor. ``second``: an Adam first moment's second
    moment, saved and restored. A first moment stored as a product of its steps
    ``m / sqrt(v)`` keeps the steps (the update the optimizer takes), scaled by ``sqrt(v)``
    as stored, so over a coarse second moment the moment itself may be off by more than
    its bound while its steps are not: either is accepted."""
    if (saved.dtype, saved.shape) != (restored.dtype, restored.shape):
        return [f"{restored.dtype}{list(restored.shape)} restored for {saved.dtype}{list(saved.shape)}"]
    if not saved.is_floating_point():
        return [] if torch.equal(saved, restored) else ["a non-float tensor changed"]
    a, b = saved.double(), restored.double()
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)):
        return [f"{int((~finite).sum())} non-finite values saved, {int((~torch.isfinite(b)).sum())} restored"]
    if not torch.equal(a[~finite].nan_to_num(nan=7.0), b[~finite].nan_to_num(nan=7.0)):
        return ["a non-finite value changed"]
    weight = name.split("/", 1)[0] in WEIGHT_ROOTS
    second_order = name.rsplit("/", 1)[-1] in SECOND_ORDER and not weight
    if second_order and bool((b[finite] < 0).any()):
        return ["a second-order statistic restored negative"]
    if not bounded or second_order or not finite.any():
        return []
    size, error = float(a[finite].norm()), float((a[finite] - b[finite]).norm())
    if size == 0:
        return [] if error == 0 else [f"a tensor of zeros restored with norm {error:.3g}"]
    bound = 0.6 if weight else 1.5
    if error <= bound * size:
        return []
    if second is not None and _steps_within(a, b, second, bound):
        return []
    return [f"relative error {error / size:.3g} above {bound}"]


def _steps_within(saved: torch.Tensor, restored: torch.Tensor, second: tuple[torch.Tensor, torch.Tensor], bound: float) -> bool:
    """Whether Adam's steps ``m / (sqrt(v) + eps)`` came back within ``bound`` of their norm."""
    v, v_restored = (tensor.double().clamp(min=0) for tensor in second)
    if v.shape != saved.shape or v_restored.shape != saved.shape:
        return False
    steps, steps_restored = saved / (v.sqrt() + 1e-8), restored / (v_restored.sqrt() + 1e-8)
    finite = torch.isfinite(steps) & torch.isfinite(steps_restored)
    size = float(steps[finite].norm())
    return size > 0 and float((steps[finite] - steps_restored[finite]).norm()) <= bound * size
