"""Write the golden lossless-codec encodings (run by hand, then commit).

Files: ``tests/golden/codecs/{byte_grouping,raw,xor_delta,entropy}/*.json``.

Each file pins one encoding: the codec config, the tensor spec, the params and streams
an encoder produced, and the exact tensor they must decode to. The tests decode every
file on every run, so a change that breaks reading existing files fails loudly. Rerun
this script only for a deliberate format change, and say so in the commit.

    python tests/golden/make_codec_golden.py
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Optional

import torch

from inshrinkerator.codecs import (
    ByteGroupingCodec,
    Codec,
    RawCodec,
    XorDeltaCodec,
    dtype_name,
    encode_symbols,
)

OUT = Path(__file__).resolve().parent / "codecs"


def _b64(data: Any) -> str:
    return base64.b64encode(bytes(memoryview(data).cast("B"))).decode("ascii")


def _tensor_b64(tensor: torch.Tensor) -> str:
    flat = tensor.contiguous().reshape(-1)
    return _b64(flat.view(torch.uint8).numpy()) if flat.numel() else ""


def _sample(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_complex:
        return torch.randn(shape, generator=generator, dtype=torch.float64).mul(0.05).to(dtype)
    if dtype.is_floating_point:
        values = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.05
        flat = values.reshape(-1)
        if flat.numel() >= 8:  # the awkward values: zeros of both signs, inf, nan, a denormal
            flat[:5] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-310])
        return values.to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=generator) > 0.5
    info = torch.iinfo(dtype)
    low, high = max(info.min, -300), min(info.max, 300)
    return torch.randint(low, high + 1, shape, generator=generator, dtype=torch.int64).to(dtype)


def _write(name: str, codec: Codec, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> None:
    encoded = codec.encode(tensor, reference)
    doc = {
        "codec": codec.get_config(),
        "dtype": dtype_name(tensor.dtype),
        "shape": list(tensor.shape),
        "params": encoded.params,
        "streams": [_b64(stream) for stream in encoded.streams],
        "reference": None if reference is None else _tensor_b64(reference),
        "expected": _tensor_b64(tensor),
    }
    folder = OUT / type(codec).codec_id
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")


def main() -> None:
    grouping = ByteGroupingCodec(chunk_bytes=4096)  # small chunks: several per tensor
    for index, dtype in enumerate(
        [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
         torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64]
    ):
        rows = 6144 // dtype.itemsize // 32  # about 6 KB: one full chunk and a partial one
        _write(f"byte_grouping_{dtype_name(dtype)}", grouping, _sample(dtype, (rows, 32), seed=index))
    # chunks of at least 1024 elements: near-random mantissa planes are stored as raw pairs
    _write("byte_grouping_float32_pairs", grouping, _sample(torch.float32, (4096,), seed=23))
    _write("byte_grouping_float64_pairs", ByteGroupingCodec(chunk_bytes=8192), _sample(torch.float64, (2048,), seed=24))
    _write("byte_grouping_float32_scalar", grouping, _sample(torch.float32, (), seed=20))
    _write("byte_grouping_float32_empty", grouping, _sample(torch.float32, (3, 0), seed=21))
    _write("byte_grouping_float32_level3", ByteGroupingCodec(level=3, chunk_bytes=4096),
           _sample(torch.float32, (1500,), seed=22))
    _write("byte_grouping_int64_zeros", grouping, torch.zeros(3000, dtype=torch.int64))
    # tensors larger than a slice: one stream per slice (params {"chunk", "slice"})
    sliced = ByteGroupingCodec(chunk_bytes=4096, slice_bytes=8192)
    _write("byte_grouping_float32_sliced", sliced, _sample(torch.float32, (50, 100), seed=25))
    _write("byte_grouping_bfloat16_sliced", sliced, _sample(torch.bfloat16, (9000,), seed=26))
    _write("byte_grouping_complex64_sliced", sliced, _sample(torch.complex64, (2100,), seed=27))
    _write("byte_grouping_int64_sliced", sliced, _sample(torch.int64, (3000,), seed=28))
    _write("raw_float32", RawCodec(), _sample(torch.float32, (7, 3), seed=30))
    _write("raw_bool", RawCodec(), _sample(torch.bool, (13,), seed=31))
    base = _sample(torch.float32, (30, 40), seed=40)
    tuned = base + _sample(torch.float32, (30, 40), seed=41).nan_to_num() * 1e-3
    _write("xor_delta_float32", XorDeltaCodec(inner=grouping.get_config()), tuned, base)
    base16 = _sample(torch.bfloat16, (500,), seed=42)
    _write("xor_delta_bfloat16", XorDeltaCodec(), base16 + 0.001, base16)

    symbols = torch.randint(0, 37, (3000,), generator=torch.Generator().manual_seed(50)) ** 2 % 37
    (OUT / "entropy").mkdir(parents=True, exist_ok=True)
    (OUT / "entropy" / "symbols.json").write_text(
        json.dumps(
            {
                "alphabet": 37,
                "symbols": _b64(symbols.to(torch.int32).numpy()),
                "stream": _b64(encode_symbols(symbols, 37)),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {len(list(OUT.glob('*/*.json')))} files under {OUT}")


if __name__ == "__main__":
    main()
