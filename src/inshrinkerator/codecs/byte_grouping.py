"""Lossless byte grouping + zstd, the default codec for tensors.

A float's exponent is highly predictable while its low mantissa bits are close
to random. The codec rotates each element's bits left by one, so the sign moves
to the lowest bit and the exponent fills the top byte (all of it for fp32, bf16
and the top 8 exponent bits for fp64), then splits the elements into byte
*planes* (all top bytes together, and so on). Each plane is cut into chunks and
each chunk is zstd-compressed independently (in parallel), or kept raw when
compression does not pay. Integer and bool tensors are grouped the same way
without the rotation: the high bytes of small integers are mostly zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch
import zstandard

from ..errors import CorruptCheckpointError, FormatError
from ._parallel import parallel_map
from .base import Codec, Encoded, TensorSpec
from .registry import register_codec

__all__ = ["ByteGroupingCodec", "to_planes", "from_planes"]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_ROTATED = {torch.float32, torch.float16, torch.bfloat16, torch.float64}


def _rotate_left_one(bits: torch.Tensor) -> torch.Tensor:
    width = bits.element_size() * 8
    return (bits << 1) | ((bits >> (width - 1)) & 1)


def _rotate_right_one(bits: torch.Tensor) -> torch.Tensor:
    width = bits.element_size() * 8
    return ((bits >> 1) & ((1 << (width - 1)) - 1)) | (bits << (width - 1))


def to_planes(tensor: torch.Tensor) -> torch.Tensor:
    """The ``(itemsize, numel)`` uint8 byte planes of ``tensor`` (on the CPU)."""
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    itemsize = flat.element_size()
    if itemsize == 1:
        return flat.contiguous().view(torch.uint8).reshape(1, -1)
    bits = flat.contiguous().view(_INT_VIEW[itemsize])
    if flat.dtype in _ROTATED:
        bits = _rotate_left_one(bits)
    return bits.view(torch.uint8).reshape(-1, itemsize).t().contiguous()


def from_planes(planes: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """Inverse of :func:`to_planes`."""
    itemsize = spec.dtype.itemsize
    if itemsize == 1:
        return planes.reshape(-1).view(spec.dtype).reshape(spec.shape)
    bits = planes.t().contiguous().view(_INT_VIEW[itemsize]).reshape(-1)
    if spec.dtype in _ROTATED:
        bits = _rotate_right_one(bits)
    return bits.view(spec.dtype).reshape(spec.shape)


@register_codec
class ByteGroupingCodec(Codec):
    """Byte planes, each chunk zstd-compressed (or raw when that is smaller).

    Args:
        level: zstd level (1 is fast and within a few percent of the best on weights).
        chunk_bytes: bytes of one plane per chunk; chunks are the unit of parallelism.
    """

    codec_id = "byte_grouping"

    def __init__(self, level: int = 1, chunk_bytes: int = 1 << 20) -> None:
        if not isinstance(level, int) or not -7 <= level <= 22:
            raise ValueError(f"zstd level must be an int in [-7, 22], got {level!r}")
        if not isinstance(chunk_bytes, int) or not (1 << 12) <= chunk_bytes <= (1 << 28):
            raise ValueError(f"chunk_bytes must be an int in [4096, 2**28], got {chunk_bytes!r}")
        self.level = level
        self.chunk_bytes = chunk_bytes

    def encode(self, tensor: torch.Tensor, reference: Optional[torch.Tensor] = None) -> Encoded:
        planes = to_planes(tensor).numpy()
        pieces = [
            planes[p, start : start + self.chunk_bytes]
            for p in range(planes.shape[0])
            for start in range(0, planes.shape[1], self.chunk_bytes)
        ]
        level = self.level

        def compress(piece: np.ndarray) -> tuple[str, Any]:
            packed = zstandard.ZstdCompressor(level=level).compress(piece)
            if len(packed) < piece.nbytes:
                return "z", packed
            return "r", piece.tobytes()

        results = parallel_map(compress, pieces)
        return Encoded(
            streams=[data for _, data in results],
            params={"modes": "".join(mode for mode, _ in results)},
        )

    def decode(
        self,
        streams: Sequence[Any],
        params: dict[str, Any],
        spec: TensorSpec,
        reference: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        itemsize = spec.dtype.itemsize
        count = spec.numel
        per_plane = -(-count // self.chunk_bytes) if count else 0
        modes = params.get("modes")
        if not isinstance(modes, str) or len(modes) != per_plane * itemsize or len(streams) != len(modes):
            raise FormatError(
                f"byte_grouping: chunk layout {str(modes)[:40]!r} with {len(streams)} streams does not "
                f"fit a {spec.dtype} tensor of shape {list(spec.shape)}"
            )
        planes = torch.empty((itemsize, count), dtype=torch.uint8)
        out = planes.numpy()
        jobs = []
        for index, (mode, stream) in enumerate(zip(modes, streams)):
            plane, chunk = divmod(index, per_plane) if per_plane else (0, 0)
            start = chunk * self.chunk_bytes
            jobs.append((mode, stream, out[plane, start : min(start + self.chunk_bytes, count)]))

        def expand(job: tuple[str, Any, np.ndarray]) -> None:
            mode, stream, target = job
            if mode == "r":
                data = stream
            elif mode == "z":
                try:
                    data = zstandard.ZstdDecompressor().decompress(
                        stream, max_output_size=target.nbytes
                    )
                except zstandard.ZstdError as exc:
                    raise CorruptCheckpointError(f"byte_grouping: bad zstd chunk ({exc})") from None
            else:
                raise FormatError(f"byte_grouping: unknown chunk mode {mode!r}")
            if len(data) != target.nbytes:
                raise CorruptCheckpointError(
                    f"byte_grouping: a chunk holds {len(data)} bytes, expected {target.nbytes}"
                )
            target[:] = np.frombuffer(data, dtype=np.uint8)

        parallel_map(expand, jobs)
        return from_planes(planes, spec)
