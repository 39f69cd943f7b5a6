"""Write the golden ``.ink`` files that pin the container format.

Run ``python tests/golden/container/make_golden.py`` only when the format changes on
purpose (and then bump ``FORMAT_VERSION`` or keep reading the old files). Tests never
regenerate these files: they decode the committed bytes on every run and compare them
with the states below, which are rebuilt bit for bit from integer arithmetic (no random
generator, no floating-point library function), so they are the same on every platform
and torch version.

Files (name -> state, saved with ``ink.save(..., policy="lossless")``):

* ``full_state.ink``: a training state (model with tied weights, Adam-like optimizer with
  int keys, scheduler, step, RNG bytes, a config of awkward plain values, special floats,
  a non-contiguous view);
* ``dtypes.ink``: every stored dtype, with 0-dim, empty and larger tensors;
* ``tuned_with_base.ink``: :func:`tuned_state` saved with ``base=base_state()``.

The ``v1_*.ink`` files hold the same states in format version 1 (plain JSON header,
sections aligned to 64 bytes), written by the release before version 2, and the ``v2_*.ink``
files in version 2 (each section listed with its offset), written by the release before
version 3. The script no longer writes them: they are kept to show that such files still
decode.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent

_MASK32 = 0xFFFFFFFF


def hashed(count: int, seed: int) -> torch.Tensor:
    """``count`` well-mixed 32-bit values (as int64 in [0, 2**32)) from integer ops only."""
    x = (torch.arange(count, dtype=torch.int64) + seed * 0x9E3779B1) & _MASK32
    for _ in range(2):  # a murmur-style finalizer; every product stays below 2**63
        x = x ^ (x >> 16)
        x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def _as_signed(bits: torch.Tensor, width: int) -> torch.Tensor:
    return torch.where(bits >= 1 << (width - 1), bits - (1 << width), bits)


def weights(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Weight-like floats (magnitudes about 2**-7 .. 1) built from their bit patterns."""
    count = 1
    for dim in shape:
        count *= dim
    h = hashed(count, seed)
    sign, exponent, mantissa = (h >> 31) & 1, 120 + (h >> 23) % 7, h & 0x7FFFFF
    unsigned = (sign << 31) | (exponent << 23) | mantissa
    bits32 = _as_signed(unsigned, 32).to(torch.int32)
    values = bits32.view(torch.float32)
    if dtype == torch.float64:
        low = hashed(count, seed + 1) & 0x1FFFFFFF  # the 29 mantissa bits a float32 lacks
        values = (values.to(torch.float64).view(torch.int64) | low).view(torch.float64)
    elif dtype in (torch.bfloat16, torch.float16):
        top = (unsigned >> 16) if dtype == torch.bfloat16 else ((sign << 15) | ((8 + (h >> 23) % 7) << 10) | (h & 0x3FF))
        values = _as_signed(top & 0xFFFF, 16).to(torch.int16).view(dtype)
    elif dtype.is_complex:
        values = torch.complex(values, weights(shape, seed + 7).reshape(-1)).to(dtype)
    return values.reshape(shape)


def integers(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Small signed integers (or 0/1 for bool, 0..255 for uint8)."""
    count = 1
    for dim in shape:
        count *= dim
    h = hashed(count, seed)
    if dtype == torch.bool:
        return (h & 1).to(torch.bool).reshape(shape)
    if dtype == torch.uint8:
        return (h & 0xFF).to(torch.uint8).reshape(shape)
    return ((h % 2001) - 1000).to(dtype).reshape(shape)


def special_floats() -> torch.Tensor:
    """NaN (quiet, negative, with payload), infinities, signed zeros, denormals, extremes."""
    patterns = [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7F800000, 0xFF800000, 0x00000000,
                0x80000000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000]
    bits = _as_signed(torch.tensor(patterns, dtype=torch.int64), 32).to(torch.int32)
    return bits.view(torch.float32)


def full_state() -> dict[str, Any]:
    """A resumable training state with every kind of value the format stores."""
    embed = weights((16, 8), 1)
    fc = weights((10, 72), 2)
    model = OrderedDict(
        [
            ("embed.weight", embed),
            ("conv.weight", weights((8, 1, 3, 3), 3)),
            ("conv.bias", weights((8,), 4)),
            ("bn.running_mean", weights((8,), 5)),
            ("bn.num_batches_tracked", torch.tensor(1200)),
            ("fc.weight", fc),
            ("fc.bias", weights((10,), 6)),
            ("head.weight", embed),  # tied to embed.weight
        ]
    )
    optimizer = {
        "state": {
            index: {
                "step": torch.tensor(1200.0),
                "exp_avg": weights(tuple(tensor.shape), 10 + index),
                "exp_avg_sq": weights(tuple(tensor.shape), 20 + index).abs(),
            }
            for index, tensor in enumerate([embed, fc])
        },
        "param_groups": [
            {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
             "amsgrad": False, "foreach": None, "params": [0, 1]}
        ],
    }
    config = OrderedDict(
        name="tiny-gpt ✓ 🚀", dropout=None, nan=float("nan"), neg_zero=-0.0, inf=float("-inf"),
        denormal=5e-324, big=2**80 + 1, small=-(2**70), raw=b"\x00\xff\x80", dtype=torch.bfloat16,
        size=torch.Size([2, 3]), keys={1: "int", "1": "str", None: "none", True: "bool", 2.5: "float"},  # noqa: F601 - as the golden was written (True replaces 1's value)
        empty=([], (), {}, OrderedDict()),
    )
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": {"step_size": 2, "gamma": 0.5, "_last_lr": [0.0005], "last_epoch": 3},
        "step": 1200,
        "rng": integers((816,), 30, torch.uint8),
        "config": config,
        "specials": special_floats(),
        "fc_transposed": fc.t(),
    }


DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]


def dtype_state() -> dict[str, Any]:
    """For each dtype: a 0-dim, two empty, a small and a larger tensor."""
    state = {}
    for index, dtype in enumerate(DTYPES):
        name = str(dtype).removeprefix("torch.")
        make = weights if dtype.is_floating_point or dtype.is_complex else lambda s, k, d: integers(s, k, d)
        state[name] = {
            "scalar": make((), 100 + index, dtype),
            "empty": make((0,), 200 + index, dtype),
            "empty_3d": make((3, 0, 2), 300 + index, dtype),
            "small": make((5, 7), 400 + index, dtype),
            "large": make((24, 25), 500 + index, dtype),
        }
    return state


def base_state() -> dict[str, torch.Tensor]:
    """A 'pretrained' state that :func:`tuned_state` is a fine-tune of."""
    return {"w": weights((32, 32), 40), "b": weights((32,), 41), "ids": integers((50,), 42, torch.int64)}


def tuned_state() -> dict[str, torch.Tensor]:
    """:func:`base_state` with the low mantissa bits of its floats changed, plus a new head."""
    tuned = {}
    for key, tensor in base_state().items():
        if tensor.is_floating_point():
            noise = (hashed(tensor.numel(), 50) & 0xFF).to(torch.int32).reshape(tensor.shape)
            tensor = (tensor.view(torch.int32) ^ noise).view(torch.float32)
        tuned[key] = tensor
    tuned["head"] = weights((32, 4), 51)
    return tuned


GOLDEN = {
    "full_state.ink": (full_state, None),
    "dtypes.ink": (dtype_state, None),
    "tuned_with_base.ink": (tuned_state, base_state),
}

#: Files of the same states in format versions 1 (``v1_*``) and 2 (``v2_*``), committed and
#: no longer written.
LEGACY = {f"v{version}_{name}": build for version in (1, 2) for name, build in GOLDEN.items()}


def main(directory: Path = HERE) -> None:
    import inshrinkerator as ink

    for name, (make_state, make_base) in GOLDEN.items():
        base = make_base() if make_base else None
        info = ink.save(make_state(), directory / name, policy="lossless", base=base)
        print(f"{name}: {info.stored_bytes} bytes, {info.kind}", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
