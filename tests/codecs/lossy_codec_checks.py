"""Shared checks of the lossy baseline codecs: closed-loop chains, golden files, damaged streams."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from inshrinkerator.codecs import Codec, TensorSpec, dtype_from_name, get_codec
from inshrinkerator.errors import BrokenChainError, FormatError

from ..helpers import check_codec_roundtrip

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "codecs"


def encode_decode(codec: Codec, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Round trip through JSON config/params; the decoded tensor must equal the encoder's reconstruction."""
    encoded = codec.encode(tensor, reference)
    decoded = check_codec_roundtrip(codec, tensor, reference)
    assert encoded.reconstruction is not None
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    assert same_bits(decoded, encoded.reconstruction)
    return decoded


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN-safe, -0.0 distinct from 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def random_walk(steps: int, shape: tuple[int, ...] = (64, 96), seed: int = 0) -> list[torch.Tensor]:
    """Weights-like states: a start, then small updates with a steady drift (as training makes)."""
    generator = torch.Generator().manual_seed(seed)
    state = torch.randn(shape, generator=generator) * 0.05
    drift = torch.randn(shape, generator=generator) * 2e-4
    states = [state]
    for _ in range(steps):
        state = state + drift + torch.randn(shape, generator=generator) * 1e-3
        states.append(state)
    return states


def chain_errors(codec: Codec, states: list[torch.Tensor], closed_loop: bool = True) -> list[float]:
    """Max abs error of each state after coding the chain ``states[1:]`` against the previous one.

    Closed loop: against the previous *reconstruction*; open loop: against the previous true state
    (the reconstruction is then the previous reconstruction plus the decoded delta).
    """
    reconstruction = states[0]
    errors = []
    for previous, state in zip(states, states[1:]):
        if closed_loop:
            reconstruction = codec.encode(state, reconstruction).reconstruction
        else:
            step = codec.encode(state, previous).reconstruction - previous
            reconstruction = reconstruction + step
        errors.append(float((state - reconstruction).abs().max()))
    return errors


def one_step_errors(codec: Codec, states: list[torch.Tensor]) -> list[float]:
    """Max abs error of coding each state against the exact previous one (one step, no chain)."""
    return [
        float((state - codec.encode(state, previous).reconstruction).abs().max())
        for previous, state in zip(states, states[1:])
    ]


def _read_tensor(path: Path, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    data = bytearray(path.read_bytes())
    flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def golden_cases(codec_id: str) -> list[Path]:
    """The golden case folders of a codec (written by write_baseline_goldens.py)."""
    return sorted(p.parent for p in (GOLDEN / codec_id).glob("*/case.json"))


def check_golden(case: Path, encodes: bool = True, encode_ulps: int = 0) -> None:
    """Stored streams decode to the stored output bit for bit, and (``encodes``) encoding the
    stored input reproduces that output (the encoder is deterministic): bit for bit, or
    within ``encode_ulps`` units in the last place of the largest value (of the output or
    its reference), for an encoder whose
    choices come from linear-algebra routines (QR, SVD, matrix products) whose last bits
    vary with the CPU's instruction set."""
    meta = json.loads((case / "case.json").read_text())
    codec = get_codec(meta["config"])
    dtype, shape = dtype_from_name(meta["dtype"]), meta["shape"]
    streams = [(case / name).read_bytes() for name in meta["streams"]]
    reference = _read_tensor(case / "reference.bin", dtype, shape) if meta["has_reference"] else None
    # A codec that uses a context (another tensor of the file) has it stored with the case.
    context = {"context": _read_tensor(case / "context.bin", dtype, shape)} if meta.get("has_context") else {}
    expected = _read_tensor(case / "expected.bin", dtype, shape)
    decoded = codec.decode(streams, meta["params"], TensorSpec(dtype, tuple(shape)), reference, **context)
    assert same_bits(decoded, expected), f"{case.name}: decode changed"
    if not encodes:
        return
    tensor = _read_tensor(case / "input.bin", dtype, shape)
    again = codec.encode(tensor, reference, **context)
    if encode_ulps == 0:
        assert same_bits(again.reconstruction, expected), f"{case.name}: encode changed"
        return
    largest = max(float(expected.abs().max()), float(reference.abs().max()) if reference is not None else 0.0)
    ulp = max(largest, torch.finfo(expected.dtype).tiny) * torch.finfo(expected.dtype).eps
    ulps = float((again.reconstruction.double() - expected.double()).abs().max()) / ulp
    assert ulps <= encode_ulps, f"{case.name}: encode changed by {ulps:.3g} units in the last place"


def check_damaged_streams(
    codec: Codec, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None,
    mutate_params: Optional[Callable[[dict[str, Any]], None]] = None,
    context: Optional[torch.Tensor] = None,
) -> None:
    """Truncated, missing or extra streams, a non-float spec and bad params raise errors of the
    library's types (never a crash or garbage). ``context``: for a codec that uses one."""
    extra = {} if context is None else {"context": context}
    encoded = codec.encode(tensor, reference, **extra)
    spec = TensorSpec.of(tensor)
    streams = [bytes(memoryview(s).cast("B")) for s in encoded.streams]
    params = json.loads(json.dumps(encoded.params))
    with pytest.raises(FormatError):
        codec.decode(streams[:-1], params, spec, reference, **extra)
    with pytest.raises(FormatError):
        codec.decode([*streams, b"x"], params, spec, reference, **extra)
    for index, stream in enumerate(streams):
        # Cut short by a byte, a 32-bit word and half (padding streams of small tensors are empty).
        for cut in {1, 4, len(stream) // 2} if stream else ():
            if 0 < cut <= len(stream):
                with pytest.raises(FormatError):
                    codec.decode([*streams[:index], stream[:-cut], *streams[index + 1 :]], params, spec, reference, **extra)
    with pytest.raises((FormatError, BrokenChainError)):
        codec.decode(streams, params, TensorSpec(torch.int32, spec.shape), reference, **extra)
    if mutate_params is not None:
        broken = json.loads(json.dumps(params))
        mutate_params(broken)
        with pytest.raises(FormatError):
            codec.decode(streams, broken, spec, reference, **extra)
