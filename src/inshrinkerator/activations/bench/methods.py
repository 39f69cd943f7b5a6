"""The contenders: no compression, torch.utils.checkpoint, save_on_cpu and compress_activations.

A :class:`MethodRun` is one method applied to one model: a context entered around each
training step's forward and backward, and the (pack, unpack) pair the method's saved-tensor
hooks use, so the memory probe can see what each method really keeps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import torch

from ..hooks import ActivationCompressor, compress_activations
from .workloads import Segmented

__all__ = ["Method", "MethodRun", "METHODS", "method_names"]


def _identity(value: Any) -> Any:
    return value


@dataclass
class MethodRun:
    """A method bound to one model."""

    context: Callable[[], ContextManager[Any]]
    pack: Callable[[torch.Tensor], Any] = _identity
    unpack: Callable[[Any], torch.Tensor] = _identity
    compressor: Optional[ActivationCompressor] = None


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    bind: Callable[[Segmented], MethodRun]
    default: bool = True  # compared unless methods are named explicitly


def _none(model: Segmented) -> MethodRun:
    model.checkpointed = False
    return MethodRun(contextlib.nullcontext)


def _checkpoint(model: Segmented) -> MethodRun:
    model.checkpointed = True
    return MethodRun(contextlib.nullcontext)


def _save_on_cpu(model: Segmented) -> MethodRun:
    model.checkpointed = False
    # pinned memory needs a GPU build; on a CPU-only machine the copy stays in ordinary memory
    hooks = torch.autograd.graph.save_on_cpu(pin_memory=False)
    return MethodRun(lambda: hooks, hooks.pack_hook, hooks.unpack_hook)


def _ink(**options: Any) -> Callable[[Segmented], MethodRun]:
    def bind(model: Segmented) -> MethodRun:
        model.checkpointed = False
        compressor = compress_activations(model, **options)
        return MethodRun(lambda: compressor, compressor.pack, compressor.unpack, compressor)
    return bind


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("none", "no compression (baseline)", _none),
    Method("checkpoint", "torch.utils.checkpoint per segment (non-reentrant)", _checkpoint),
    Method("save_on_cpu", "torch.autograd.graph.save_on_cpu (no pinning)", _save_on_cpu),
    Method("ink-quantizer", "compress_activations, quantizer codec (torch ops), adaptive bound",
           _ink(error_bound=0.02, adaptive=True, codec="quantizer")),
    Method("ink-auto", "compress_activations, SZ3 or quantizer per tensor, adaptive bound",
           _ink(error_bound=0.02, adaptive=True, codec="auto")),
    Method("ink-fixed", "compress_activations, SZ3 or quantizer per tensor, fixed bound 2% of range",
           _ink(error_bound=0.02, adaptive=False, codec="auto"), default=False),
)}


def method_names() -> list[str]:
    """The methods a run compares by default, in report order."""
    return [name for name, method in METHODS.items() if method.default]
