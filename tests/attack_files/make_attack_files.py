"""Write the committed corpus of hostile and odd files that the ``.ink`` reader must handle.

Run ``python tests/attack_files/make_attack_files.py`` to (re)write the corpus next to
this script; tests never regenerate it. ``expected.json`` says, for each file, the error
a reader must raise (class name and a regex its message matches), or ``"ok"`` for odd but
valid files. Headers of forged ``.ink`` files carry a correct CRC-32, so each attack
reaches the validation step it targets rather than stopping at the checksum.

The forging helpers (:func:`forge`, :func:`valid_doc`) are imported by the tests.
"""

from __future__ import annotations

import io
import json
import struct
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import zstandard

HERE = Path(__file__).resolve().parent
MAGIC = b"\x89INK\r\n\x1a\n"
PREAMBLE = struct.Struct("<8sIIQII")
ALIGNMENT = 64
#: the file a pickle payload in this corpus would create in the working directory
MARKER = "INK_ATTACK_MARKER"


def aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def forge(
    doc: Any = None,
    data: bytes = b"",
    *,
    header: Optional[bytes] = None,
    magic: bytes = MAGIC,
    version: int = 1,
    flags: int = 0,
    reserved: int = 0,
    header_length: Optional[int] = None,
    header_crc: Optional[int] = None,
    padding: Optional[bytes] = None,
) -> bytes:
    """An ``.ink`` file from a header document (or raw header bytes) and a data region.

    Every field is right unless overridden: the CRC matches the header, the padding is zero.
    """
    if header is None:
        header = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    length = len(header) if header_length is None else header_length
    crc = zlib.crc32(header) if header_crc is None else header_crc
    pad = bytes(aligned(PREAMBLE.size + len(header)) - PREAMBLE.size - len(header)) if padding is None else padding
    return PREAMBLE.pack(magic, version, flags, length, crc, reserved) + header + pad + data


def forge_v2(doc: Any = None, data: bytes = b"", *, frame: Optional[bytes] = None, version: int = 2) -> bytes:
    """A version-2 file: the header ``frame`` (by default ``doc`` as one zstd frame), no padding.
    ``version=3`` forges a version-3 file, whose header is encoded the same way (its
    sections listed without offsets)."""
    if frame is None:
        frame = zstandard.ZstdCompressor().compress(json.dumps(doc, separators=(",", ":")).encode("utf-8"))
    return forge(header=frame, data=data, version=version, padding=b"")


def section(data: bytes, offset: int = 0) -> list[int]:
    return [offset, len(data), zlib.crc32(data)]


#: the 16 data bytes of the valid file's tensor: float32 [[1, 2], [3, 4]]
W_BYTES = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)


def valid_doc(data: bytes = W_BYTES) -> dict[str, Any]:
    """The header of a valid file holding ``{"w": float32 [2, 2], "step": 7}`` (raw codec)."""
    return {
        "format": "inshrinkerator",
        "data_bytes": len(data),
        "skeleton": {"d": [["w", {"t": 0}], ["step", {"i": 7}]]},
        "tensors": [
            {
                "dtype": "float32",
                "shape": [2, 2],
                "codec": {"id": "raw"},
                "params": {},
                "sections": [section(data)],
                "reference": None,
            }
        ],
        "meta": {"policy": "lossless", "raw_bytes": len(data)},
    }


def with_record(**changes: Any) -> bytes:
    doc = valid_doc()
    doc["tensors"][0].update(changes)
    return forge(doc, W_BYTES)


def with_doc(**changes: Any) -> bytes:
    doc = valid_doc()
    doc.update(changes)
    return forge(doc, W_BYTES)


def two_records(second_offset: int, gap_bytes: bytes = b"") -> bytes:
    """Two raw tensors; the second section starts at ``second_offset`` of the data region."""
    doc = valid_doc()
    record = dict(doc["tensors"][0])
    first_end = len(W_BYTES)
    data = W_BYTES + gap_bytes.ljust(max(second_offset - first_end, 0), b"\0") + W_BYTES
    record["sections"] = [[second_offset, len(W_BYTES), zlib.crc32(W_BYTES)]]
    doc["tensors"].append(record)
    doc["skeleton"]["d"].append(["w2", {"t": 1}])
    doc["data_bytes"] = max(len(data), second_offset + len(W_BYTES))
    return forge(doc, data[: doc["data_bytes"]])


def odd_unicode_state_keys() -> list[str]:
    """Keys a valid file may hold; each must come back exactly."""
    return [
        "", "\x00", "\x7f", "../../etc/passwd", "a/b", "\u202e\u0301gnp.exe", "\ufeffbom",
        "e\u0301", "\u00e9", "🚀", "\U0010ffff", "\u2028line", '"},{"t":0}', "\\u0041",
        "𝔲𝔫𝔦𝔠𝔬𝔡𝔢", "ｆｕｌｌ", "\u0000\u0000",
    ]


def _odd_unicode_file() -> bytes:
    keys = odd_unicode_state_keys()
    doc = valid_doc()
    doc["skeleton"] = {"d": [["w", {"t": 0}]] + [[key, {"s": key}] for key in keys]}
    return forge(doc, W_BYTES)


def _nonzero_header_padding() -> bytes:
    doc = valid_doc()
    header = json.dumps(doc, separators=(",", ":")).encode()
    if (PREAMBLE.size + len(header)) % ALIGNMENT == 0:
        header += b" "  # make room for at least one padding byte
    size = aligned(PREAMBLE.size + len(header)) - PREAMBLE.size - len(header)
    return forge(header=header, data=W_BYTES, padding=b"\0" * (size - 1) + b"\x01")


def _pickle_as_data() -> bytes:
    """A valid file whose only tensor's bytes are a pickle payload: it is data, never run."""
    payload = pickle_payload()
    doc = valid_doc(payload)
    doc["tensors"][0].update(dtype="uint8", shape=[len(payload)])
    return forge(doc, payload)


class _Payload:
    """Unpickling this creates ``MARKER`` in the working directory."""

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str, str]]:
        return (open, (MARKER, "w"))


def pickle_payload() -> bytes:
    import pickle

    return pickle.dumps({"w": _Payload()}, protocol=2)


def torch_save_payload() -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2), "evil": _Payload()}, buffer)
    return buffer.getvalue()


def _nested(levels: int, leaf: Any, wrap: Callable[[Any], Any]) -> Any:
    node = leaf
    for _ in range(levels):
        node = wrap(node)
    return node


Attack = tuple[Callable[[], bytes], str, str]  # (make bytes, error class or "ok", message regex)


def corpus() -> dict[str, Attack]:
    """File name -> (builder, expected error class name or ``"ok"``, regex for its message)."""
    valid = forge(valid_doc(), W_BYTES)
    big_header = 16 << 20
    return {
        # -- pickles: never unpickled, refused by their magic
        "pickle_payload.pkl": (pickle_payload, "FormatError", "bad magic.*pickle"),
        "pickle_payload.ink": (pickle_payload, "FormatError", "bad magic.*pickle"),
        "torch_save_payload.pt": (torch_save_payload, "FormatError", "bad magic.*torch.save"),
        "pickle_as_header.ink": (lambda: forge(header=pickle_payload()), "FormatError", "not valid UTF-8 JSON"),
        "pickle_as_section_data.ink": (_pickle_as_data, "ok", ""),
        # -- preamble
        "empty.ink": (lambda: b"", "FormatError", "too short"),
        "truncated_preamble.ink": (lambda: valid[:20], "CorruptCheckpointError", "truncated inside its preamble"),
        "version_0.ink": (lambda: forge(valid_doc(), W_BYTES, version=0), "FormatError", "version 0 is not supported"),
        "version_4.ink": (lambda: forge(valid_doc(), W_BYTES, version=4), "FormatError", "version 4 is not supported"),
        "version_max.ink": (lambda: forge(valid_doc(), W_BYTES, version=2**32 - 1), "FormatError", "not supported"),
        "flags_set.ink": (lambda: forge(valid_doc(), W_BYTES, flags=1), "FormatError", "reserved preamble"),
        "reserved_set.ink": (lambda: forge(valid_doc(), W_BYTES, reserved=7), "FormatError", "reserved preamble"),
        "header_length_zero.ink": (lambda: forge(valid_doc(), W_BYTES, header_length=0), "FormatError", "header length 0"),
        "header_length_over_limit.ink": (
            lambda: forge(valid_doc(), W_BYTES, header_length=big_header + 1), "FormatError", "outside 1.."),
        "header_length_2_63.ink": (lambda: forge(valid_doc(), W_BYTES, header_length=2**63), "FormatError", "outside 1.."),
        "header_length_2_64_minus_1.ink": (
            lambda: forge(valid_doc(), W_BYTES, header_length=2**64 - 1), "FormatError", "outside 1.."),
        "header_length_beyond_file.ink": (
            lambda: forge(valid_doc(), W_BYTES, header_length=big_header), "CorruptCheckpointError", "truncated"),
        "header_crc_wrong.ink": (lambda: forge(valid_doc(), W_BYTES, header_crc=0), "CorruptCheckpointError", "header checksum"),
        "header_padding_not_zero.ink": (_nonzero_header_padding, "CorruptCheckpointError", "padding after the header"),
        "trailing_garbage.ink": (lambda: valid + b"\0", "CorruptCheckpointError", "followed by unexpected bytes"),
        "truncated_data.ink": (lambda: valid[:-1], "CorruptCheckpointError", "truncated"),
        # -- header JSON
        "header_not_utf8.ink": (lambda: forge(header=b'{"format":"\xff\xfe"}'), "FormatError", "not valid UTF-8 JSON"),
        "header_not_json.ink": (lambda: forge(header=b"{oops"), "FormatError", "not valid UTF-8 JSON"),
        "header_is_array.ink": (lambda: forge([]), "FormatError", "does not describe"),
        "header_nan_constant.ink": (
            lambda: forge(header=json.dumps(valid_doc()).replace('"data_bytes": 16', '"data_bytes": NaN').encode()),
            "FormatError", "not valid UTF-8 JSON"),
        "header_deep_nesting.ink": (lambda: forge(header=b"[" * 20_000 + b"]" * 20_000), "FormatError", "not valid UTF-8 JSON"),
        "header_huge_int.ink": (
            lambda: forge(header=json.dumps(valid_doc()).replace('"data_bytes": 16', '"data_bytes": 1' + "0" * 5000).encode()),
            "FormatError", "not valid UTF-8 JSON"),
        "header_wrong_format_name.ink": (lambda: with_doc(format="safetensors"), "FormatError", "does not describe"),
        "header_no_skeleton.ink": (
            lambda: forge({k: v for k, v in valid_doc().items() if k != "skeleton"}, W_BYTES), "FormatError", "does not describe"),
        "header_bad_meta.ink": (lambda: with_doc(meta={"raw_bytes": "lots"}), "FormatError", "meta"),
        "data_bytes_negative.ink": (lambda: with_doc(data_bytes=-16), "FormatError", "data_bytes"),
        "data_bytes_beyond_sections.ink": (lambda: with_doc(data_bytes=2**40), "FormatError", "sections end at 16"),
        "tensors_not_list.ink": (lambda: with_doc(tensors={"0": {}}), "FormatError", "data_bytes/tensors/meta"),
        # -- tensor records
        "shape_huge_dims.ink": (lambda: with_record(shape=[2**47, 2**47]), "FormatError", "more than 2\\*\\*62"),
        "shape_dim_over_limit.ink": (lambda: with_record(shape=[2**48]), "FormatError", "bad shape"),
        "shape_claims_a_terabyte.ink": (lambda: with_record(shape=[2**38]), "FormatError", "claims .* from 16 stored bytes"),
        "shape_negative_dim.ink": (lambda: with_record(shape=[-1, -4]), "FormatError", "bad shape"),
        "shape_65_dims.ink": (lambda: with_record(shape=[1] * 65), "FormatError", "bad shape"),
        "shape_float_dim.ink": (lambda: with_record(shape=[2.0, 2]), "FormatError", "bad shape"),
        "shape_bool_dim.ink": (lambda: with_record(shape=[True, 4]), "FormatError", "bad shape"),
        "shape_not_list.ink": (lambda: with_record(shape="2x2"), "FormatError", "bad shape"),
        "dtype_unknown.ink": (lambda: with_record(dtype="float128"), "FormatError", "unknown dtype 'float128'"),
        "dtype_object.ink": (lambda: with_record(dtype="object"), "FormatError", "unknown dtype"),
        "dtype_python_name.ink": (lambda: with_record(dtype="__builtins__"), "FormatError", "unknown dtype"),
        "dtype_not_string.ink": (lambda: with_record(dtype=5), "FormatError", "unknown dtype"),
        "codec_unknown_id.ink": (lambda: with_record(codec={"id": "pickle"}), "FormatError", "unknown codec 'pickle'"),
        "codec_not_object.ink": (lambda: with_record(codec="raw"), "FormatError", "codec must be an object"),
        "codec_id_not_string.ink": (lambda: with_record(codec={"id": ["raw"]}), "FormatError", "codec must be an object"),
        "codec_unexpected_option.ink": (
            lambda: with_record(codec={"id": "raw", "__class__": "os.system"}), "FormatError", "bad config for codec 'raw'"),
        "codec_bad_option_value.ink": (
            lambda: with_record(codec={"id": "byte_grouping", "level": "__import__('os')"}), "FormatError", "byte_grouping"),
        "codec_deep_nesting.ink": (
            lambda: with_record(codec=_nested(300, {"id": "raw"}, lambda inner: {"id": "xor_delta", "inner": inner})),
            "FormatError", "nest deeper"),
        "params_deep_nesting.ink": (lambda: with_record(params={"inner": _nested(100, 0, lambda x: [x])}), "FormatError", "nest deeper"),
        "params_not_object.ink": (lambda: with_record(params=[1]), "FormatError", "params an object"),
        "reference_not_string.ink": (lambda: with_record(reference={"path": "/etc/passwd"}), "FormatError", "reference"),
        "delta_without_base.ink": (
            lambda: with_record(codec={"id": "xor_delta", "inner": {"id": "raw"}}, params={"inner": {}, "reference_crc32": 0},
                                reference="base"),
            "BrokenChainError", "delta against 'base'|reference"),
        # -- sections
        "section_negative_offset.ink": (lambda: with_record(sections=[[-64, 16, zlib.crc32(W_BYTES)]]), "FormatError", "bad section"),
        "section_misaligned.ink": (lambda: with_record(sections=[[1, 15, zlib.crc32(W_BYTES[1:])]]), "FormatError", "next aligned offset"),
        "section_out_of_range.ink": (lambda: with_record(sections=[[0, 2**40, 0]]), "FormatError", "outside the data region"),
        "section_huge_length.ink": (lambda: with_record(sections=[[0, 2**64 + 5, 0]]), "FormatError", "outside the data region"),
        "section_crc_over_32_bits.ink": (lambda: with_record(sections=[[0, 16, 2**32]]), "FormatError", "outside the data region|crc"),
        "section_not_triple.ink": (lambda: with_record(sections=[[0, 16]]), "FormatError", "bad section entry"),
        "section_not_list.ink": (lambda: with_record(sections={"0": [0, 16, 0]}), "FormatError", "sections must be a list"),
        "sections_overlap.ink": (lambda: two_records(second_offset=0), "FormatError", "overlaps"),
        "sections_with_gap.ink": (lambda: two_records(second_offset=128), "FormatError", "leaves a gap"),
        "section_padding_not_zero.ink": (
            lambda: two_records(second_offset=64, gap_bytes=b"\x00" * 47 + b"\x01"), "CorruptCheckpointError", "padding before"),
        "section_checksum_mismatch.ink": (
            lambda: with_record(sections=[[0, 16, zlib.crc32(W_BYTES) ^ 1]]), "CorruptCheckpointError", "section checksum"),
        "raw_stream_too_short.ink": (
            lambda: forge(valid_doc(W_BYTES[:12]), W_BYTES[:12]), "CorruptCheckpointError", "holds 12 bytes, expected 16"),
        # -- skeleton
        "skeleton_missing_tensor.ink": (
            lambda: with_doc(skeleton={"d": [["w", {"t": 0}], ["x", {"t": 5}]]}), "FormatError", "disagree"),
        "skeleton_unused_record.ink": (lambda: with_doc(skeleton={"i": 1}), "FormatError", "disagree"),
        "skeleton_negative_index.ink": (lambda: with_doc(skeleton={"l": [{"t": 0}, {"t": -1}]}), "FormatError", "missing tensor -1"),
        "skeleton_deep_nesting.ink": (
            lambda: with_doc(skeleton=_nested(300, {"t": 0}, lambda inner: {"l": [inner]})), "FormatError", "nested deeper"),
        "skeleton_lazy_import_dtype.ink": (
            lambda: with_doc(skeleton={"l": [{"t": 0}, {"dt": "_dynamo"}]}), "FormatError", "unknown dtype '_dynamo'"),
        "skeleton_surrogate_key.ink": (
            lambda: forge(header=json.dumps(dict(valid_doc(), skeleton={"d": [["w", {"t": 0}], ["\ud800", None]]})).encode(), data=W_BYTES),
            "FormatError", "surrogate"),
        "skeleton_surrogate_pair_string.ink": (
            lambda: forge(header=json.dumps(dict(valid_doc(), skeleton={"l": [{"t": 0}, {"s": "\udfff\ud83d"}]})).encode(), data=W_BYTES),
            "FormatError", "surrogate"),
        "skeleton_duplicate_key.ink": (
            lambda: with_doc(skeleton={"d": [["w", {"t": 0}], ["w", None]]}), "FormatError", "appears twice"),
        "skeleton_bad_base64.ink": (lambda: with_doc(skeleton={"l": [{"t": 0}, {"y": "not base64!"}]}), "FormatError", "bad"),
        "skeleton_float_overflow.ink": (
            lambda: forge(header=json.dumps(dict(valid_doc(), skeleton={"l": [{"t": 0}, {"f": 1.5}]})).replace("1.5", "1e999").encode(), data=W_BYTES),
            "FormatError", "bad"),
        "skeleton_unknown_tag.ink": (lambda: with_doc(skeleton={"l": [{"t": 0}, {"eval": "1+1"}]}), "FormatError", "bad"),
        "skeleton_size_negative.ink": (lambda: with_doc(skeleton={"l": [{"t": 0}, {"sz": [-1]}]}), "FormatError", "bad"),
        # -- odd but valid
        "odd_unicode_keys.ink": (_odd_unicode_file, "ok", ""),
        # -- version 2: the header is one zstd frame of bounded, declared size
        "v2_header_plain_json.ink": (
            lambda: forge(valid_doc(), W_BYTES, version=2, padding=b""), "FormatError", "not a zstd frame"),
        "v2_header_bomb.ink": (
            lambda: forge_v2(frame=zstandard.ZstdCompressor().compress(b" " * (big_header + 1)), data=W_BYTES),
            "FormatError", "inflates to 16777217 bytes"),
        "v2_header_size_unknown.ink": (
            lambda: forge_v2(frame=_frame_without_size(), data=W_BYTES), "FormatError", "does not declare its size"),
        "v2_header_two_frames.ink": (
            lambda: forge_v2(frame=_valid_frame() * 2, data=W_BYTES), "FormatError", "more or less than one zstd frame"),
        "v2_header_truncated_frame.ink": (
            lambda: forge_v2(frame=_valid_frame()[:-4], data=W_BYTES), "FormatError", "does not decode"),
        "v2_section_padded_like_v1.ink": (
            lambda: forge_v2(dict(valid_doc(), data_bytes=64 + len(W_BYTES),
                                  tensors=[dict(valid_doc()["tensors"][0], sections=[section(W_BYTES, 64)])]),
                             bytes(64) + W_BYTES),
            "FormatError", "next aligned offset 0"),
    }


def _valid_frame() -> bytes:
    return zstandard.ZstdCompressor().compress(json.dumps(valid_doc(), separators=(",", ":")).encode())


def _frame_without_size() -> bytes:
    document = json.dumps(valid_doc(), separators=(",", ":")).encode()
    return zstandard.ZstdCompressor(write_content_size=False).compress(document)


def main(directory: Path = HERE) -> None:
    """Write every corpus file and ``expected.json`` into ``directory``."""
    expected = {}
    for name, (build, error, pattern) in corpus().items():
        (directory / name).write_bytes(build())
        expected[name] = {"error": error, "match": pattern}
    (directory / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(expected)} files to {directory}", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
