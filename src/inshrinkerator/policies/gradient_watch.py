"""Gradient statistics for sensitivity-aware quantization, collected by hooks on a model.

:class:`GradientWatch` registers a post-accumulate-grad hook on every trainable
parameter of a watched model, and remembers its frozen parameters and its buffers (whether
a parameter trains is read at save time: a layer unfrozen later trains). After each
backward pass the hook folds the new gradient into an exponential moving average,
``ema = beta * g + (1 - beta) * ema`` (beta = 0.9 weights the *new* gradient, as in
Inshrinkerator), so at save time the average reflects the last few steps before the save.
The first-order Taylor estimate of a weight's importance is then ``|ema * w|``.

The average lives on the parameter's device; updating it costs one fused
elementwise pass per parameter per step. Leaves of a saved state are matched to
parameters by storage (a ``state_dict`` shares it) or, for copied states (async
saves), by the ``state_dict`` key and shape. The watch also records each
parameter's module type, which the quantizer uses for per-layer-type thresholds.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch

from ..tree import TensorLeaf

__all__ = ["GradientWatch", "layer_type_of_module"]

_LAYER_TYPES = (
    ("Embedding", "embedding"),
    ("Conv", "conv"),
    ("Linear", "linear"),
    ("Norm", "norm"),
    ("MultiheadAttention", "attention"),
)


def layer_type_of_module(module: torch.nn.Module) -> str:
    """``"embedding"``, ``"conv"``, ``"linear"``, ``"norm"``, ``"attention"`` or ``"other"``."""
    name = type(module).__name__
    for marker, kind in _LAYER_TYPES:
        if marker in name:
            return kind
    return "other"


class _Entry:
    __slots__ = ("name", "parameter", "average", "layer_type", "steps", "hooked", "is_parameter")

    def __init__(self, name: str, parameter: torch.Tensor, layer_type: str, is_parameter: bool = True) -> None:
        self.hooked = is_parameter and parameter.requires_grad
        self.is_parameter = is_parameter
        self.name = name
        self.parameter = weakref.ref(parameter)
        self.average: Optional[torch.Tensor] = None
        self.layer_type = layer_type
        self.steps = 0


class GradientWatch:
    """Moving averages of the gradients of watched models' parameters.

    Args:
        beta: weight of the newest gradient in the average (0 < beta <= 1).
    """

    def __init__(self, beta: float = 0.9) -> None:
        if not 0.0 < beta <= 1.0:
            raise ValueError(f"beta must be in (0, 1], got {beta}")
        self.beta = beta
        self._entries: list[_Entry] = []
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._lock = threading.Lock()
        # (entries by storage address, entries by name): built on the first lookup after
        # attach() or refresh(), so matching a state's leaves costs O(leaves), not
        # O(leaves x parameters).
        self._index: Optional[tuple[dict[int, list[_Entry]], dict[str, _Entry]]] = None

    def attach(self, model: torch.nn.Module) -> None:
        """Start averaging the gradients of ``model``'s trainable parameters.

        A parameter unfrozen later counts as trained (:meth:`trains`) at once; its gradients
        are averaged from the next :meth:`hook_unfrozen` on (until then sensitivity falls
        back to magnitude for it).

        Watching a new model (e.g. rebuilt after a restore) replaces the previous one.
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"watch() needs a torch.nn.Module, got {type(model).__name__}")
        self.detach()
        owners = {}
        for module_name, module in model.named_modules():
            for parameter_name, parameter in module.named_parameters(recurse=False):
                full = f"{module_name}.{parameter_name}" if module_name else parameter_name
                owners[full] = layer_type_of_module(module)
        for name, parameter in model.named_parameters():
            if not parameter.dtype.is_floating_point:
                continue
            entry = _Entry(name, parameter, owners.get(name, "other"))
            self._entries.append(entry)
            # A frozen parameter is known (whether it trains is read at save time) but has
            # no hook: torch does not hook a tensor that does not require grad.
            if entry.hooked:
                self._handles.append(parameter.register_post_accumulate_grad_hook(self._hook(entry)))
        # Buffers are known too: no gradient trains them (trains() is False for them).
        for name, buffer in model.named_buffers():
            if buffer.dtype.is_floating_point:
                self._entries.append(_Entry(name, buffer, owners.get(name, "other"), is_parameter=False))

    def hook_unfrozen(self) -> int:
        """Start averaging the gradients of watched parameters unfrozen since they were
        watched (progressive unfreezing); returns how many were hooked.

        Call it on the thread that trains, between steps: it adds hooks to live tensors.
        Averages already collected are kept, unlike watching the model again.
        """
        hooked = 0
        for entry in self._entries:
            if entry.hooked or not entry.is_parameter:
                continue
            parameter = entry.parameter()
            if parameter is not None and parameter.requires_grad:
                self._handles.append(parameter.register_post_accumulate_grad_hook(self._hook(entry)))
                entry.hooked = True
                hooked += 1
        return hooked

    def _hook(self, entry: _Entry):  # noqa: ANN202 - a torch hook
        beta = self.beta

        @torch.no_grad()
        def update(parameter: torch.Tensor) -> None:
            grad = parameter.grad
            if grad is None or grad.is_sparse:
                return
            with self._lock:
                if entry.average is None or entry.average.shape != grad.shape:
                    entry.average = grad.detach().clone()
                else:
                    entry.average.mul_(1.0 - beta).add_(grad, alpha=beta)
                entry.steps += 1

        return update

    def gradient_steps(self) -> Optional[int]:
        """The most gradients any watched parameter received since it was watched: the
        backward passes since (None when no parameter is hooked)."""
        with self._lock:
            counts = [entry.steps for entry in self._entries if entry.hooked]
        return max(counts) if counts else None

    def detach(self) -> None:
        """Remove the hooks and forget the averages."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._entries.clear()
        self._index = None

    def refresh(self) -> None:
        """Forget where the parameters' storage was (they may have moved since the last save)."""
        self._index = None

    @property
    def watching(self) -> bool:
        return bool(self._entries)

    def _lookup_tables(self) -> tuple[dict[int, list[_Entry]], dict[str, _Entry]]:
        if self._index is None:
            by_storage: dict[int, list[_Entry]] = {}
            by_name: dict[str, _Entry] = {}
            for entry in self._entries:
                parameter = entry.parameter()
                if parameter is None:
                    continue
                if parameter.numel():
                    by_storage.setdefault(parameter.untyped_storage().data_ptr(), []).append(entry)
                by_name.setdefault(entry.name, entry)
            self._index = (by_storage, by_name)
        return self._index

    def _find(self, leaf: TensorLeaf) -> Optional[_Entry]:
        """The entry of the parameter or buffer ``leaf`` holds: the one sharing its storage
        (a ``state_dict``), else the one whose name ends its key path (a copied state), of
        the same shape."""
        by_storage, by_name = self._lookup_tables()
        tensor = leaf.tensor
        shape = tuple(tensor.shape)

        def alive_with_shape(entry: Optional[_Entry]) -> bool:
            parameter = entry.parameter() if entry is not None else None
            return parameter is not None and tuple(parameter.shape) == shape

        if tensor.numel():
            for entry in by_storage.get(tensor.untyped_storage().data_ptr(), ()):
                if alive_with_shape(entry):
                    return entry
        name = leaf.path[-1] if leaf.path and isinstance(leaf.path[-1], str) else None
        if name is not None:
            parts = name.split(".")
            for start in range(len(parts)):  # "encoder.0.weight", then "0.weight", "weight"
                entry = by_name.get(".".join(parts[start:]))
                if alive_with_shape(entry):
                    return entry
        return None

    def trains(self, leaf: TensorLeaf) -> Optional[bool]:
        """Whether the watched parameter ``leaf`` holds requires grad *now* (a layer
        unfrozen after :meth:`attach` trains; one frozen since does not; a buffer never
        does); ``None`` when ``leaf`` is no parameter or buffer of the watched model
        (another model of the same state, or the watched model is gone)."""
        entry = self._find(leaf)
        parameter = entry.parameter() if entry is not None else None
        return None if parameter is None else parameter.requires_grad

    def gradient_average(self, leaf: TensorLeaf) -> Optional[torch.Tensor]:
        """The gradient average of the parameter ``leaf`` holds, or ``None`` (not watched / no step yet)."""
        entry = self._find(leaf)
        if entry is None or entry.average is None:
            return None
        with self._lock:
            return entry.average.detach().clone()

    def layer_type(self, leaf: TensorLeaf) -> Optional[str]:
        """The module type of the parameter ``leaf`` holds, or ``None`` when its gradients
        are not averaged (not watched, or frozen when the model was watched)."""
        entry = self._find(leaf)
        return entry.layer_type if entry is not None and entry.hooked else None
