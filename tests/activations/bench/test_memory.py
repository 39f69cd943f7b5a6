from dataclasses import dataclass

import numpy as np
import torch

from inshrinkerator.activations.bench.memory import held_bytes, rss_bytes
from inshrinkerator.activations.packed import PackedActivation
from inshrinkerator.activations.quantizer import quantize


@dataclass
class _Holder:
    payload: object


def test_distinct_buffers_are_counted_once() -> None:
    a = torch.zeros(1000)
    view = a[10:20]
    assert held_bytes([a, view, [a], {"k": a}]) == 4000  # one storage, however it is reached


def test_numpy_views_are_charged_for_their_whole_buffer() -> None:
    base = np.zeros(10_000, dtype=np.uint8)
    assert held_bytes([_Holder(base[:100])]) == 10_000  # what pysz's raw result would cost
    assert held_bytes([_Holder(base[:100].copy())]) == 100
    assert held_bytes([b"12345", bytearray(3)]) == 8


def test_excluded_storages_and_packed_handles() -> None:
    weight = torch.zeros(256, 256)
    assert held_bytes([weight.t()], excluded=[weight]) == 0
    x = torch.randn(4096)
    handle = PackedActivation(quantize(x, 0.05), x.numel() * 4)
    walked = held_bytes([handle, handle])
    # the walk finds the packed tensors the handle owns, close to the codec's own count
    assert 0 < walked <= handle.nbytes
    assert walked > handle.nbytes - 64


def test_rss_is_readable() -> None:
    assert rss_bytes() > 10 * 2**20
