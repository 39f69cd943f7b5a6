"""Random small models trained a few steps under ``compress_activations``.

Each example stacks random layers (linear, convolution, in-place ReLU, GELU, dropout,
max-pooling, batch and layer norm, residual additions, transposed views) in float32 or
float64, and runs forward and backward with and without the hooks on the same batches
and dropout draws. With a tiny fixed bound every parameter's gradient must match the
exact one (within 5 % of its norm, or 1e-4 where it cancels to round-off; models without
norm layers, whose gradients over nearly equal values move by more under any perturbation); with the adaptive defaults (re-entered every step, as in training)
nothing may raise and every gradient that is finite without the hooks stays finite.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from torch import nn

from inshrinkerator.activations import ActivationCompressor
from tests.policies.random_states import LONG, fuzz_settings

pytestmark = [pytest.mark.timeout(0)] if LONG else []

NORMS = {"layernorm", "batchnorm"}
#: Blocks with parameters (a model needs one to have gradients).
TRAINED = ("linear", "layernorm", "residual", "conv", "batchnorm")
BLOCKS = ("linear", "relu-inplace", "gelu", "dropout", "layernorm", "residual", "transpose", "conv", "pool", "batchnorm")


@dataclass(frozen=True)
class RandomModel:
    seed: int
    blocks: tuple[str, ...]
    width: int
    dtype: str
    tight: bool  # a tiny fixed bound (gradients compared) or the adaptive defaults


class Net(nn.Module):
    def __init__(self, case: RandomModel) -> None:
        super().__init__()
        w = case.width
        self.case = case
        self.layers = nn.ModuleList()
        for block in case.blocks:
            self.layers.append({
                "linear": lambda: nn.Linear(w, w),
                "relu-inplace": lambda: nn.ReLU(inplace=True),
                "gelu": lambda: nn.GELU(),
                "dropout": lambda: nn.Dropout(0.3),
                "layernorm": lambda: nn.LayerNorm(w),
                "residual": lambda: nn.Linear(w, w),
                "transpose": lambda: nn.Identity(),
                "conv": lambda: nn.Conv2d(2, 2, 3, padding=1),
                "pool": lambda: nn.MaxPool2d(2, stride=1, padding=1),
                "batchnorm": lambda: nn.BatchNorm2d(2),
            }[block]())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, layer in zip(self.case.blocks, self.layers):
            if block == "residual":
                x = x + layer(x)
            elif block == "transpose":
                x = x.t().contiguous().t() * 1.5
            elif block in ("conv", "pool", "batchnorm"):
                rows, width = x.shape
                image = x.reshape(rows, 2, width // 2, 1).expand(rows, 2, width // 2, 2)
                out = layer(image)
                x = out[..., : width // 2, :1].reshape(rows, width)
            else:
                x = layer(x)
        return x


def random_models() -> st.SearchStrategy[RandomModel]:
    return st.builds(
        RandomModel,
        seed=st.integers(0, 2**16),
        blocks=st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=7).map(tuple)
        .filter(lambda blocks: any(block in TRAINED for block in blocks)),
        width=st.sampled_from([4, 16, 64]),
        dtype=st.sampled_from(["float32", "float64"]),
        tight=st.booleans(),
    )


def gradients(model: nn.Module, x: torch.Tensor, seed: int, hooks: contextlib.AbstractContextManager) -> list[torch.Tensor]:
    model.zero_grad()
    torch.manual_seed(seed)  # the same dropout draws
    with hooks:
        out = model(x)
        (out.square().mean() + out.mean()).backward()
    return [parameter.grad.detach().clone() for parameter in model.parameters() if parameter.grad is not None]


@fuzz_settings(20)
@given(case=random_models())
def test_random_models_train_with_compressed_activations(case: RandomModel) -> None:
    dtype = {"float32": torch.float32, "float64": torch.float64}[case.dtype]
    torch.manual_seed(case.seed)
    model = Net(case).to(dtype)
    if case.tight:
        compressor = ActivationCompressor(model, error_bound=1e-6, adaptive=False, codec="quantizer", min_bytes=0)
    else:
        compressor = ActivationCompressor(model, min_bytes=0, every=2)
    generator = torch.Generator().manual_seed(case.seed)
    for step in range(3):
        x = torch.randn(12, case.width, generator=generator, dtype=dtype)
        try:
            exact = gradients(model, x, step, contextlib.nullcontext())
        except RuntimeError:  # autograd refuses the model itself (in place after in place)
            event("refused without the hooks")
            return
        lossy = gradients(model, x, step, compressor)
        assert len(exact) == len(lossy)
        event(f"tensors compressed: {compressor.statistics.compressed_tensors > 0}")
        for a, b in zip(exact, lossy):
            finite = torch.isfinite(a)
            assert torch.isfinite(b[finite]).all()
            # A norm layer over nearly equal values (4 features, or a pooled or expanded map)
            # divides by a standard deviation near its eps: its gradients move by more than
            # 5 % under any perturbation of 1e-6 of the range. Compared without norm layers.
            if case.tight and not NORMS.intersection(case.blocks):
                error = float((a[finite] - b[finite]).double().norm())
                # 5 % or 1e-4: a gradient that cancels to round-off size (a LayerNorm's output
                # squared is constant) moves by more than its own size under any perturbation
                assert error <= 0.05 * float(a[finite].double().norm()) + 1e-4, (step, error)
