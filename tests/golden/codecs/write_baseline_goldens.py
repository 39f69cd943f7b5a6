"""Write the golden files of the baseline codecs (run once; tests only read them).

    python tests/golden/codecs/write_baseline_goldens.py [--overwrite]

Each case folder holds ``case.json`` (codec config, params, dtype, shape, stream
file names), the streams, the input, the reference (for delta codecs) and the
expected decoded tensor, all as raw little-endian bytes. Existing cases are kept
unless ``--overwrite`` is given: a changed encoding must be a deliberate format
change, never a silent regeneration.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from inshrinkerator.codecs import (
    Codec,
    CyclicCodeDeltaCodec,
    EntropyWidthQuantizeCodec,
    ExponentBucketCodec,
    KMeansQuantizeCodec,
    ResidualCodec,
    UnchangedCodec,
    UniformQuantizeCodec,
)

HERE = Path(__file__).resolve().parent


def _weights(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * 0.05).to(dtype)


def _update(tensor: torch.Tensor, seed: int, size: float = 1e-3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    step = torch.randn(tensor.shape, generator=generator, dtype=torch.float64) * size
    return (tensor.to(torch.float64) + step).to(tensor.dtype)


def _with_zeros(tensor: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.where(torch.rand(tensor.shape, generator=generator) < 0.4, torch.zeros_like(tensor), tensor)


def _cases() -> list[tuple[str, Codec, torch.Tensor, Optional[torch.Tensor]]]:
    base = _weights((24, 40), 1)
    moved = _update(base, 2)
    half = _weights((300,), 3, torch.float16)
    bf16 = _weights((16, 20), 4, torch.bfloat16)
    few_values = torch.tensor([0.5, -0.25, 0.0, 0.125] * 30, dtype=torch.float32).reshape(10, 12)
    return [
        ("exponent_bucket/float32_bits3_midrange", ExponentBucketCodec(3, "midrange"), base, None),
        ("exponent_bucket/float16_bits2_mean", ExponentBucketCodec(2, "mean"), half, None),
        ("kmeans_quantize/float32_bits4_zeros", KMeansQuantizeCodec(4), _with_zeros(base, 5), None),
        ("kmeans_quantize/float32_exact_codebook", KMeansQuantizeCodec(4), few_values, None),
        ("kmeans_quantize/bfloat16_bits3", KMeansQuantizeCodec(3, lzma_preset=6, lzma_extreme=False), bf16, None),
        ("uniform_quantize/float32_rows_bits4", UniformQuantizeCodec(4), base, None),
        ("uniform_quantize/float16_tensor_bits3", UniformQuantizeCodec(3, per_row=False, search_steps=25, search_range=0.5), half, None),
        ("entropy_width_quantize/float32", EntropyWidthQuantizeCodec(), base, None),
        ("entropy_width_quantize/bfloat16_bins_4_16", EntropyWidthQuantizeCodec(4, 16), bf16, None),
        ("cyclic_code_delta/float32", CyclicCodeDeltaCodec(), moved, base),
        ("residual/exponent_bucket_float32", ResidualCodec(ExponentBucketCodec(3)), moved, base),
        ("residual/kmeans_quantize_bfloat16", ResidualCodec(KMeansQuantizeCodec(4)), _update(bf16, 6, 1e-2), bf16),
        ("unchanged/float32", UnchangedCodec(), _update(base, 7, 1e-5), base),
        ("unchanged/bfloat16", UnchangedCodec(), bf16, bf16),
    ]


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write_case(folder: Path, codec: Codec, tensor: torch.Tensor, reference: Optional[torch.Tensor]) -> None:
    encoded = codec.encode(tensor, reference)
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for index, stream in enumerate(encoded.streams):
        name = f"stream{index}.bin"
        (folder / name).write_bytes(bytes(memoryview(stream).cast("B")))
        names.append(name)
    (folder / "input.bin").write_bytes(_raw(tensor))
    (folder / "expected.bin").write_bytes(_raw(encoded.reconstruction))
    if reference is not None:
        (folder / "reference.bin").write_bytes(_raw(reference))
    meta = {
        "config": codec.get_config(),
        "params": encoded.params,
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "streams": names,
        "has_reference": reference is not None,
        "torch": torch.__version__,
    }
    (folder / "case.json").write_text(json.dumps(meta, indent=1) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overwrite", action="store_true", help="replace existing cases")
    args = parser.parse_args(argv)
    for name, codec, tensor, reference in _cases():
        folder = HERE / name
        if (folder / "case.json").exists() and not args.overwrite:
            print(f"kept     {name}")
            continue
        write_case(folder, codec, tensor, reference)
        print(f"wrote    {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
