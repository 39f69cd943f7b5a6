"""Codecs: pure tensor <-> bytes transforms behind one small contract (see :mod:`.base`)."""

from .base import Codec, Encoded, TensorSpec, dtype_from_name, dtype_name
from .byte_grouping import ByteGroupingCodec
from .cyclic_code_delta import CyclicCodeDeltaCodec
from .dynaquant import DynaQuantCodec, DynaQuantDeltaCodec
from .dynaquant_context import (
    DynaQuantGroupedCodec,
    DynaQuantMaskedCodec,
    DynaQuantMaskedDeltaCodec,
    SignGroupedResidualCodec,
)
from .entropy import decode_symbols, encode_symbols, order0_entropy_bits
from .entropy_width_quantize import EntropyWidthQuantizeCodec
from .exponent_bucket import ExponentBucketCodec
from .factored_moment import FactoredMomentCodec
from .kmeans_quantize import KMeansQuantizeCodec
from .low_rank import GroupedLowRankCodec, LowRankCodec, LowRankResidualCodec, ScaledLowRankCodec
from .raw import RawCodec
from .registry import get_codec, register_codec, registered_codecs
from .residual import ResidualCodec
from .unchanged import UnchangedCodec
from .uniform_quantize import UniformQuantizeCodec
from .xor_delta import XorDeltaCodec

__all__ = [
    "Codec",
    "Encoded",
    "TensorSpec",
    "dtype_name",
    "dtype_from_name",
    "get_codec",
    "register_codec",
    "registered_codecs",
    "ByteGroupingCodec",
    "RawCodec",
    "XorDeltaCodec",
    "encode_symbols",
    "decode_symbols",
    "order0_entropy_bits",
    "ResidualCodec",
    "ExponentBucketCodec",
    "KMeansQuantizeCodec",
    "UniformQuantizeCodec",
    "EntropyWidthQuantizeCodec",
    "CyclicCodeDeltaCodec",
    "DynaQuantCodec",
    "DynaQuantDeltaCodec",
    "DynaQuantGroupedCodec",
    "DynaQuantMaskedCodec",
    "DynaQuantMaskedDeltaCodec",
    "SignGroupedResidualCodec",
    "FactoredMomentCodec",
    "GroupedLowRankCodec",
    "LowRankCodec",
    "LowRankResidualCodec",
    "ScaledLowRankCodec",
    "UnchangedCodec",
]
