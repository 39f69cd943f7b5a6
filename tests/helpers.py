"""Shared test helpers: realistic states, exact comparisons, codec checks."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Optional

import torch

from inshrinkerator.codecs import Codec, Encoded, TensorSpec, get_codec
from inshrinkerator.tree import TensorLeaf, format_key_path

ALL_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor with realistic contents for ``dtype`` (weights-like floats, small ints)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator, dtype=torch.float64) * 0.05).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    info = torch.iinfo(dtype)
    low, high = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(low, high + 1, shape, generator=generator, dtype=torch.int64).to(dtype)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Exact equality of nested states: container types, key order, tensor bits, dtype, shape."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}"
        if a.numel():
            a_bits = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            b_bits = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            assert torch.equal(a_bits, b_bits), f"{path}: tensor bits differ"
    elif isinstance(a, dict):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and a != a:
        assert b != b, f"{path}: NaN != {b}"
    elif isinstance(a, float):
        assert a == b and str(a) == str(b), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def training_state(steps: int = 3, seed: int = 0) -> dict[str, Any]:
    """A realistic resumable state: a small CNN + Adam + scheduler + step + RNG, after real steps."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(steps):
        x = torch.randn(16, 1, 8, 8)
        y = torch.randint(0, 10, (16,))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "step": steps,
        "rng": torch.get_rng_state(),
        "config": OrderedDict(lr=1e-3, name="cnn", layers=[8, 10], dropout=None),
    }


def encode_planned(
    leaves: Sequence[TensorLeaf], codecs: Sequence[Codec], references: Optional[Sequence[Optional[torch.Tensor]]] = None
) -> list[Encoded]:
    """Every leaf encoded with its planned codec, as the writer does: a codec that uses a
    context gets its context tensor's reconstruction (encoded first)."""
    keys = [format_key_path(leaf.path) for leaf in leaves]
    references = references if references is not None else [None] * len(leaves)
    encoded: dict[int, Encoded] = {}

    def encode(index: int) -> Encoded:
        if index not in encoded:
            codec, tensor = codecs[index], leaves[index].tensor
            reference = references[index] if codec.uses_reference else None
            if codec.uses_context:
                context = encode(keys.index(codec.context_key))  # type: ignore[attr-defined]
                rebuilt = context.reconstruction if context.reconstruction is not None else leaves[keys.index(codec.context_key)].tensor  # type: ignore[attr-defined]
                encoded[index] = codec.encode(tensor, reference, context=rebuilt)  # type: ignore[call-arg]
            else:
                encoded[index] = codec.encode(tensor, reference)
        return encoded[index]

    return [encode(index) for index in range(len(leaves))]


def check_codec_roundtrip(codec: Codec, tensor: torch.Tensor, reference: torch.Tensor | None = None) -> torch.Tensor:
    """Encode and decode through a JSON round trip of config and params; return the decoded tensor."""
    encoded = codec.encode(tensor, reference)
    config = json.loads(json.dumps(codec.get_config()))
    params = json.loads(json.dumps(encoded.params))
    rebuilt = get_codec(config)
    assert rebuilt == codec
    decoded = rebuilt.decode([bytes(memoryview(s).cast("B")) for s in encoded.streams], params, TensorSpec.of(tensor), reference)
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    return decoded


def point_aws_at_loopback(patch: Any, port: int) -> None:
    """Dummy credentials and an endpoint on 127.0.0.1:``port`` for botocore/s3fs (a local
    S3-compatible server), set through ``patch`` (a pytest ``MonkeyPatch``); no profile."""
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "NO_PROXY": "127.0.0.1,localhost",
    }.items():
        patch.setenv(key, value)
    patch.delenv("AWS_PROFILE", raising=False)
