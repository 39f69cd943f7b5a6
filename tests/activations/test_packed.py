import torch

from inshrinkerator.activations.packed import PackedActivation, integer_deltas, two_valued_mask
from inshrinkerator.activations.quantizer import quantize


def test_dropout_style_masks_are_bits() -> None:
    noise = (torch.rand(1000) > 0.3).float() / 0.7  # what CPU dropout saves
    packed = two_valued_mask(noise)
    assert packed is not None and packed.nbytes < noise.numel() // 8 + 64
    assert torch.equal(packed.decode(), noise)
    flags = torch.rand(50, 7) > 0.5
    assert torch.equal(two_valued_mask(flags).decode(), flags)


def test_tensors_with_more_values_are_not_masks() -> None:
    assert two_valued_mask(torch.tensor([0.0, 1.0, 2.0])) is None
    assert two_valued_mask(torch.tensor([-1.0, 0.0, -1.0])) is None
    assert two_valued_mask(torch.zeros(5)) is None


def test_max_pool_indices_round_trip_losslessly() -> None:
    _, indices = torch.nn.functional.max_pool2d(torch.randn(8, 16, 32, 32), 2, return_indices=True)
    packed = integer_deltas(indices)
    assert packed is not None and packed.nbytes * 4 < indices.numel() * 8
    decoded = packed.decode()
    assert decoded.dtype == indices.dtype and torch.equal(decoded, indices)


def test_random_integers_are_declined() -> None:
    assert integer_deltas(torch.randint(-2**40, 2**40, (1000,))) is None
    assert integer_deltas(torch.tensor([3])) is None


def test_unpack_twice_gives_the_same_values_and_frees_nothing() -> None:
    x = torch.randn(4096)
    handle = PackedActivation(quantize(x, 0.01), x.numel() * 4)
    first = handle.unpack()
    again = handle.unpack()
    assert again is first  # served from the weak cache while the first result lives
    del first, again
    third = handle.unpack()  # decoded afresh: the payload was not freed
    assert float((third - x).abs().max()) <= 0.01
    assert handle.nbytes == handle.payload.nbytes


def test_zero_and_inf_is_not_a_mask() -> None:
    # mask * inf would bring the zeros back as NaN
    assert two_valued_mask(torch.tensor([0.0, float("inf"), 0.0])) is None
