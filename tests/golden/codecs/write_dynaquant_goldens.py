"""Write the golden files of the DynaQuant codecs (run once; tests only read them).

    python tests/golden/codecs/write_dynaquant_goldens.py [--overwrite]

Same layout as the baseline codecs' goldens: each case folder holds ``case.json``
(codec config, params, dtype, shape, stream file names), the streams, the input, the
reference (delta cases), the context (masked cases: the tensor whose zeros the case
shares; grouped cases: the tensor whose octaves, or signs, group the ids) and the expected decoded
tensor, as raw little-endian bytes.
Existing cases are kept unless ``--overwrite`` is given: a changed encoding must be a
deliberate format change, never a silent regeneration.

The bucket-id coder gets its own small goldens (``bucket_delta/*.json``: ids,
predictions and the stream, in every mode and layout), because the codecs only use
the un-rearranged mode for tensors too large to keep in the repository.

``even_levels_*`` cases hold levels given to the encoder as hints (stored as their step):
the tests decode them but cannot encode them again from the config alone.
Cases named ``v1_*`` hold streams of DynaQuant stream version 1 (run tokens and ANS
only) and ``v2_*`` of version 2 (direct layout and Huffman, no symbol tuples), written
by the version of this script at that format; this script cannot write them any more,
and the tests check that they still decode. Cases named ``counts_*`` hold low-rank factors
coded with one count table over both factors (``factor_coding`` absent from their config),
as the codecs wrote them before the column coding.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from inshrinkerator.codecs import (
    Codec,
    DynaQuantCodec,
    DynaQuantDeltaCodec,
    DynaQuantGroupedCodec,
    DynaQuantMaskedCodec,
    DynaQuantMaskedDeltaCodec,
    GroupedLowRankCodec,
    LowRankCodec,
    LowRankResidualCodec,
    ScaledLowRankCodec,
    SignGroupedResidualCodec,
)
from inshrinkerator.codecs.bucket_delta import encode_bucket_ids
from inshrinkerator.codecs.dynaquant import even_level_values

HERE = Path(__file__).resolve().parent


def _weights(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=generator, dtype=torch.float64) * 0.05).to(dtype)


def _update(tensor: torch.Tensor, seed: int, size: float = 1e-3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    step = torch.randn(tensor.shape, generator=generator, dtype=torch.float64) * size
    return (tensor.to(torch.float64) + step).to(tensor.dtype)


def _second_moment(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.exp2(torch.randn(shape, generator=generator, dtype=torch.float64) * 4 - 20).float()
    values.view(-1)[::17] = 0.0
    return values


def _first_moment(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    # A pruned first moment as a reader decodes it: 0 but for about a tenth of the entries.
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * 1e-3
    return torch.where(torch.rand(shape, generator=generator) < 0.1, values, 0.0)


def _row_octaves(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    # A second moment whose rows sit up to 12 octaves apart, each spread over about one.
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 13, (shape[0], 1), generator=generator, dtype=torch.float64)
    return torch.exp2(rows + torch.randn(shape, generator=generator, dtype=torch.float64) * 0.5 - 24).float()


def _cases() -> list[tuple[str, Codec, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]]:
    base = _weights((24, 40), 1)
    special = base.clone()
    special.view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    full = DynaQuantCodec(bins=12, prune=0.2, protect=0.01)
    previous = full.encode(base).reconstruction
    moment = _second_moment((30, 30), 7)
    log_full = DynaQuantCodec(bins=8, domain="log")
    first = _first_moment((30, 30), 8)
    spread = _second_moment((64, 80), 9)  # octaves from 2**-36 to 2**-4, and zeros
    follows = torch.randn((64, 80), generator=torch.Generator().manual_seed(10)) * spread.sqrt()
    # Evenly spaced levels (a change rounded as the default policy rounds it), stored as their
    # step alone: the codec's config cannot say so, so this case is decoded, not re-encoded.
    levels = even_level_values(float(torch.tensor(1.5e-3, dtype=torch.float32)), 6)
    even = DynaQuantCodec(bins=12).with_hints(centroids=torch.cat([levels[:6], levels[7:]]))
    # A weight moved mostly against the sign of its first moment (the context), as Adam
    # moves it, stored as its change since the reference.
    weights = _weights((48, 64), 12)
    signs = torch.randn((48, 64), generator=torch.Generator().manual_seed(13)) * 1e-3
    moved = (weights.double() - signs.sign().double() * 2e-4 + _update(torch.zeros(48, 64), 14, 5e-5).double()).float()
    # A weight matrix moved mostly along two directions, stored as its change: a rank-2
    # product of integer factors plus what it leaves.
    matrix = _weights((40, 56), 15)
    directions = torch.randn((40, 2), generator=torch.Generator().manual_seed(16)) @ torch.randn(
        (2, 56), generator=torch.Generator().manual_seed(17)
    )
    turned = (matrix.double() + directions.double() * 1e-3 + _update(torch.zeros(40, 56), 18, 1e-4).double()).float()
    # A first moment mostly along three directions, coded per octave of its second moment.
    along = torch.randn((64, 80), generator=torch.Generator().manual_seed(19))
    few = torch.randn((64, 3), generator=torch.Generator().manual_seed(21)) @ torch.randn(
        (3, 80), generator=torch.Generator().manual_seed(22)
    )
    averaged = (few * 1e-4 + along * spread.sqrt() * 1e-3).float()
    # A second moment whose rows (units) sit octaves apart: its ids are coded per class of rows.
    by_row = _row_octaves((64, 128), 23)
    # A second moment grown by 40 % since its reference, as Adam's does early on (its bias
    # correction): the delta is coded against the reference scaled by a stored shift.
    narrow = torch.exp2(torch.randn((64, 80), generator=torch.Generator().manual_seed(24), dtype=torch.float64) - 20)
    grown = (narrow * 1.4 * torch.exp2(
        torch.randn((64, 80), generator=torch.Generator().manual_seed(25), dtype=torch.float64) * 0.1
    )).float()
    kept_first = averaged.clone()
    kept_first.view(-1)[::3] = 0.0  # pruned: the masked delta codes the other entries only
    narrow_previous = DynaQuantCodec(bins=8, domain="log", protect=0.005).encode(narrow.float()).reconstruction
    return [
        ("dynaquant/float32_bins12_prune_protect", full, base, None, None),
        ("dynaquant/float32_non_finite", DynaQuantCodec(bins=4, protect=0.01), special, None, None),
        ("dynaquant/float16_bins6", DynaQuantCodec(bins=6, protect=0.02), _weights((300,), 3, torch.float16), None, None),
        ("dynaquant/bfloat16_bins16", DynaQuantCodec(bins=16), _weights((16, 20), 4, torch.bfloat16), None, None),
        ("dynaquant/float32_log_domain", log_full, moment, None, None),
        ("dynaquant/float32_log_row_classes", DynaQuantCodec(bins=8, domain="log"), by_row, None, None),
        ("dynaquant_delta/float32_rearranged_sticky",
         DynaQuantDeltaCodec(bins=12, prune=0.2, protect=0.01, stickiness=0.5), _update(base, 2), previous, None),
        ("dynaquant_delta/float32_log_domain",
         DynaQuantDeltaCodec(bins=8, domain="log", stickiness=0.5), (moment * 1.05).contiguous(),
         log_full.encode(moment).reconstruction, None),
        ("dynaquant_masked/float32_log_domain",
         DynaQuantMaskedCodec(bins=8, domain="log", protect=0.005), moment, None, first),
        ("dynaquant_masked_delta/float32_log_domain",
         DynaQuantMaskedDeltaCodec(bins=8, domain="log", protect=0.005, stickiness=0.5), (moment * 1.05).contiguous(),
         log_full.encode(moment).reconstruction, first),
        ("dynaquant_delta/float32_log_shifted",
         DynaQuantDeltaCodec(bins=8, domain="log", protect=0.005), grown, narrow_previous, None),
        ("dynaquant_masked_delta/float32_log_shifted",
         DynaQuantMaskedDeltaCodec(bins=8, domain="log", protect=0.005), grown, narrow_previous, kept_first),
        ("dynaquant_grouped/float32_by_octave",
         DynaQuantGroupedCodec(bins=8, protect=0.005), follows, None, spread),
        ("dynaquant/even_levels_float32", even, _update(base, 5, 2e-3) - base, None, None),
        ("residual_sign_grouped/float32_against_first_moment",
         SignGroupedResidualCodec(DynaQuantCodec(bins=10)), moved, weights, signs),
        ("residual_low_rank/float32_rank2", LowRankResidualCodec(DynaQuantCodec(bins=10), rank=2), turned, matrix, None),
        ("dynaquant_grouped_low_rank/float32_rank3_by_octave",
         GroupedLowRankCodec(DynaQuantGroupedCodec(bins=8), rank=3), averaged, None, spread),
        # A momentum buffer mostly along three directions: the product alone, and the product
        # plus what it leaves on k-means levels.
        ("low_rank/float32_rank3_product", LowRankCodec(rank=3), averaged, None, None),
        ("low_rank/float32_rank2_with_inner", LowRankCodec(rank=2, inner=DynaQuantCodec(bins=8, prune=0.5)), averaged, None, None),
        # A first moment whose steps (over the square root of its second moment, the
        # context) lie along three directions.
        ("low_rank_scaled/float32_rank3_steps", ScaledLowRankCodec(rank=3), (few * spread.sqrt() * 1e-3).float(), None, spread),
    ]


def _raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def write_case(
    folder: Path, codec: Codec, tensor: torch.Tensor, reference: Optional[torch.Tensor],
    context: Optional[torch.Tensor] = None,
) -> None:
    encoded = codec.encode(tensor, reference) if context is None else codec.encode(tensor, reference, context=context)
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
    if context is not None:
        (folder / "context.bin").write_bytes(_raw(context))
    meta = {
        "config": codec.get_config(),
        "params": encoded.params,
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "streams": names,
        "has_reference": reference is not None,
        "has_context": context is not None,
        "torch": torch.__version__,
    }
    (folder / "case.json").write_text(json.dumps(meta, indent=1) + "\n")


def _bucket_delta_cases() -> list[tuple[str, torch.Tensor, int, Optional[torch.Tensor], bool]]:
    generator = torch.Generator().manual_seed(11)
    predicted = torch.randint(0, 14, (3000,), generator=generator)
    moved = torch.rand(3000, generator=generator) < 0.05
    ids = torch.where(moved, (predicted + torch.randint(-1, 2, (3000,), generator=generator)).clamp(0, 13), predicted)
    dense = torch.where(torch.rand(3000, generator=generator) < 0.6, (predicted + 1) % 14, predicted)
    wide = torch.randint(0, 300, (3000,), generator=generator)
    wide_ids = torch.where(torch.rand(3000, generator=generator) < 0.1, (wide + 7) % 300, wide)
    # A short stream of dense changes (a bias's), coded under a symmetric model.
    small_predicted = torch.randint(0, 10, (200,), generator=generator)
    steps = torch.randint(-2, 3, (200,), generator=generator)
    small = (small_predicted + steps) % 10
    return [
        ("plain", ids, 14, None, False),
        ("predicted", ids, 14, predicted, False),
        ("rearranged", ids, 14, predicted, True),
        ("dense_predicted", dense, 14, predicted, False),
        ("dense_rearranged", dense, 14, predicted, True),
        ("wide_alphabet", wide_ids, 300, wide, False),
        ("small_predicted", small, 10, small_predicted, False),
    ]


def write_bucket_delta_case(path: Path, ids: torch.Tensor, levels: int, predicted: Optional[torch.Tensor], rearrange: bool) -> None:
    stream = encode_bucket_ids(ids, levels, predicted, rearrange)
    meta = {
        "levels": levels,
        "ids": ids.tolist(),
        "predicted": predicted.tolist() if predicted is not None else None,
        "stream": base64.b64encode(stream).decode("ascii"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta) + "\n")


def _mode_byte(path: Path) -> int:
    return base64.b64decode(json.loads(path.read_text())["stream"])[0]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--overwrite", action="store_true", help="replace existing cases")
    args = parser.parse_args(argv)
    for name, codec, tensor, reference, context in _cases():
        folder = HERE / name
        if (folder / "case.json").exists() and not args.overwrite:
            print(f"kept     {name}")
            continue
        write_case(folder, codec, tensor, reference, context)
        print(f"wrote    {name}")
    for name, ids, levels, predicted, rearrange in _bucket_delta_cases():
        path = HERE / "bucket_delta" / f"{name}.json"
        if path.exists() and not args.overwrite:
            print(f"kept     bucket_delta/{name}")
            continue
        write_bucket_delta_case(path, ids, levels, predicted, rearrange)
        print(f"wrote    bucket_delta/{name} (mode byte {_mode_byte(path):#04x})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
