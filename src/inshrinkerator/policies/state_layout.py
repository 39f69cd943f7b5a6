"""The role of every tensor in a training state, and which parameter each optimizer entry serves.

Policies treat weights, optimizer moments and everything else differently, but
they only see flattened tensors with their key paths. This module reads those
paths:

- An *optimizer state entry* is a tensor at ``<root>/state/<id>/<name>`` (a
  ``torch.optim`` ``state_dict()`` anywhere in the state, ``<id>`` an int or a
  digit string; or a parameter's name, as ``torch.distributed.checkpoint``'s
  ``get_state_dict`` keys the state, where ``<name>`` is one of
  :data:`OPTIMIZER_ENTRY_ROLES`, ``step`` or a statistic :data:`EXACT_WITH` names).
  Its role comes from its name (:data:`OPTIMIZER_ENTRY_ROLES`):
  a signed average of gradients (Adam's ``exp_avg``) is a
  :attr:`TensorRole.FIRST_MOMENT`; an average or sum of squared gradients
  (Adam's ``exp_avg_sq``, RMSprop's and Adadelta's ``square_avg``, Adagrad's
  ``sum``) a :attr:`TensorRole.SECOND_MOMENT`; a momentum buffer (SGD, RMSprop)
  a :attr:`TensorRole.MOMENTUM_BUFFER`; another non-negative running statistic
  (AMSGrad's ``max_exp_avg_sq``, Adamax's ``exp_inf``, Adadelta's ``acc_delta``)
  an :attr:`TensorRole.ACCUMULATOR`. ``step`` and any other name are
  :attr:`TensorRole.OTHER`, and so are the statistics :data:`EXACT_WITH` names for an
  entry that holds its key (centered RMSprop takes ``sqrt(square_avg - grad_avg**2)``:
  rounded independently, it could go negative).
  Everything under such a ``<root>`` belongs to the optimizer.
- A :attr:`TensorRole.WEIGHT` is any other floating tensor, except the module
  buffers ``running_mean``, ``running_var`` and ``num_batches_tracked`` (the last
  part of a dotted ``state_dict`` key; OTHER).
- Everything else (integer, bool and complex tensors, RNG states) is OTHER.

Pairing. ``torch.optim`` numbers parameters in the order they were passed to it,
normally ``model.parameters()``, which is the order of the model's
``state_dict()`` without its buffers. So the entries of one optimizer, by
increasing id, are matched in order to the WEIGHT tensors, skipping weights whose
shape differs from the entry's (unnamed float buffers, such as a causal mask,
sit between parameters in a state dict; parameters without optimizer state leave
gaps in the ids). If the matching runs out of weights, or two optimizers claim
the same weight, that optimizer's entries stay unpaired: pairing only steers
compression decisions, never correctness, so an unsure match is dropped.

Entries keyed by a parameter's name pair with the one weight whose last key is that name
and whose shape is theirs (``get_state_dict``'s model state is keyed by the same names).

Given the optimizer's param groups (:func:`param_group_ids`, read from the state),
each group's ids are matched in order on their own, among the weights no earlier group
took and that are not known to be frozen. ``torch.optim`` numbers the parameters group
after group, so a decay / no-decay split (matrices first, then vectors) is not the state
dict's order: the plain matching gives up on it.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from ..tree import KeyPath, TensorLeaf

__all__ = [
    "TensorRole", "StateLayout", "layout_of", "optimizer_entry_name", "param_group_ids", "param_group_option",
    "MODULE_BUFFER_NAMES",
    "OPTIMIZER_ENTRY_ROLES", "EXACT_WITH",
]


class TensorRole(enum.Enum):
    """What a tensor is in a training state."""

    WEIGHT = "weight"
    FIRST_MOMENT = "first_moment"
    SECOND_MOMENT = "second_moment"
    MOMENTUM_BUFFER = "momentum_buffer"
    ACCUMULATOR = "accumulator"
    OTHER = "other"


#: Optimizer state names with a role of their own (``torch.optim``'s); every other name is OTHER.
OPTIMIZER_ENTRY_ROLES: dict[str, TensorRole] = {
    "exp_avg": TensorRole.FIRST_MOMENT,  # Adam, AdamW, NAdam, RAdam, Adamax
    "exp_avg_sq": TensorRole.SECOND_MOMENT,  # Adam, AdamW, NAdam, RAdam
    "square_avg": TensorRole.SECOND_MOMENT,  # RMSprop, Adadelta
    "sum": TensorRole.SECOND_MOMENT,  # Adagrad
    "momentum_buffer": TensorRole.MOMENTUM_BUFFER,  # SGD, RMSprop
    "max_exp_avg_sq": TensorRole.ACCUMULATOR,  # AMSGrad
    "exp_inf": TensorRole.ACCUMULATOR,  # Adamax
    "acc_delta": TensorRole.ACCUMULATOR,  # Adadelta
}

#: Entry name -> the statistics of the same entry kept exact (OTHER) beside it: the optimizer
#: combines them in a way independent rounding could break (centered RMSprop).
EXACT_WITH: dict[str, frozenset[str]] = {"grad_avg": frozenset({"square_avg"})}

#: Module buffers that are model state but not parameters (never paired, role OTHER).
MODULE_BUFFER_NAMES = frozenset({"running_mean", "running_var", "num_batches_tracked"})

_MOMENT_ROLES = frozenset(OPTIMIZER_ENTRY_ROLES.values())


@dataclass(frozen=True)
class StateLayout:
    """Roles and parameter pairing of a state's tensors, by leaf index.

    Attributes:
        roles: the role of each leaf.
        parameter_of: for an optimizer state leaf, the index of the WEIGHT leaf it
            belongs to (``None`` when unpaired); ``None`` for every other leaf.
    """

    roles: tuple[TensorRole, ...]
    parameter_of: tuple[Optional[int], ...]
    _by_weight: dict[int, dict[TensorRole, int]] = field(default_factory=dict, repr=False, compare=False)
    _by_entry: dict[int, dict[TensorRole, int]] = field(default_factory=dict, repr=False, compare=False)

    def optimizer_state_of(self, weight: int) -> dict[TensorRole, int]:
        """The moment leaves paired with WEIGHT leaf ``weight``, by role (empty when none)."""
        return dict(self._by_weight.get(weight, {}))

    def entry_moments(self, index: int) -> dict[TensorRole, int]:
        """The moment leaves of the optimizer entry (same optimizer, same id) holding leaf ``index``.

        Includes ``index`` itself; works for unpaired entries too; empty for other leaves.
        """
        return dict(self._by_entry.get(index, {}))

    def indices(self, role: TensorRole) -> list[int]:
        """The leaf indices with ``role``, in order."""
        return [index for index, r in enumerate(self.roles) if r is role]


#: The entry names that mark ``<root>/state/<name of a parameter>/<name>`` as an optimizer's.
_NAMED_ENTRY_NAMES = frozenset(OPTIMIZER_ENTRY_ROLES) | {"step"} | frozenset(EXACT_WITH)


def _optimizer_entry(path: KeyPath) -> Optional[tuple[KeyPath, Union[int, str], str]]:
    """``(root, id, name)`` when ``path`` is ``<root>/state/<id>/<name>``: ``id`` an int
    (a digit string read as one) or, for the entry names of :data:`_NAMED_ENTRY_NAMES`, a
    parameter's name."""
    if len(path) < 3 or path[-3] != "state" or not isinstance(path[-1], str):
        return None
    identifier: Union[str, int] = path[-2]
    if isinstance(identifier, bool):
        return None
    if isinstance(identifier, str):
        if identifier.isdigit():
            identifier = int(identifier)
        elif not identifier or path[-1] not in _NAMED_ENTRY_NAMES:
            return None
    return path[:-3], identifier, path[-1]


def optimizer_entry_name(path: KeyPath) -> Optional[str]:
    """The entry's name (``exp_avg``, ``step``, ...) when ``path`` is an optimizer state entry
    ``<root>/state/<id>/<name>``, else None."""
    entry = _optimizer_entry(path)
    return entry[2] if entry is not None else None


def _role_of_entry(name: str, tensor: torch.Tensor, exact: bool) -> TensorRole:
    role = OPTIMIZER_ENTRY_ROLES.get(name, TensorRole.OTHER)
    return role if tensor.dtype.is_floating_point and not exact else TensorRole.OTHER


def _match_by_name(
    entries: Mapping[str, dict[TensorRole, int]],
    leaves: Sequence[TensorLeaf],
    weights: list[int],
) -> dict[str, int]:
    """Parameter name -> the one weight leaf whose last key is that name and whose shape
    is its entries' (a name without exactly one such weight is left out)."""
    by_name: dict[str, list[int]] = {}
    for index in weights:
        by_name.setdefault(str(leaves[index].path[-1]) if leaves[index].path else "", []).append(index)
    matched: dict[str, int] = {}
    for name, moments in entries.items():
        shapes = {tuple(leaves[i].tensor.shape) for i in moments.values()}
        candidates = [w for w in by_name.get(name, []) if {tuple(leaves[w].tensor.shape)} == shapes]
        if len(candidates) == 1:
            matched[name] = candidates[0]
    return matched


def _match_in_order(
    entries: dict[int, dict[TensorRole, int]],
    leaves: Sequence[TensorLeaf],
    weights: list[int],
) -> Optional[dict[int, int]]:
    """Optimizer id -> weight leaf index, or ``None`` when the ids cannot be matched in order."""
    matched: dict[int, int] = {}
    offset = 0
    for identifier in sorted(entries):
        shapes = {tuple(leaves[i].tensor.shape) for i in entries[identifier].values()}
        if len(shapes) != 1:
            return None
        (shape,) = shapes
        position = identifier + offset
        while position < len(weights) and tuple(leaves[weights[position]].tensor.shape) != shape:
            position += 1
        if position >= len(weights):
            return None
        matched[identifier] = weights[position]
        offset = position - identifier
    return matched


def _match_by_group(
    entries: dict[int, dict[TensorRole, int]],
    leaves: Sequence[TensorLeaf],
    weights: list[int],
    groups: Sequence[Sequence[int]],
    frozen: Collection[int],
) -> dict[int, int]:
    """Optimizer id -> weight leaf index, each group's ids matched in order among the
    weights not taken by an earlier group nor frozen (an id without a match is left out)."""
    matched: dict[int, int] = {}
    taken = set(frozen)
    for group in groups:
        position = 0
        for identifier in group:
            if identifier not in entries:
                continue
            shapes = {tuple(leaves[i].tensor.shape) for i in entries[identifier].values()}
            if len(shapes) != 1:
                continue
            (shape,) = shapes
            found = next(
                (p for p in range(position, len(weights))
                 if weights[p] not in taken and tuple(leaves[weights[p]].tensor.shape) == shape),
                None,
            )
            if found is None:
                continue
            matched[identifier] = weights[found]
            taken.add(weights[found])
            position = found + 1
    return matched


def _child(node: Any, key: Union[str, int]) -> Any:
    """``node[key]`` for a key path element (keys other than str and int appear as their str)."""
    if isinstance(node, Mapping):
        if key in node:
            return node[key]
        return next((value for candidate, value in node.items() if str(candidate) == str(key)), None)
    if isinstance(node, (list, tuple)) and isinstance(key, int) and 0 <= key < len(node):
        return node[key]
    return None


def _param_groups(state: Any, leaves: Sequence[TensorLeaf], names: bool = False) -> dict[KeyPath, list[Mapping]]:
    """Optimizer root -> its param groups, for every optimizer state in ``state`` (the state
    ``leaves`` were flattened from) whose ``param_groups`` all have integer ``params`` lists
    (or, with ``names``, lists of integers or parameter names)."""
    kinds = (int, str) if names else int
    roots = dict.fromkeys(entry[0] for entry in map(_optimizer_entry, (leaf.path for leaf in leaves)) if entry)
    found: dict[KeyPath, list[Mapping]] = {}
    for root in roots:
        node = state
        for key in root:
            node = _child(node, key)
            if node is None:
                break
        groups = _child(node, "param_groups") if node is not None else None
        if not isinstance(groups, (list, tuple)):
            continue
        ids = [group.get("params") if isinstance(group, Mapping) else None for group in groups]
        if all(
            isinstance(params, (list, tuple))
            and all(isinstance(i, kinds) and not isinstance(i, bool) for i in params)
            for params in ids
        ):
            found[root] = list(groups)
    return found


def param_group_ids(state: Any, leaves: Sequence[TensorLeaf]) -> dict[KeyPath, list[list[int]]]:
    """Optimizer root -> the parameter ids of each of its param groups, in order, for every
    optimizer state in ``state`` (the state ``leaves`` were flattened from) that has
    ``param_groups`` with integer ``params`` lists."""
    return {root: [list(group["params"]) for group in groups] for root, groups in _param_groups(state, leaves).items()}


def param_group_option(state: Any, leaves: Sequence[TensorLeaf], option: str) -> dict[int, Any]:
    """Leaf index -> the value of ``option`` (e.g. ``"betas"``) in the param group holding
    that leaf's optimizer entry, for every optimizer state entry of ``state`` whose group
    (as :func:`param_group_ids` reads them, or listing parameter names) has the option."""
    values: dict[KeyPath, dict[Union[int, str], Any]] = {}
    for root, groups in _param_groups(state, leaves, names=True).items():
        by_id = values.setdefault(root, {})
        for group in groups:
            if option in group:
                by_id.update(dict.fromkeys(group["params"], group[option]))
    found: dict[int, Any] = {}
    for index, leaf in enumerate(leaves):
        entry = _optimizer_entry(leaf.path)
        if entry is not None and entry[1] in values.get(entry[0], {}):
            found[index] = values[entry[0]][entry[1]]
    return found


def layout_of(
    leaves: Sequence[TensorLeaf],
    param_groups: Optional[Mapping[KeyPath, Sequence[Sequence[int]]]] = None,
    frozen: Collection[int] = (),
) -> StateLayout:
    """Classify every leaf of a flattened state and pair optimizer entries with weights.

    ``param_groups`` (from :func:`param_group_ids`) pairs each group on its own, skipping
    the weight leaves in ``frozen`` (known not to train); without them, ids are matched
    in order across the whole optimizer.
    """
    roles: list[TensorRole] = []
    roots: dict[KeyPath, dict[Union[int, str], dict[TensorRole, int]]] = {}
    entries = [_optimizer_entry(leaf.path) for leaf in leaves]
    exact: dict[tuple[KeyPath, Union[int, str]], frozenset[str]] = {}
    for entry in entries:
        if entry is not None and entry[2] in EXACT_WITH:
            exact[entry[:2]] = exact.get(entry[:2], frozenset()) | EXACT_WITH[entry[2]]
    for index, leaf in enumerate(leaves):
        entry = entries[index]
        if entry is None:
            roles.append(TensorRole.OTHER)  # settled below, once every optimizer root is known
            continue
        root, identifier, name = entry
        role = _role_of_entry(name, leaf.tensor, name in exact.get((root, identifier), ()))
        roles.append(role)
        per_id = roots.setdefault(root, {})
        if role in _MOMENT_ROLES:
            per_id.setdefault(identifier, {})[role] = index
    for index, leaf in enumerate(leaves):
        path = leaf.path
        if entries[index] is not None or any(path[: len(root)] == root for root in roots):
            continue
        # state_dict keys are dotted module paths: "1.running_mean" is a BatchNorm buffer.
        name = str(path[-1]).rsplit(".", 1)[-1] if path else ""
        if leaf.tensor.dtype.is_floating_point and name not in MODULE_BUFFER_NAMES:
            roles[index] = TensorRole.WEIGHT
    weights = [index for index, role in enumerate(roles) if role is TensorRole.WEIGHT]

    parameter_of: list[Optional[int]] = [None] * len(leaves)
    by_weight: dict[int, dict[TensorRole, int]] = {}
    by_entry = {index: group for per_id in roots.values() for group in per_id.values() for index in group.values()}
    matches: dict[KeyPath, dict[Union[int, str], int]] = {}
    for root, per_id in roots.items():
        numbered = {i: e for i, e in per_id.items() if isinstance(i, int) and e}
        named = {i: e for i, e in per_id.items() if isinstance(i, str) and e}
        found: dict[Union[int, str], int] = dict(_match_by_name(named, leaves, weights))
        if param_groups is not None and root in param_groups:
            matched: Optional[dict[int, int]] = _match_by_group(numbered, leaves, weights, param_groups[root], frozen)
        else:
            matched = _match_in_order(numbered, leaves, weights)
        found.update(matched or {})  # ids that cannot be matched in order stay unpaired
        matches[root] = found
    claims = Counter(weight for matched in matches.values() for weight in matched.values())
    contested = {root for root, matched in matches.items() if any(claims[w] > 1 for w in matched.values())}
    for root, matched in matches.items():
        if root in contested:
            continue
        for identifier, weight in matched.items():
            for role, index in roots[root][identifier].items():
                parameter_of[index] = weight
                by_weight.setdefault(weight, {})[role] = index
    return StateLayout(tuple(roles), tuple(parameter_of), by_weight, by_entry)
