"""Codecs: pure tensor <-> bytes transforms behind one small contract (see :mod:`.base`)."""

from .base import Codec, Encoded, TensorSpec, dtype_from_name, dtype_name
from .byte_grouping import ByteGroupingCodec
from .raw import RawCodec
from .registry import get_codec, register_codec, registered_codecs
from .xor_delta import XorDeltaCodec
from .entropy import decode_symbols, encode_symbols, order0_entropy_bits

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
]
