"""``compress_activations``: keep only compressed copies of the tensors saved for backward.

Built on :func:`torch.autograd.graph.saved_tensors_hooks`. The pack hook decides per saved
tensor:

- parameters and buffers of the model (matched by storage), tensors below ``min_bytes``,
  integer tensors (max-pool indices) and non-floating dtypes: kept as they are;
- a tensor whose values are only 0 and one constant (a dropout mask, a bool mask):
  one bit per value;
- model inputs and other leaves (no autograd history): kept, since the caller holds them
  anyway and a compressed copy would only add memory;
- any other floating tensor: compressed within an absolute error bound chosen by
  :class:`~.adaptive.AdaptiveErrorBound`, with the codec chosen by :class:`~.codec_choice.CodecChooser`.

A tensor saved by several ops (a ReLU output saved by the ReLU and by the next conv) is
compressed once: the second save gets the same handle. Unpack never frees anything; the
compressed bytes go when autograd drops the handle. Packing copies the data, so a later
in-place change of the original cannot reach backward. Ops inside
``torch.utils.checkpoint`` regions are handled by the checkpoint's own (inner) hooks.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn

from .adaptive import AdaptiveErrorBound
from .codec_choice import CodecChooser
from .packed import PackedActivation, integer_deltas, two_valued_mask

__all__ = ["ActivationCompressor", "compress_activations", "ActivationStatistics", "SlotRecord"]


@dataclass
class SlotRecord:
    """What happened to one saved tensor position of the forward pass on its latest step."""

    consumers: list[str]
    error_bound: float = 0.0
    relative_bound: float = 0.0
    codec: str = ""
    original_bytes: int = 0
    stored_bytes: int = 0


@dataclass
class ActivationStatistics:
    """Running totals of the pack hook, by the codecs' own accounting."""

    saved_tensors: int = 0
    compressed_tensors: int = 0
    deduplicated: int = 0
    kept_bytes: int = 0  # tensors left as they are (parameters, small, inputs, ints)
    compressed_input_bytes: int = 0
    compressed_stored_bytes: int = 0
    by_codec: dict[str, int] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Original / stored bytes of the tensors that were compressed."""
        return self.compressed_input_bytes / max(1, self.compressed_stored_bytes)


class _KeptTensor:
    """A saved tensor kept as it is, with its version counter at save time.

    With saved-tensor hooks autograd no longer checks whether a saved tensor was modified in
    place before backward; this restores that check for the tensors not compressed.
    """

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.version = tensor._version

    def unpack(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(
                f"a tensor saved for backward (shape {list(self.tensor.shape)}, {self.tensor.dtype}) was "
                f"modified by an in-place operation after it was saved (version {self.version} -> "
                f"{self.tensor._version}); compress_activations kept it uncompressed, so backward would "
                "see the changed values. Clone it before modifying it, or modify a copy")
        return self.tensor


class ActivationCompressor:
    """A reusable context manager that compresses the activations ``model`` saves for backward.

    Enter it around forward and backward (or around a whole training loop). State (error
    bounds, codec choices, statistics) persists across entries, so one object can be
    entered every step. See :func:`compress_activations` for the arguments.
    """

    def __init__(self, model: nn.Module, error_bound: float = 0.02, adaptive: bool = True, *,
                 codec: str = "auto", noise: float = 0.1, every: int = 50,
                 min_bytes: int = 64 * 1024, max_relative: float = 0.1) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError("compress_activations needs the nn.Module being trained, "
                            f"got {type(model).__name__}")
        self.model = model
        self.bounds = AdaptiveErrorBound(error_bound, adaptive, noise=noise, every=every,
                                         max_relative=max_relative)
        self.chooser = CodecChooser(codec)
        self.min_bytes = int(min_bytes)
        self.statistics = ActivationStatistics()
        self.slots: dict[str, SlotRecord] = {}
        self._hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = None
        self._handles: list[Any] = []
        self._active: list[str] = []
        self._names: dict[int, str] = {}
        self._kept_storages: set[int] = set()
        self._dedup: dict[tuple, tuple[weakref.ref, weakref.ref, str]] = {}
        self._ordinals: dict[str, int] = {}
        self._step_consumers: dict[str, list[str]] = {}

    # -- context manager -----------------------------------------------------------------
    def __enter__(self) -> "ActivationCompressor":
        if self._hooks is not None:
            raise RuntimeError("this ActivationCompressor is already active; enter it once at a time")
        for name, module in self.model.named_modules():
            self._names[id(module)] = name
            self._handles.append(module.register_forward_pre_hook(self._enter_module))
            self._handles.append(module.register_forward_hook(self._leave_module, always_call=True))
        self._handles.append(self.model.register_forward_pre_hook(self._begin_forward, prepend=True))
        self.bounds.attach(self.model)
        self._refresh_kept_storages()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(*exc_info)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.bounds.detach()
        self._active.clear()

    # -- module tracking: which layer saves what -----------------------------------------
    def _begin_forward(self, module: nn.Module, args: Any) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation inside backward, not a new step
        self._active.clear()
        self._dedup.clear()
        self._ordinals.clear()
        self._step_consumers = {}
        self._refresh_kept_storages()
        if module.training and torch.is_grad_enabled():
            self.bounds.begin_step()

    def _enter_module(self, module: nn.Module, args: Any) -> None:
        self._active.append(self._names.get(id(module), type(module).__name__))

    def _leave_module(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._active:
            self._active.pop()

    def _refresh_kept_storages(self) -> None:
        tensors = list(self.model.parameters()) + list(self.model.buffers())
        self._kept_storages = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}

    # -- the hooks -----------------------------------------------------------------------
    def pack(self, tensor: torch.Tensor) -> Any:
        """The pack hook: a :class:`PackedActivation` handle, or a wrapper of ``tensor`` if kept."""
        stats = self.statistics
        stats.saved_tensors += 1
        nbytes = tensor.numel() * tensor.element_size()
        if (nbytes < self.min_bytes or tensor.is_complex() or tensor.is_sparse
                or tensor.untyped_storage().data_ptr() in self._kept_storages):
            return self._keep(tensor, nbytes)
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype, tensor.device, tensor._version)
        consumer = self._active[-1] if self._active else ""
        entry = self._dedup.get(key)
        if entry is not None:
            source, handle_ref, slot = entry
            handle = handle_ref()
            if handle is not None and source() is not None:
                stats.deduplicated += 1
                self._step_consumers.setdefault(slot, []).append(consumer)
                return handle
        handle, slot = self._compress(tensor, nbytes, consumer)
        if handle is None:
            return self._keep(tensor, nbytes)
        self._dedup[key] = (weakref.ref(tensor), weakref.ref(handle), slot)
        return handle

    def unpack(self, packed: Any) -> torch.Tensor:
        """The unpack hook: decodes a handle (again, if asked twice); kept tensors pass through.

        Raises ``RuntimeError`` if a kept tensor was modified in place after it was saved
        (what autograd itself raises without hooks).
        """
        if isinstance(packed, (PackedActivation, _KeptTensor)):
            return packed.unpack()
        return packed

    def _keep(self, tensor: torch.Tensor, nbytes: int) -> _KeptTensor:
        self.statistics.kept_bytes += nbytes
        return _KeptTensor(tensor)

    def _compress(self, tensor: torch.Tensor, nbytes: int,
                  consumer: str) -> tuple[Optional[PackedActivation], str]:
        ordinal = self._ordinals.get(consumer, 0)
        self._ordinals[consumer] = ordinal + 1
        slot = f"{consumer}#{ordinal}"
        self._step_consumers[slot] = [consumer]
        is_float = tensor.is_floating_point()
        if tensor.dtype == torch.bool or tensor.dtype == torch.uint8 or (is_float and tensor.grad_fn is None):
            mask = two_valued_mask(tensor)
            if mask is not None:
                return self._record(slot, PackedActivation(mask, nbytes), "bitmask", 0.0, 0.0), slot
        if not is_float:
            packed = integer_deltas(tensor)  # lossless; max-pool indices shrink 5-10x
            if packed is None:
                return None, slot
            return self._record(slot, PackedActivation(packed, nbytes), "int-delta", 0.0, 0.0), slot
        if tensor.grad_fn is None:
            return None, slot  # an input (or leaf) the caller still holds: a copy would add memory
        if tensor.numel() == 0:
            return None, slot  # nothing to store (min_bytes=0 lets empty tensors this far)
        low, high = torch.aminmax(tensor.detach().reshape(-1))
        value_range = float(high) - float(low)
        if not value_range > 0:
            return None, slot  # constant or non-finite: nothing to gain or nothing safe
        previous = self.slots.get(slot)
        # the first time a slot is seen its other consumers are unknown: use the fixed bound
        consumers = previous.consumers if previous is not None else None
        bound = self.bounds.bound(consumers, value_range)
        probe = self.bounds.measuring or slot not in self.chooser.chosen
        payload, codec = self.chooser.encode(tensor.detach(), bound, slot, probe)
        if payload is None:
            return None, slot
        return self._record(slot, PackedActivation(payload, nbytes), codec, bound, bound / value_range), slot

    def _record(self, slot: str, handle: PackedActivation, codec: str, bound: float,
                relative: float) -> PackedActivation:
        stats = self.statistics
        stats.compressed_tensors += 1
        stats.compressed_input_bytes += handle.original_bytes
        stats.compressed_stored_bytes += handle.nbytes
        stats.by_codec[codec] = stats.by_codec.get(codec, 0) + 1
        # the consumers list is shared with _step_consumers, so later saves of the same
        # tensor in this step extend it and the next step's bound sees all of them
        self.slots[slot] = SlotRecord(self._step_consumers[slot], bound, relative, codec,
                                      handle.original_bytes, handle.nbytes)
        return handle


def compress_activations(model: nn.Module, error_bound: float = 0.02, adaptive: bool = True, *,
                         codec: str = "auto", noise: float = 0.1, every: int = 50,
                         min_bytes: int = 64 * 1024, max_relative: float = 0.1) -> ActivationCompressor:
    """Compress the activations ``model`` saves for backward, within an error bound.

    Use as ``with ink.compress_activations(model):`` around forward and backward. The
    returned :class:`ActivationCompressor` can be kept and re-entered every step (its
    adaptive state persists); ``.statistics`` and ``.slots`` report what was stored.

    - ``error_bound``: bound relative to each tensor's value range (max - min); with
      ``adaptive=False`` it applies to every tensor, with ``adaptive=True`` it is the start
      value and the bound for layers without a gradient rule.
    - ``adaptive``: per-layer bounds from gradient statistics (``adaptive.py``), re-estimated
      on one step in ``every``, keeping the added weight-gradient noise near ``noise`` times
      the gradient RMS, never above ``max_relative`` of a tensor's range.
    - ``codec``: ``"auto"`` (smallest of the quantizer and SZ3 per tensor), ``"quantizer"``
      (torch ops, any device) or ``"sz3"`` (pysz, CPU float32/float64; other tensors use
      the quantizer).
    - ``min_bytes``: smaller saved tensors are kept as they are.

    Every compressed element is within its bound of the original; zeros and dropout/ReLU
    masks come back exactly. Raises ``ValueError`` for an out-of-range argument.
    """
    return ActivationCompressor(model, error_bound, adaptive, codec=codec, noise=noise, every=every,
                                min_bytes=min_bytes, max_relative=max_relative)
