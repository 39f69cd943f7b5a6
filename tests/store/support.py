"""Shared pieces of the store tests: deterministic states and a small lossy policy.

``RoundingPolicy`` is a test-only lossy policy: float32 tensors are rounded to a grid of
``scale`` (full) or stored as a rounded difference to their reference (delta). Its
reconstruction is exact and deterministic, so it exposes whether a run takes deltas
against the *reconstructed* previous step (the closed loop) or against the true one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Optional

import torch

from inshrinkerator.codecs import Codec, Encoded, RawCodec, TensorSpec, register_codec
from inshrinkerator.codecs.raw import tensor_bytes, tensor_from_bytes
from inshrinkerator.policies import Lossless, Policy
from inshrinkerator.tree import TensorLeaf


def state_for(step: int, numel: int = 4096) -> dict[str, Any]:
    """The state a run saves at ``step``: a slowly drifting model, moments, counters."""
    base = torch.Generator().manual_seed(1234)
    drift = torch.Generator().manual_seed(step)
    weight = torch.randn(numel, generator=base) * 0.05 + torch.randn(numel, generator=drift) * 1e-3
    return {
        "model": {"weight": weight, "bias": torch.full((16,), float(step)), "half": weight[:256].to(torch.bfloat16)},
        "optimizer": {"exp_avg": torch.randn(numel // 4, generator=drift) * 1e-4, "step": torch.tensor(step)},
        "step": step,
        "name": "run",
    }


def _grid(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.round(tensor / scale).to(torch.int32)


@register_codec
class RoundToGridCodec(Codec):
    """Test codec: a float32 tensor rounded to multiples of ``scale``."""

    codec_id = "test_round_to_grid"
    lossless = False

    def __init__(self, scale: float = 1e-3) -> None:
        self.scale = scale

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        codes = _grid(tensor, self.scale)
        return Encoded([tensor_bytes(codes)], {}, codes.to(torch.float32) * self.scale)

    def decode(self, streams: Sequence[Any], params: dict[str, Any], spec: TensorSpec,
               reference: Optional[torch.Tensor] = None) -> torch.Tensor:
        codes = tensor_from_bytes(streams[0], TensorSpec(torch.int32, spec.shape))
        return codes.to(torch.float32) * self.scale


@register_codec
class RoundedDeltaCodec(Codec):
    """Test codec: ``reference + round((tensor - reference) / scale) * scale``."""

    codec_id = "test_rounded_delta"
    lossless = False
    uses_reference = True

    def __init__(self, scale: float = 1e-3) -> None:
        self.scale = scale

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        assert reference is not None
        codes = _grid(tensor - reference, self.scale)
        return Encoded([tensor_bytes(codes)], {}, reference + codes.to(torch.float32) * self.scale)

    def decode(self, streams: Sequence[Any], params: dict[str, Any], spec: TensorSpec,
               reference: Optional[torch.Tensor] = None) -> torch.Tensor:
        assert reference is not None
        codes = tensor_from_bytes(streams[0], TensorSpec(torch.int32, spec.shape))
        return reference + codes.to(torch.float32) * self.scale


class RoundingPolicy(Policy):
    """Lossy for float32 tensors of 64+ elements, lossless for everything else."""

    name = "test-rounding"

    def __init__(self, scale: float = 1e-3) -> None:
        self.scale = scale
        self.watched: list[Any] = []
        self.before_save_threads: list[int] = []

    def plan(self, leaves: Sequence[TensorLeaf], references: Sequence[Optional[torch.Tensor]]) -> list[Codec]:
        fallback = Lossless().plan(leaves, references)
        codecs: list[Codec] = []
        for leaf, reference, safe in zip(leaves, references, fallback):
            tensor = leaf.tensor
            if tensor.dtype != torch.float32 or tensor.numel() < 64:
                codecs.append(safe)
            elif reference is not None and reference.shape == tensor.shape and reference.dtype == tensor.dtype:
                codecs.append(RoundedDeltaCodec(self.scale))
            else:
                codecs.append(RoundToGridCodec(self.scale))
        return codecs

    def watch(self, model: Any) -> None:
        self.watched.append(model)

    def before_save(self) -> None:
        self.before_save_threads.append(threading.get_ident())


__all__ = ["state_for", "RoundingPolicy", "RoundToGridCodec", "RoundedDeltaCodec", "RawCodec"]
