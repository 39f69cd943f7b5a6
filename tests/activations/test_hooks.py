import gc
import math
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import inshrinkerator as ink
from inshrinkerator.activations import ActivationCompressor, PackedActivation, sz3_available


def _weight_grads(model: nn.Module, run) -> list[torch.Tensor]:
    model.zero_grad()
    run()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("codec", ["quantizer", "sz3"])
def test_linear_weight_gradient_error_matches_the_analysis(codec: str) -> None:
    if codec == "sz3" and not sz3_available():
        pytest.skip("pysz is not installed")
    torch.manual_seed(0)
    first, second = nn.Linear(48, 256), nn.Linear(256, 32)
    model = nn.Sequential(first, nn.ReLU(), second)
    x = torch.randn(512, 48)
    grad_out = torch.randn(512, 32)
    exact = _weight_grads(model, lambda: model(x).backward(grad_out))
    relative = 0.05
    with ink.compress_activations(model, error_bound=relative, adaptive=False, codec=codec,
                                  min_bytes=0) as comp:
        lossy = _weight_grads(model, lambda: model(x).backward(grad_out))
    hidden = torch.relu(first(x)).detach()
    bound = relative * float(hidden.max() - hidden.min())
    assert comp.statistics.compressed_tensors >= 1
    # the error on the second layer's input never reaches earlier layers: dA = W^T G ignores A,
    # and the ReLU mask comes back exactly
    for a, b in zip(exact[:2], lossy[:2]):
        assert torch.equal(a, b)
    assert torch.equal(exact[3], lossy[3])  # bias gradients do not use the input either
    delta = (lossy[2] - exact[2]).double()
    nonzero = (hidden != 0).double()
    # deterministic: |dW_ck| <= eb * sum_m |G_mc| [A_mk != 0]
    worst = bound * (grad_out.double().abs().T @ nonzero)
    assert bool((delta.abs() <= worst * (1 + 1e-6) + 1e-9).all())
    # statistical: sigma = eb * ||G_c|| * sqrt((1 - s) / 3) (uniform error, exact zeros)
    if codec == "quantizer":
        zeros = 1 - float(nonzero.mean())
        row_norm = math.sqrt(float(grad_out.double().square().sum(0).mean()))
        predicted = bound * math.sqrt((1 - zeros) / 3) * row_norm
        assert float(delta.square().mean().sqrt()) == pytest.approx(predicted, rel=0.15)


@pytest.mark.skipif(not sz3_available(), reason="pysz is not installed")
def test_conv_weight_gradient_within_the_l1_bound() -> None:
    torch.manual_seed(0)
    conv = nn.Conv2d(8, 16, 3, padding=1)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.Tanh(), conv)
    x = torch.randn(32, 1, 12, 12)
    grad_out = torch.randn(32, 16, 12, 12)
    exact = _weight_grads(model, lambda: model(x).backward(grad_out))
    with ink.compress_activations(model, error_bound=0.02, adaptive=False, codec="sz3", min_bytes=0):
        lossy = _weight_grads(model, lambda: model(x).backward(grad_out))
    hidden = torch.tanh(model[0](x)).detach()
    bound = 0.02 * float(hidden.max() - hidden.min())
    delta = (lossy[2] - exact[2]).abs()
    worst = bound * grad_out.abs().sum(dim=(0, 2, 3)).view(16, 1, 1, 1)
    assert bool((delta <= worst * (1 + 1e-5)).all())
    assert float(delta.max()) > 0  # something really was compressed


def _cnn(inplace: bool) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=inplace),
        nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=inplace), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.25), nn.Linear(16 * 16, 10),
    )


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(7)  # the same dropout mask in every run
    return nn.functional.cross_entropy(model(x), y)


def _relative_errors(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[float]:
    return [float((p - q).norm() / (p.norm() + 1e-12)) for p, q in zip(a, b) if p.norm() > 1e-6]


@pytest.mark.parametrize("inplace", [False, True])
def test_cnn_gradients_stay_close_with_inplace_relu(inplace: bool) -> None:
    torch.manual_seed(0)
    model = _cnn(inplace)
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    exact = _weight_grads(model, lambda: _loss(model, x, y).backward())
    comp = ink.compress_activations(model, error_bound=0.01, min_bytes=0)
    for _ in range(2):  # the second step uses the adaptive bounds
        with comp:
            lossy = _weight_grads(model, lambda: _loss(model, x, y).backward())
    assert max(_relative_errors(exact, lossy)) < 0.25
    stats = comp.statistics
    assert stats.deduplicated > 0  # ReLU outputs saved by the ReLU and the next layer, stored once
    assert stats.by_codec.get("bitmask", 0) > 0 and stats.by_codec.get("int-delta", 0) > 0
    assert stats.ratio > 4


def test_inplace_change_after_save_cannot_reach_backward() -> None:
    a = torch.randn(128, 128, requires_grad=True)
    w = torch.randn(128, 128, requires_grad=True)
    model = nn.Identity()
    with ink.compress_activations(model, error_bound=0.001, adaptive=False, min_bytes=0):
        h = a * 2
        product = h * w  # saves h
        before = h.detach().clone()
        h.add_(100.0)  # without hooks autograd would refuse; here the packed copy predates it
        product.sum().backward()
    bound = 0.001 * float(before.max() - before.min())
    assert float((w.grad - before).abs().max()) <= bound


@pytest.mark.parametrize("reentrant", [False, True])
def test_composes_with_torch_checkpoint(reentrant: bool) -> None:
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(32, 128), nn.GELU())
    block = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128))
    tail = nn.Linear(128, 4)
    model = nn.ModuleList([head, block, tail])
    x = torch.randn(256, 32)

    def run() -> None:
        hidden = head(x)
        hidden = checkpoint(block, hidden, use_reentrant=reentrant)
        tail(torch.relu(hidden)).square().mean().backward()

    exact = _weight_grads(model, run)
    with ink.compress_activations(model, error_bound=0.005, adaptive=False, min_bytes=0) as comp:
        lossy = _weight_grads(model, run)
    assert comp.statistics.compressed_tensors > 0
    assert max(_relative_errors(exact, lossy)) < 0.1


def test_inplace_change_of_a_kept_tensor_still_raises() -> None:
    a = torch.randn(16, requires_grad=True)
    with ink.compress_activations(nn.Identity()):  # 64 B: below min_bytes, kept as it is
        h = a * 2
        product = h * h
        h.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an in-place operation"):
            product.sum().backward()


def test_unpack_twice_works() -> None:
    x = torch.randn(256, 256, requires_grad=True)
    with ink.compress_activations(nn.Identity(), error_bound=0.01, adaptive=False, min_bytes=0):
        y = torch.exp(x * 1.0)
        first = y.grad_fn._saved_result
        second = y.grad_fn._saved_result
        assert torch.equal(first, second)
        del first, second
        again = y.grad_fn._saved_result  # decoded again after the first results are gone
        y.sum().backward()
    exact = torch.exp(x.detach())
    bound = 0.01 * float(exact.max() - exact.min())
    assert float((again.detach() - exact).abs().max()) <= bound
    assert float((x.grad - exact).abs().max()) <= bound


def test_activations_are_really_released() -> None:
    refs = []

    class Remember(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = torch.tanh(x)
            refs.append(weakref.ref(out))
            return out

    model = nn.Sequential(nn.Linear(64, 512), Remember(), nn.Linear(512, 8))
    x = torch.randn(256, 64)
    with ink.compress_activations(model, min_bytes=0) as comp:
        loss = model(x).sum()
        gc.collect()
        assert refs[-1]() is None  # only the compressed copy is alive between forward and backward
        loss.backward()
    assert comp.statistics.compressed_tensors >= 1
    loss = model(x).sum()  # outside the context: autograd keeps the tensor
    assert refs[-1]() is not None


def test_parameters_small_and_input_tensors_are_kept() -> None:
    model = nn.Linear(256, 256)
    comp = ActivationCompressor(model, min_bytes=1024)
    with comp:
        def kept(tensor: torch.Tensor) -> torch.Tensor:
            packed = comp.pack(tensor)
            assert not isinstance(packed, PackedActivation)
            return comp.unpack(packed)

        assert kept(model.weight) is model.weight
        assert kept(model.weight.t()).data_ptr() == model.weight.data_ptr()
        small = torch.randn(8, requires_grad=True) * 1
        assert kept(small) is small
        data = torch.randn(64, 256)  # a batch the caller holds
        assert kept(data) is data
        leaf = torch.randn(64, 256, requires_grad=True)  # a leaf the caller holds
        assert kept(leaf) is leaf
        hidden = torch.randn(64, 256, requires_grad=True) * 1
        packed = comp.pack(hidden)
        assert isinstance(packed, PackedActivation)
        assert comp.pack(hidden) is packed  # saved twice, stored once
        hidden.mul_(2)  # a new version is new data
        assert comp.pack(hidden) is not packed


def test_adaptive_bounds_follow_the_gradients() -> None:
    torch.manual_seed(0)
    model = _cnn(False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    comp = ink.compress_activations(model, error_bound=0.01, every=2, min_bytes=0)
    seen = []
    with comp:
        for _ in range(4):
            optimizer.zero_grad()
            _loss(model, x, y).backward()
            optimizer.step()
            seen.append({slot: record.relative_bound for slot, record in comp.slots.items()})
    assert all(value == pytest.approx(0.01) for value in seen[0].values() if value)
    assert seen[1] != seen[0]  # measured on step 0, applied from step 1
    assert set(comp.bounds.layer_bounds()) >= {"0", "3", "9"}


def test_bad_use_raises() -> None:
    with pytest.raises(TypeError, match="nn.Module"):
        ink.compress_activations(lambda x: x)
    with pytest.raises(ValueError, match="unknown activation codec"):
        ink.compress_activations(nn.Linear(2, 2), codec="zip")
    comp = ink.compress_activations(nn.Linear(2, 2))
    with comp:
        with pytest.raises(RuntimeError, match="already active"):
            comp.__enter__()


def test_empty_and_subnormal_saved_tensors_are_kept_whatever_min_bytes() -> None:
    comp = ActivationCompressor(nn.Linear(1, 1), error_bound=1e-6, adaptive=False, codec="quantizer", min_bytes=0)
    leaf = torch.randn(0, 7, dtype=torch.float64, requires_grad=True)
    empty = leaf * 1
    assert comp.unpack(comp.pack(empty)).shape == (0, 7)
    tiny = (torch.randn(64).mul(1e-41)).requires_grad_(True) * 1
    assert torch.equal(comp.unpack(comp.pack(tiny)), tiny)
