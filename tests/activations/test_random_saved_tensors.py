"""Random tensors through the saved-tensor hooks: every dtype, layout and value the
autograd graph may hand them, packed and unpacked by an ``ActivationCompressor``.

Each example makes a tensor with autograd history (so the hook may compress it) or
without (an input, an integer or bool tensor): float64 / float32 / bfloat16 / float16,
int64 / int32 / uint8 / bool; contiguous, transposed, strided, expanded (stride 0),
channels-last, empty or 0-dim; values normal at any scale, ReLU'd, constant, two-valued
(a mask), subnormal, huge, with NaN and ±inf sprinkled in. What comes back must have the
tensor's dtype and shape, its non-finite values in place, zeros exact, masks (two-valued
tensors without history) and integers exact, and every other value within the bound
(relative to the tensor's value range) of the original, the same on a second unpack.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from inshrinkerator.activations import ActivationCompressor, PackedActivation, sz3_available
from tests.policies.random_states import LONG, fuzz_settings

pytestmark = [pytest.mark.timeout(0)] if LONG else []

FLOATS = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INTEGERS = {"int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool}
LAYOUTS = ("contiguous", "transposed", "strided", "expanded", "channels-last", "empty", "scalar")
VALUES = ("normal", "relu", "constant", "two-valued", "subnormal", "huge", "tiny-range")


@dataclass(frozen=True)
class SavedTensor:
    seed: int
    dtype: str
    layout: str
    values: str
    scale: float
    non_finite: tuple[str, ...]  # "nan", "inf", "-inf" sprinkled in
    history: bool  # made by an op on a tensor that requires grad
    codec: str
    error_bound: float


def saved_tensors() -> st.SearchStrategy[SavedTensor]:
    return st.builds(
        SavedTensor,
        seed=st.integers(0, 2**16),
        dtype=st.sampled_from([*FLOATS, *FLOATS, *INTEGERS]),
        layout=st.sampled_from(LAYOUTS),
        values=st.sampled_from(VALUES),
        scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e3, 1e30]),
        non_finite=st.lists(st.sampled_from(["nan", "inf", "-inf"]), max_size=2, unique=True).map(tuple),
        history=st.booleans(),
        codec=st.sampled_from(["auto", "quantizer", "sz3"] if sz3_available() else ["quantizer"]),
        error_bound=st.sampled_from([1e-6, 1e-3, 0.02, 0.1]),
    )


def make(case: SavedTensor) -> torch.Tensor:
    generator = torch.Generator().manual_seed(case.seed)
    shape = {"empty": (0, 7), "scalar": ()}.get(case.layout, (2, 6, 5, 4))
    if case.dtype in INTEGERS:
        dtype = INTEGERS[case.dtype]
        high = 2 if dtype == torch.bool else 200
        return torch.randint(0, high, shape, generator=generator).to(dtype)
    values = torch.randn(shape, generator=generator, dtype=torch.float64)
    if case.values == "relu":
        values = values.clamp_min(0)
    elif case.values == "constant":
        values = torch.full(shape, 0.75, dtype=torch.float64)
    elif case.values == "two-valued":
        values = (values > 0).double() * 1.25
    elif case.values == "subnormal":
        values = values * 1e-41
    elif case.values == "huge":
        values = values * 1e38
    elif case.values == "tiny-range":
        values = 1.0 + values * 1e-7
    if case.values not in ("subnormal", "huge"):
        values = values * case.scale
    flat = values.view(-1)
    for at, kind in enumerate(case.non_finite):
        if flat.numel() > at:
            flat[(at * 7919) % flat.numel()] = float(kind)
    tensor = values.to(FLOATS[case.dtype])
    if not case.history:
        return layout(tensor, case.layout)
    leaf = tensor.detach().requires_grad_(True)
    return layout(leaf * 1, case.layout)  # autograd history


def layout(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "transposed":
        return tensor.transpose(0, 3)
    if kind == "strided":
        return tensor[:, ::2, 1:, ::3]
    if kind == "expanded":
        return tensor[:, :1].expand(2, 6, 5, 4)
    if kind == "channels-last":
        return tensor.contiguous(memory_format=torch.channels_last)
    return tensor


def problems(original: torch.Tensor, back: torch.Tensor, bound: float) -> list[str]:
    """What breaks the hooks' promises (``bound``: the absolute bound the tensor was given;
    a tensor without autograd history that holds two values is a mask, to come back exact)."""
    if (back.dtype, back.shape) != (original.dtype, original.shape):
        return [f"{back.dtype}{list(back.shape)} for {original.dtype}{list(original.shape)}"]
    a, b = original.detach(), back.detach()
    if not a.is_floating_point():
        return [] if torch.equal(a, b) else ["an integer or bool tensor changed"]
    a, b = a.double(), b.double()
    finite = torch.isfinite(a)
    if not torch.equal(finite, torch.isfinite(b)) or not torch.equal(a[~finite].nan_to_num(7.0), b[~finite].nan_to_num(7.0)):
        return ["a non-finite value moved or changed"]
    if not torch.equal(b[a == 0], a[a == 0]):
        return ["a zero came back non-zero"]
    if original.grad_fn is None and a[finite].unique().numel() <= 2 and not torch.equal(a[finite], b[finite]):
        return ["a two-valued tensor changed"]
    error = float((a[finite] - b[finite]).abs().max()) if finite.any() else 0.0
    return [] if error <= bound else [f"error {error:.3g} above the bound {bound:.3g}"]


@fuzz_settings(60, share=1)
@given(case=saved_tensors())
def test_random_saved_tensors_come_back_within_their_bound(case: SavedTensor) -> None:
    tensor = make(case)
    compressor = ActivationCompressor(nn.Linear(1, 1), error_bound=case.error_bound, adaptive=False,
                                      codec=case.codec, min_bytes=0)
    packed = compressor.pack(tensor)
    back = compressor.unpack(packed)
    record = next(iter(compressor.slots.values()), None) if isinstance(packed, PackedActivation) else None
    bound = record.error_bound * (1 + 1e-6) if record is not None else 0.0
    if record is not None and tensor.is_floating_point():
        values = tensor.detach().double()  # finite: a tensor holding NaN or inf is kept
        value_range = float(values.max() - values.min())
        assert record.error_bound <= case.error_bound * value_range * (1 + 1e-6)
    found = problems(tensor, back, bound)
    assert found == [], f"{found} ({record.codec if record else 'kept'})"
    again = compressor.unpack(packed)
    assert torch.equal(torch.nan_to_num(again.double(), 7.0), torch.nan_to_num(back.double(), 7.0))


def test_the_checks_catch_what_they_guard() -> None:
    original = torch.tensor([0.0, 1.0, 2.0, float("nan"), float("inf")])
    assert problems(original, original.clone(), 0.0) == []
    assert problems(original, torch.tensor([0.0, 1.05, 2.0, float("nan"), float("inf")]), 0.1) == []
    assert problems(original, torch.tensor([0.0, 1.5, 2.0, float("nan"), float("inf")]), 0.1)
    assert problems(original, torch.tensor([0.01, 1.0, 2.0, float("nan"), float("inf")]), 0.1)
    assert problems(original, torch.tensor([0.0, 1.0, 2.0, 0.0, float("inf")]), 0.1)
    assert problems(original, torch.tensor([0.0, 1.0, 2.0, float("nan"), -float("inf")]), 0.1)
    assert problems(torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0.0, 1.0, 0.99]), 0.1)  # a mask
    assert problems(original, original.double(), 0.0)
