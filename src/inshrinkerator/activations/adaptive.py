"""Per-layer error bounds from gradient statistics (COMET's adaptive scheme, made explicit).

For a layer whose weight gradient is ``dW = G A^T`` (linear, convolution), an error ``E`` on
the saved input ``A`` with i.i.d. entries uniform on ``[-eb, eb]`` (what the quantizer
produces) changes the gradient by ``G E^T``: mean zero, and per weight row ``c`` a standard
deviation ``sigma_c = eb * ||G_c|| * sqrt((1 - s) / 3)``, where ``s`` is the fraction of
exact zeros in ``A`` (they carry no error). Asking that this noise stays a fraction ``rho``
(``noise``) of the gradient's own RMS ``r`` gives

    eb = sqrt(3) * rho * r / (g * sqrt(1 - s)),   g = RMS over rows c of ||G_c||.

Normalization layers (BatchNorm, LayerNorm) use the normalized input ``x_hat = (x - mu)/sigma``
in their weight gradient, so the same rule holds with ``||G_c||^2`` replaced by
``sum_m G_cm^2 / sigma_m^2`` and yields a bound on ``x`` directly.

The error on a linear/conv input does not reach earlier layers (``dA = W^T G`` does not use
``A``). Layers whose backward only needs a mask or indices (ReLU, max-pool, dropout) put no
constraint on the bound, since the codecs keep zeros and signs. Any other consumer (GELU,
softmax, attention, custom code) gets the fixed bound ``error_bound * range``.

A tensor saved by several layers takes the smallest of their bounds. Statistics are taken
on one step in ``every`` and smoothed; between measurements the bounds stay fixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

__all__ = ["AdaptiveErrorBound", "consumer_kind"]

_MASK_ONLY = (
    nn.ReLU, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d, nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Flatten,
    nn.Unflatten, nn.Identity,
)
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_BATCHNORM = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def consumer_kind(module: nn.Module) -> str:
    """How a module's backward uses what it saved: linear, conv, batchnorm, layernorm, mask or other."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, _CONVOLUTIONS):
        return "conv"
    if isinstance(module, _BATCHNORM) and module.affine:
        return "batchnorm"
    if isinstance(module, nn.LayerNorm) and module.elementwise_affine:
        return "layernorm"
    if isinstance(module, _MASK_ONLY):
        return "mask"
    return "other"


@dataclass
class _LayerStatistics:
    """Smoothed statistics of one layer: weight-gradient mean square, output-gradient norms, zeros."""

    grad_square: float = math.nan  # mean of dW^2
    row_norm_square: float = math.nan  # mean over rows of sum_m G_cm^2 (/ sigma_m^2 for norms)
    zero_fraction: float = math.nan

    def bound(self, noise: float) -> float:
        if not (self.grad_square > 0 and self.row_norm_square > 0):
            return math.nan
        zeros = 0.0 if math.isnan(self.zero_fraction) else self.zero_fraction
        density = max(1.0 - zeros, 1e-3)
        return math.sqrt(3.0) * noise * math.sqrt(self.grad_square / self.row_norm_square / density)


def _smooth(old: float, new: float, weight: float) -> float:
    return new if math.isnan(old) else (1.0 - weight) * old + weight * new


class AdaptiveErrorBound:
    """Chooses the absolute error bound of each saved tensor from its consumers' gradient statistics.

    ``error_bound``: the bound relative to each tensor's value range (max - min) used before
    statistics exist, for consumers without a rule, and for everything when ``adaptive`` is
    False. ``noise``: the tolerated gradient noise relative to the gradient RMS (rho).
    ``every``: measure on one forward/backward in ``every``. Bounds are clamped to
    ``[min_relative, max_relative] * range``.
    """

    def __init__(self, error_bound: float = 0.02, adaptive: bool = True, *, noise: float = 0.1,
                 every: int = 50, min_relative: float = 1e-4, max_relative: float = 0.1,
                 smoothing: float = 0.5) -> None:
        if not 0 < error_bound < 1:
            raise ValueError(f"error_bound is relative to each tensor's value range and must lie in (0, 1), "
                             f"got {error_bound}")
        if not noise > 0 or every < 1 or not 0 < min_relative <= max_relative < 1:
            raise ValueError("noise must be > 0, every >= 1 and 0 < min_relative <= max_relative < 1")
        self.error_bound = error_bound
        self.adaptive = adaptive
        self.noise = noise
        self.every = every
        self.min_relative = min_relative
        self.max_relative = max_relative
        self.smoothing = smoothing
        self.measuring = False
        self.steps = 0
        self._layers: dict[str, _LayerStatistics] = {}
        self._kinds: dict[str, str] = {}
        self._handles: list[Any] = []

    # -- which steps measure -------------------------------------------------------------
    def begin_step(self) -> None:
        """Called at the start of every training forward pass of the model."""
        self.measuring = self.adaptive and self.steps % self.every == 0
        self.steps += 1

    # -- the bound -----------------------------------------------------------------------
    def layer_bound(self, name: str) -> Optional[float]:
        """The absolute bound one layer asks for: a number, inf (no constraint) or None (no rule)."""
        kind = self._kinds.get(name, "other")
        if kind == "mask":
            return math.inf
        stats = self._layers.get(name)
        if not self.adaptive or stats is None:
            return None
        value = stats.bound(self.noise)
        return None if math.isnan(value) else value

    def bound(self, consumers: Optional[list[str]], value_range: float) -> float:
        """The absolute error bound for a tensor of ``value_range`` saved by ``consumers``.

        ``consumers=None`` (not known yet) gives the fixed bound ``error_bound * value_range``.
        """
        fixed = self.error_bound * value_range
        if not self.adaptive or not consumers:
            return fixed
        bounds = [self.layer_bound(name) for name in consumers]
        values = [fixed if b is None else b for b in bounds]
        chosen = min(values)
        low, high = self.min_relative * value_range, self.max_relative * value_range
        return min(max(chosen, low), high)

    def layer_bounds(self) -> dict[str, float]:
        """Current absolute bound of every layer that has statistics (for reports)."""
        out = {}
        for name in self._layers:
            value = self.layer_bound(name)
            if value is not None:
                out[name] = value
        return out

    # -- statistics collection -----------------------------------------------------------
    def attach(self, model: nn.Module) -> None:
        """Register the hooks that measure gradients of the layers that have a rule."""
        for name, module in model.named_modules():
            kind = consumer_kind(module)
            self._kinds[name] = kind
            if self.adaptive and kind in ("linear", "conv", "batchnorm", "layernorm"):
                self._handles.append(module.register_forward_hook(self._forward_hook(name, kind)))
                self._handles.append(module.weight.register_hook(self._weight_hook(name)))

    def detach(self) -> None:
        """Remove every hook :meth:`attach` registered."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _stats(self, name: str) -> _LayerStatistics:
        return self._layers.setdefault(name, _LayerStatistics())

    def _weight_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.measuring:
                stats = self._stats(name)
                value = float(torch.linalg.vector_norm(grad.detach().float()) ** 2) / max(1, grad.numel())
                stats.grad_square = _smooth(stats.grad_square, value, self.smoothing)
        return hook

    def _forward_hook(self, name: str, kind: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            # skip recomputation inside backward (torch.utils.checkpoint) and eval passes
            if (not self.measuring or not args or not isinstance(args[0], torch.Tensor)
                    or not isinstance(output, torch.Tensor) or not output.requires_grad
                    or torch._C._current_graph_task_id() != -1):
                return
            saved = args[0].detach()
            stats = self._stats(name)
            # counts and float32 reductions only: float64 copies of a large activation would
            # cost more memory than the compression saves
            zeros = 1.0 - int(torch.count_nonzero(saved)) / max(1, saved.numel())
            stats.zero_fraction = _smooth(stats.zero_fraction, zeros, self.smoothing)
            weights = _inverse_variance(module, kind, saved)
            rows = module.weight.shape[0] if kind in ("linear", "conv") else module.weight.numel()
            output.register_hook(self._output_grad_hook(name, weights, rows))
        return hook

    def _output_grad_hook(self, name: str, weights: Optional[torch.Tensor],
                          rows: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            value = _row_norm_square(grad.detach(), weights, rows)
            stats = self._stats(name)
            stats.row_norm_square = _smooth(stats.row_norm_square, value, self.smoothing)
        return hook


def _inverse_variance(module: nn.Module, kind: str, saved: torch.Tensor) -> Optional[torch.Tensor]:
    """1 / sigma^2 of the normalization each element of a norm layer's input went through."""
    if kind == "batchnorm":
        dims = [d for d in range(saved.dim()) if d != 1]
    elif kind == "layernorm":
        dims = list(range(saved.dim() - len(module.normalized_shape), saved.dim()))
    else:
        return None
    variance = saved.float().var(dim=dims, unbiased=False, keepdim=True)
    return 1.0 / (variance + module.eps)


def _row_norm_square(grad: torch.Tensor, weights: Optional[torch.Tensor], rows: int) -> float:
    """Mean over weight rows c of sum_m G_cm^2 (weighted by 1/sigma_m^2 for norm layers).

    A linear layer has a row per output feature, a convolution one per output channel, a
    norm layer one per affine element; every element of G belongs to exactly one row.
    """
    squares = grad.float().square()
    if weights is not None:
        squares.mul_(weights)
    return float(squares.sum(dtype=torch.float64)) / rows
